"""Why a node is not routed, and which soft ejection the cap holds back, as each publish leaves
them: the planner changes only the entries of nodes the last publish did not route, so a node
routed again must lose its reason at that same publish."""
from __future__ import annotations

from test_control_core import all_healthy, config, in_memory

from xds_server.health import model as hm


def beat(cp, clock, probes, **fields) -> None:
    """One round of heartbeats (``fields``: node id -> heartbeat fields), then 0.1 s."""
    for nid in cp.core.node_cfg:
        probes[nid].heartbeat(**fields.get(nid, {}))
    clock.advance(0.1)


def test_a_node_routed_again_loses_its_reason_and_a_node_taken_out_gets_one():
    cp, clock, probes = in_memory(config(n=4))
    all_healthy(cp, clock, probes)
    planner = cp.core.planner
    assert all(planner.why_not_routed.get(n, "") == "" for n in cp.core.node_cfg)
    beat(cp, clock, probes, n1={"requests_waiting": 500.0})  # a soft block: queue critical
    assert planner.why_not_routed["n1"].startswith("queue: 500 waiting")
    assert cp.routing["n1"].health_status == "UNHEALTHY"
    beat(cp, clock, probes, n1={"requests_waiting": 0.0})
    assert planner.why_not_routed.get("n1", "") == "" and cp.routing["n1"].health_status == "HEALTHY"
    for _ in range(3):  # hard evidence: failed probes
        probes["n2"].probe(kind=hm.ProbeResultKind.TIMEOUT)
    beat(cp, clock, probes)
    assert planner.why_not_routed["n2"].startswith("UNHEALTHY")
    assert planner.why_not_routed.get("n1", "") == ""


def test_held_back_is_cleared_when_the_cap_has_room_again_and_for_a_node_dropped_by_a_reload():
    cp, clock, probes = in_memory(config(n=4))
    all_healthy(cp, clock, probes)
    planner = cp.core.planner
    low = {"gpu_free_ratio": 0.01}
    beat(cp, clock, probes, n0=low, n1=low, n2=low)
    assert list(planner.held_back) == ["n2"]  # cap 2 of 4: n0 and n1 out
    beat(cp, clock, probes, n1=low, n2=low)
    assert list(planner.held_back) == [] and planner.why_not_routed["n2"].startswith("GPU memory free")
    assert planner.why_not_routed.get("n0", "") == ""
    beat(cp, clock, probes, n0=low, n1=low, n2=low)
    assert list(planner.held_back) == ["n2"] and planner.why_not_routed.get("n2", "") == ""
    planner.reconfigure(cp.config, ["n2"])
    assert "n2" not in planner.held_back and "n2" not in planner.why_not_routed
