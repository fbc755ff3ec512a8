"""A node answering every probe with 429 does not keep its share: scenarios on the pure
health model and cluster policy, numbers in their names.

After ``busy_refusal_block_s`` (15 s) of only refusals the node is REFUSING: a soft block (not
routed, counted against ``max_ejection_percent``, held back and routed at the DEGRADED share when
the cap is reached), with a reason that states the run; its first good probe routes it again at
full weight (or at the DEGRADED share after an answer that is not good), without probation or ramp.
"""
from __future__ import annotations

from test_busy_not_dead import CFG, healthy_sim

from xds_server.config import HealthConfig
from xds_server.health.model import (
    HeartbeatObserved,
    ProbeObserved,
    route,
)
from xds_server.health.model import (
    NodeState as S,
)
from xds_server.health.model import (
    ProbeResultKind as K,
)
from xds_server.health.sim import NodeSim
from xds_server.policy.cluster_routing import PolicyEventKind, cluster_routing

R429 = ProbeObserved(K.HTTP_STATUS, http_status=429)


def refuse_from(sim: NodeSim, t0: float, t_end: float, every_s: float = 0.5) -> None:
    """Every probe from ``t0`` answered 429 (the agent's 0.5 s idle cadence), up to ``t_end``."""
    sim.probe_every_s = every_s
    sim.probe = lambda t: R429 if t >= t0 else ProbeObserved(K.OK, ttft_ms=25)
    sim.run_until(t_end)


def test_429_on_every_probe_for_15s_blocks_the_node_with_the_run_as_reason_then_1_good_probe_full_weight():
    sim = healthy_sim()
    refuse_from(sim, 4.0, 19.4)   # probes at 4.5, 5.0, ...
    assert sim.nh.state is S.DEGRADED and route(sim.nh, 1, CFG).weight == 30   # 14.5 s of 429: still a share
    sim.run_until(19.6)
    assert sim.nh.state is S.REFUSING
    r = route(sim.nh, 1, CFG)
    assert r.health_status == "UNHEALTHY" and r.weight == 100                   # not routed (weight never 0)
    block = next(e for e in sim.events if e.to_state is S.REFUSING)
    assert block.at_s == 19.5 and block.from_state is S.DEGRADED
    assert block.reason.startswith("busy: every probe answered HTTP 429 for 15.0 s (31 probes, no good probe)")
    assert block.reason.endswith("not routed until a probe is answered")
    sim.run_until(30.1)   # still refusing: the reason follows the run
    assert sim.nh.state is S.REFUSING and "for 25.5 s (52 probes" in sim.nh.reason
    sim.apply(ProbeObserved(K.OK, ttft_ms=30), 30.2)
    assert sim.nh.state is S.HEALTHY and route(sim.nh, 1, CFG).weight == 100
    assert sim.nh.reason.startswith("load eased: first good probe (TTFT 30 ms) after refusing work")
    assert not any(e.to_state in (S.PROBATION, S.UNHEALTHY) for e in sim.events if e.at_s > 4.0)


def test_429_burst_of_14s_then_a_good_probe_never_blocks():
    sim = healthy_sim()
    refuse_from(sim, 4.0, 18.2)
    sim.apply(ProbeObserved(K.OK, ttft_ms=30), 18.3)
    assert sim.nh.state is S.HEALTHY
    assert not any(e.to_state is S.REFUSING for e in sim.events)


def test_429_run_broken_at_10s_by_a_slow_answer_restarts_the_15s_clock():
    sim = healthy_sim()
    for i in range(21):                                   # 4.0 .. 14.0: 10 s of 429
        sim.apply(R429, 4.0 + 0.5 * i)
    sim.apply(ProbeObserved(K.OK, ttft_ms=450), 14.3)     # slow, but it took the probe
    for i in range(30):                                   # 14.5 .. 29.0: 14.5 s of 429
        sim.apply(R429, 14.5 + 0.5 * i)
    assert sim.nh.state is S.DEGRADED
    sim.apply(R429, 29.5)                                 # 15.0 s since 14.5
    assert sim.nh.state is S.REFUSING and "for 15.0 s (31 probes" in sim.nh.reason


def test_refusing_then_a_450ms_answer_is_routed_at_the_30pct_busy_share_not_probation():
    sim = healthy_sim()
    for i in range(32):
        sim.apply(R429, 4.0 + 0.5 * i)
    assert sim.nh.state is S.REFUSING
    sim.apply(ProbeObserved(K.OK, ttft_ms=450), 20.0)
    assert sim.nh.state is S.DEGRADED and route(sim.nh, 1, CFG).weight == 30
    assert "took work again after refusing it" in sim.nh.reason
    sim.apply(ProbeObserved(K.OK, ttft_ms=30), 20.5)      # only busy: 1 good probe
    assert sim.nh.state is S.HEALTHY and route(sim.nh, 1, CFG).weight == 100


def test_refusing_then_2_timeouts_without_progress_is_ejected_and_stays_unrouted_meanwhile():
    sim = healthy_sim()
    for i in range(32):
        sim.apply(R429, 4.0 + 0.5 * i)
    sim.apply(ProbeObserved(K.TIMEOUT), 20.0)
    assert sim.nh.state is S.REFUSING and route(sim.nh, 1, CFG).health_status == "UNHEALTHY"
    assert sim.nh.reason.startswith("probe failure: inference timeout")
    sim.apply(ProbeObserved(K.TIMEOUT), 20.5)
    assert sim.nh.state is S.UNHEALTHY


def test_refusing_after_a_failed_probation_returns_degraded_and_needs_3_good_probes():
    sim = NodeSim(cfg=HealthConfig(ramp_step_percent=1, ramp_step_s=1.0))
    sim.run_until(2.0)
    assert sim.nh.state is S.PROBATION
    for i in range(32):
        sim.apply(R429, 2.0 + 0.5 * i)
    assert sim.nh.state is S.REFUSING
    for k, t in enumerate((18.0, 18.5, 19.0, 19.5)):
        sim.apply(ProbeObserved(K.OK, ttft_ms=30), t)
        assert sim.nh.state is (S.HEALTHY if k == 3 else S.DEGRADED)


def test_refusal_with_progress_300ms_old_gives_the_age_never_progressing():
    sim = healthy_sim()
    sim.apply(HeartbeatObserved(requests_running=8, progress_age_ms=200,
                                progress_detail="engine 0: tokens 5 -> 9"), 4.4)
    sim.apply(R429, 4.5)
    assert sim.nh.reason == ("busy: saturated, the engine refuses work (HTTP 429); last progress 0.3 s ago: "
                             "engine 0: tokens 5 -> 9")


def _refusing_node(nid: str):
    sim = healthy_sim()
    sim.node_id = nid
    for i in range(32):
        sim.apply(R429, 4.0 + 0.5 * i)
    assert sim.nh.state is S.REFUSING
    return sim.nh


def test_3_of_4_refusing_cap_50pct_blocks_2_and_holds_back_1_at_30pct_counted_once():
    from dataclasses import replace
    refusing = _refusing_node("x")
    fine = healthy_sim().nh
    nodes = [("n0", 1, replace(refusing, node_id="n0")), ("n1", 1, replace(refusing, node_id="n1")),
             ("n2", 1, replace(refusing, node_id="n2")), ("n3", 1, replace(fine, node_id="n3"))]
    d = cluster_routing(nodes, {}, 20.0, CFG)
    assert [d.routing[n].health_status for n in ("n0", "n1", "n2", "n3")] == ["UNHEALTHY", "UNHEALTHY", "HEALTHY",
                                                                               "HEALTHY"]
    assert d.held_back == ("n2",) and d.routing["n2"].weight == 30
    assert d.why_not_routed["n0"].startswith("busy: every probe answered HTTP 429 for 15.5 s")
    [ev] = [e for e in d.events if e.kind is PolicyEventKind.HELD_BACK]
    assert ev.node_id == "n2" and "not ejected: 2 of 4 already out" in ev.reason
    again = cluster_routing(nodes, d.outliers, 20.5, CFG, held_before=d.held_back)
    assert again.held_back == ("n2",) and not [e for e in again.events if e.kind is PolicyEventKind.HELD_BACK]
