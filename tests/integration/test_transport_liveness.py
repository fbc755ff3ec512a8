"""``probe.liveness: transport`` end to end with the real Envoy. Two new agents take
the control plane's request (HTTP/2 PINGs carry their liveness, heartbeats only on change and
every ``telemetry_refresh_ms``); the third is an old-style agent (``--no-transport-liveness``,
an older agent's 1 s ping policy) that keeps sending heartbeats every 100 ms and is judged by
them. A host freeze of a transport node (engine and agent SIGSTOPped) is excluded by Envoy
when an unanswered PING fails its stream; nobody else is ever ejected, and the thawed node is
routed again."""
from __future__ import annotations

import asyncio
import time

import pytest

from xds_server.demo import FaultTimeline, wait_routed, watch_exclusion
from xds_server.testing import LoadGenerator

pytestmark = pytest.mark.envoy

FAST = {"probation": {"clean": "1.5s", "ramp_step_percent": 25, "ramp_step": "250ms"}}
OLD_AGENT = ["--no-transport-liveness", "--min-ping-interval-ms", "1000"]


def liveness_said(log_text: str) -> set[str]:
    """The liveness modes an agent's log says its streams ran."""
    return {w for w in ("transport", "heartbeat") if f"liveness {w}" in log_text}


async def test_transport_liveness_excludes_a_frozen_host_and_an_old_agent_still_works(make_fleet, http):
    fleet = make_fleet(n_nodes=3, per_try_timeout_s=1.0, health=FAST,
                       config_options={"probe": {"liveness": "transport", "telemetry_refresh_ms": 1000}},
                       agent_args=[[], [], OLD_AGENT])
    await fleet.wait_all_routed(http)
    load = LoadGenerator(fleet.url, concurrency=3)
    await load.start()
    await asyncio.sleep(1.5)
    node = fleet.node("gpu-a")
    tl = FaultTimeline("freeze", "gpu-a")
    t0 = time.monotonic()
    node.engine.freeze()
    node.agent.freeze()
    try:
        await watch_exclusion(fleet, http, tl, t0, timeout_s=8.0)
        await asyncio.sleep(1.0)
        frozen = load.phase("frozen, excluded")
        await asyncio.sleep(1.5)
        load.phase("thawed")  # ends the frozen phase: requests after the thaw may go to gpu-a again
    finally:
        node.agent.thaw()
        node.engine.thaw()
    routed_again = await wait_routed(fleet, http, "gpu-a", timeout_s=20)
    await load.stop()
    total = load.totals()
    async with http.get(f"http://127.0.0.1:{fleet.admin_port}/nodes") as r:
        nodes = {n["id"]: n for n in (await r.json())["nodes"]} if r.status == 200 else {}
    logs = {n.node_id: n.agent.log_path.read_text(errors="replace") for n in fleet.nodes}
    print(f"\ntransport liveness: ejected after {tl.cp_ejected_s}, Envoy excluded after {tl.envoy_excluded_s} s "
          f"({tl.cp_reason}); routed again {routed_again} s after thaw; modes "
          f"{ {k: sorted(liveness_said(v)) for k, v in logs.items()} }")
    assert liveness_said(logs["gpu-a"]) == {"transport"} and liveness_said(logs["gpu-b"]) == {"transport"}
    assert liveness_said(logs["gpu-c"]) == {"heartbeat"}   # the old-style agent ignored the request
    assert tl.envoy_excluded_s is not None and tl.envoy_excluded_s < 5.0
    assert "ping timeout" in tl.cp_reason, tl.cp_reason   # the transport failed the stream, not a heartbeat gap
    assert frozen.ok_by_node.get("gpu-a", 0) == 0 and frozen.ok_by_node.get("gpu-c", 0) > 0
    assert routed_again is not None
    assert total.failed == 0, dict(total.failures)
    for nid in ("gpu-b", "gpu-c"):  # never ejected: the heartbeat agent and the quiet transport one
        assert nodes[nid]["state"] == "HEALTHY", nodes[nid]
