"""Probe workers with real processes: `xds-server serve` with probe.workers = 2, real agents on
simulated engines, the real Envoy. A worker SIGKILLed mid-run is replaced, none of its nodes is
ejected for it, detection works afterwards; workers die with the control plane (no orphans)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from xds_server.probing.workers import worker_for
from xds_server.testing import wait_for

pytestmark = pytest.mark.envoy

GRACE_MS = 2000
ROUTED = {"PROBATION", "HEALTHY", "DEGRADED"}


def workers_of(cp_pid: int) -> dict[int, int]:
    """Worker index -> pid of the probe workers whose parent is ``cp_pid`` (from /proc)."""
    out: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == cp_pid and b"xds_server.probing.workers._worker" in argv:
            out[int(argv[argv.index(b"xds_server.probing.workers._worker") + 4])] = int(d.name)
    return out


async def worker_metrics(http: aiohttp.ClientSession, admin_port: int) -> dict[str, float]:
    """``sentinel_probe_worker_restarts_total`` per worker ("restarts/0", ...), and the live and
    configured worker gauges ("live", "configured"), from /metrics."""
    async with http.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
        text = await r.text()
    out = {f"restarts/{m[1]}": float(m[2]) for m in
           re.finditer(r'^sentinel_probe_worker_restarts_total\{worker="(\d+)"\} (\S+)$', text, re.M)}
    for key in ("live", "configured"):
        if m := re.search(rf"^sentinel_probe_workers_{key} (\S+)$", text, re.M):
            out[key] = float(m[1])
    return out


async def ejections(http: aiohttp.ClientSession, admin_port: int) -> dict[str, float]:
    """``sentinel_node_ejections_total`` per node (summed over causes) from /metrics."""
    async with http.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for m in re.finditer(r'^sentinel_node_ejections_total\{[^}]*node="([^"]+)"[^}]*\} (\S+)$', text, re.M):
        out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


async def test_killed_worker_is_replaced_without_ejections_and_detection_still_works(make_fleet, http):
    fleet = make_fleet(n_nodes=4, probe_interval_s=0.5,
                       config_options={"probe": {"workers": 2, "worker_restart_grace_ms": GRACE_MS,
                                                 "worker_report_interval_ms": 200}})
    ids = [n.node_id for n in fleet.nodes]
    mine = [i for i in ids if worker_for(i, 2) == 0]
    assert mine and len(mine) < len(ids)  # both workers own nodes; worker 0 is the one killed
    await fleet.wait_all_routed(http)
    cp_pid = fleet.control_plane.pid
    before = await wait_for(lambda: w if len(w := workers_of(cp_pid)) == 2 else None, 10,
                            what="two probe workers expected")
    nodes = await fleet.cp_nodes(http)
    assert all(nodes[i]["state"] in ROUTED and nodes[i]["probe_stream_connected"] for i in ids), nodes
    ej0 = await ejections(http, fleet.admin_port)
    assert await worker_metrics(http, fleet.admin_port) == {
        "restarts/0": 0.0, "restarts/1": 0.0, "live": 2.0, "configured": 2.0}

    os.kill(before[0], signal.SIGKILL)
    killed_at = time.monotonic()
    # Through the restart, the re-dial and past the grace: every node stays routed, in /nodes and
    # in Envoy (a worker's start-up is ~0.7 s of CPU: seconds on a loaded 2-core host).
    replaced = None
    while time.monotonic() - killed_at < 30.0:
        nodes = await fleet.cp_nodes(http)
        assert all(nodes[i]["state"] in ROUTED for i in ids), {i: nodes[i]["state"] for i in ids}
        hosts = await fleet.envoy_hosts(http)
        assert all(hosts[i] == "HEALTHY" for i in ids), hosts
        now = workers_of(cp_pid)
        if now.get(0) not in (None, before[0]):
            replaced = now[0]
        back = replaced is not None and all(nodes[i]["probe_stream_connected"] for i in mine)
        if back and time.monotonic() - killed_at > GRACE_MS / 1000.0 + 0.5:
            break
        await asyncio.sleep(0.1)
    assert replaced is not None, "worker 0 was not replaced"
    assert back, "worker 0's nodes were not re-dialled"
    assert workers_of(cp_pid)[1] == before[1]  # the other worker was left alone
    assert await ejections(http, fleet.admin_port) == ej0, "a node was ejected because its worker died"
    # the restart is on /metrics: one for worker 0, none for worker 1, both running again
    assert await worker_metrics(http, fleet.admin_port) == {
        "restarts/0": 1.0, "restarts/1": 0.0, "live": 2.0, "configured": 2.0}

    # Detection in the new worker: freeze one of its agents, the node is excluded.
    victim = mine[0]
    fleet.node(victim).agent.freeze()
    try:
        assert await fleet.wait_ejected(http, victim) < 5.0
        after = await ejections(http, fleet.admin_port)
        assert after.get(victim, 0) > ej0.get(victim, 0)
        assert {i: after.get(i, 0) for i in ids if i != victim} == {i: ej0.get(i, 0) for i in ids if i != victim}
    finally:
        fleet.node(victim).agent.thaw()

    # No orphans: the control plane killed outright takes its workers with it.
    workers = workers_of(cp_pid)
    os.kill(cp_pid, signal.SIGKILL)
    await wait_for(lambda: not any(_alive(p) for p in workers.values()), 5,
                   what=f"probe workers {workers} outlived the control plane")


def _alive(pid: int) -> bool:
    """Running or sleeping (a zombie waiting for its reaper is dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

