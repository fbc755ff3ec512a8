"""`xds-server serve --loop uvloop`: the real control plane on uvloop, its probe sessions in
process (probe.workers 0) or in a worker process that runs uvloop too; real agents on simulated
engines, the real Envoy. Every node is routed, a frozen agent's node is ejected and Envoy stops
routing to it, no other node is ejected. In process on uvloop, RTT samples keep their
sub-millisecond precision (uvloop's loop clock counts whole milliseconds)."""
from __future__ import annotations

from pathlib import Path

import pytest
from scripted_agent import ScriptedAgent

from xds_server.config import parse_config
from xds_server.control.core import ControlCore
from xds_server.health.model import PingObserved
from xds_server.process import event_loop
from xds_server.server import ControlPlane
from xds_server.testing import wait_for

pytestmark = pytest.mark.envoy

ROUTED = {"PROBATION", "HEALTHY", "DEGRADED"}


def worker_loops(cp_pid: int) -> list[str]:
    """The LOOP argument of each probe worker process whose parent is ``cp_pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == cp_pid and b"xds_server.probing.workers._worker" in argv:
            out.append(argv[-1].decode())
    return out


@pytest.mark.parametrize("workers", [0, 1])
async def test_the_control_plane_on_uvloop_routes_and_ejects_a_frozen_node(make_fleet, http, workers):
    pytest.importorskip("uvloop", reason="uvloop is in the dev extra")
    fleet = make_fleet(n_nodes=3, probe_interval_s=0.5, serve_args=["--loop", "uvloop"],
                       config_options={"probe": {"workers": workers}})
    ids = [n.node_id for n in fleet.nodes]
    await fleet.wait_all_routed(http)
    log = fleet.workdir / "xds-server.log"
    await wait_for(lambda: "event loop: uvloop" in log.read_text(), 5, what="no 'event loop: uvloop' in the log")
    cp_pid = fleet.control_plane.pid
    if workers:
        assert await wait_for(lambda: worker_loops(cp_pid) or None, 10, what="no probe worker") == ["uvloop"]
    else:
        assert worker_loops(cp_pid) == []

    victim = ids[0]
    fleet.node(victim).agent.freeze()
    try:
        assert await fleet.wait_ejected(http, victim) < 5.0
        nodes = await fleet.cp_nodes(http)
        assert all(nodes[i]["state"] in ROUTED for i in ids[1:]), {i: nodes[i]["state"] for i in ids}
        hosts = await fleet.envoy_hosts(http)
        assert all(hosts[i] == "HEALTHY" for i in ids[1:]), hosts
    finally:
        fleet.node(victim).agent.thaw()



def test_rtt_samples_keep_sub_millisecond_precision_on_uvloop(monkeypatch):
    pytest.importorskip("uvloop", reason="uvloop is in the dev extra")
    samples: list[float] = []
    observe = ControlCore.observe

    def recording(self, node_id, obs, now_s):
        if isinstance(obs, PingObserved):
            samples.append(obs.rtt_ms)
        return observe(self, node_id, obs, now_s)

    monkeypatch.setattr(ControlCore, "observe", recording)

    async def scenario() -> str:
        agent = await ScriptedAgent.start()
        cp = ControlPlane(parse_config({
            "xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0"},
            "health": {"ping_interval_ms": 50},
            "clusters": [{"name": "llm", "nodes": [
                {"id": "a", "address": "127.0.0.1:8001", "probe_address": f"127.0.0.1:{agent.port}"}]}]}))
        await cp.start()
        try:
            await wait_for(lambda: len(samples) >= 10, 10, what=lambda: f"RTT samples {samples}")
        finally:
            await cp.stop()
            await agent.stop()
        return event_loop.running_loop_name()

    assert event_loop.run(scenario(), "uvloop") == "uvloop"
    assert all(0.0 <= s < 1000.0 for s in samples), samples
    assert any(abs(s - round(s)) > 1e-6 for s in samples), f"whole milliseconds only: {samples}"
