"""A node that cannot warm, on the pure health model: a COLD/WARMING node whose probes fail, or that has no
good probe within ``health.probes.warm_limit``, says so with the last probe result ("cannot warm: ..."), once
as an event; its consecutive failures are counted. It is never routed before a good probe.

Numbers in the names: the agent probes every 0.5 s (NodeSim), ``probe_failures_to_eject`` 2,
``health.probes.warm_limit`` 300 s (default) or as given.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import HealthConfig
from xds_server.health.model import HeartbeatObserved, NodeState, ProbeObserved, route
from xds_server.health.model import ProbeResultKind as K
from xds_server.health.sim import NodeSim

CFG = HealthConfig()
HINT = "/v1/models answered 404: is --engine-url an inference engine? (model discovery: GET ...)"
R404 = ProbeObserved(K.HTTP_STATUS, http_status=404, detail=HINT)
R429 = ProbeObserved(K.HTTP_STATUS, http_status=429)
CONNECT = ProbeObserved(K.CONNECT, detail="POST http://127.0.0.1:8000/v1/completions: Cannot connect")


def warming(probe, cfg: HealthConfig = CFG) -> NodeSim:
    return NodeSim(cfg=cfg, probe_every_s=0.5, probe=lambda t: probe,
                   heartbeat=lambda t: HeartbeatObserved(engine_state="WARMING"))


def reports(sim: NodeSim) -> list:
    return [e for e in sim.events if e.reason.startswith("cannot warm: ")]


def test_404_from_something_that_answers_cannot_warm_after_2_failures_one_event_counter_counts():
    sim = warming(R404)
    sim.run_until(0.3)   # first probe at 0.25 s
    assert sim.nh.state is NodeState.WARMING and sim.nh.probe.consecutive_failures == 1
    assert sim.nh.reason.startswith("warming, no good probe yet (1 consecutive probe failure): HTTP 404: /v1/models")
    sim.run_until(0.8)
    assert sim.nh.probe.consecutive_failures == 2
    assert sim.nh.reason == ("cannot warm: 2 consecutive probe failures from an engine that answers; "
                             f"last probe: HTTP 404: {HINT}")
    sim.run_until(60.0)
    assert sim.nh.state is NodeState.WARMING and sim.nh.probe.consecutive_failures == 120
    assert sim.nh.reason.startswith("cannot warm: 120 consecutive probe failures")
    [ev] = reports(sim)  # once, not per probe
    assert ev.at_s == 0.75 and ev.from_state is ev.to_state is NodeState.WARMING
    assert route(sim.nh, 1, CFG).health_status == "UNHEALTHY"


def test_connect_failures_of_a_loading_engine_are_counted_but_cannot_warm_only_after_the_300s_limit():
    sim = warming(CONNECT)
    sim.run_until(299.0)
    assert sim.nh.probe.consecutive_failures == 598 and not reports(sim)
    assert sim.nh.reason.startswith("warming, no good probe yet (598 consecutive probe failures): CONNECT")
    sim.run_until(301.0)
    [ev] = reports(sim)
    assert ev.at_s == 300.25 and ev.reason.startswith(
        "cannot warm: no good probe 300 s after WARMING began (probes.warm_limit 5m), 601 consecutive probe failures; "
        "last probe: CONNECT")


def test_429_from_the_start_is_not_a_failure_and_cannot_warm_at_a_30s_limit_then_a_good_probe_promotes():
    sim = warming(R429, HealthConfig(warm_limit_s=30))
    sim.run_until(29.9)
    assert sim.nh.probe.consecutive_failures == 0 and not reports(sim)
    # past busy_refusal_block_s (15 s) the reason states the run of refusals
    assert sim.nh.reason == "warming, no good probe yet: busy: every probe answered HTTP 429 for 29.5 s " \
        "(60 probes, no good probe)"
    sim.run_until(30.3)
    [ev] = reports(sim)
    assert ev.reason == ("cannot warm: no good probe 30 s after WARMING began (probes.warm_limit 30s); "
                         "last probe: busy: every probe answered HTTP 429 for 30.0 s (61 probes, no good probe)")
    sim.probe = lambda t: ProbeObserved(K.OK, ttft_ms=30)
    sim.run_until(31.0)
    assert sim.nh.state is NodeState.PROBATION and sim.nh.probe.consecutive_failures == 0
    assert not sim.nh.probe.warm_reported


def test_a_restarted_engine_that_cannot_warm_again_is_reported_again():
    sim = warming(R404)
    sim.run_until(1.0)
    sim.probe = lambda t: ProbeObserved(K.OK, ttft_ms=30)
    sim.heartbeat = lambda t: HeartbeatObserved(engine_state="READY")
    sim.run_until(5.0)
    assert sim.nh.state in (NodeState.PROBATION, NodeState.HEALTHY)
    sim.heartbeat = lambda t: HeartbeatObserved(engine_state="WARMING")   # restart
    sim.probe = lambda t: R404
    sim.run_until(8.0)
    assert sim.nh.state is NodeState.WARMING and len(reports(sim)) == 2


_RESULTS = st.sampled_from([R404, R429, CONNECT, ProbeObserved(K.TIMEOUT), ProbeObserved(K.BAD_OUTPUT, http_status=200),
                            ProbeObserved(K.HTTP_STATUS, http_status=503), ProbeObserved(K.ENGINE_FATAL)])


@settings(max_examples=150, deadline=None)
@given(results=st.lists(_RESULTS, min_size=1, max_size=40), limit_s=st.floats(1.0, 30.0))
def test_prop_without_a_good_probe_a_warming_node_is_never_routed_reported_at_most_once_and_counts_failures(
        results, limit_s):
    cfg = HealthConfig(warm_limit_s=limit_s)
    sim = warming(results[0], cfg)
    sim.probe = lambda t: results[min(len(results) - 1, int(t / 0.5))]
    sim.run_until(len(results) * 0.5)
    failures = 0
    for r in results[: sim.nh.probe.seen]:
        failures += r is not R429  # a refusal neither counts nor clears the run (as in routed states)
    assert sim.nh.state is NodeState.WARMING and route(sim.nh, 1, cfg).health_status == "UNHEALTHY"
    assert len(reports(sim)) <= 1 and sim.nh.probe.consecutive_failures == failures
    assert sim.nh.reason.startswith(("warming, no good probe yet", "cannot warm: "))
    if sim.nh.probe.warm_reported:
        assert sim.nh.reason.startswith("cannot warm: ") and len(reports(sim)) == 1
