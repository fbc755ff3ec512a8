"""Health rules beyond the seed scenarios: config-driven thresholds, typed inputs, one home per fact."""
from __future__ import annotations

from dataclasses import replace

import pytest

from xds_server.config import ConfigError, HealthConfig, parse_config
from xds_server.health.model import (
    EjectionCause,
    Engine,
    EngineState,
    HeartbeatObserved,
    Heartbeats,
    NodeHealth,
    ProbeObserved,
    ProbeOutcome,
    Probes,
    Routing,
    RoutingStatus,
    Rtt,
    Tick,
    classify_probe,
    initial,
    miss_after_s,
    misses_at,
    route,
    step,
)
from xds_server.health.model import (
    NodeState as S,
)
from xds_server.health.model import (
    ProbeResultKind as K,
)
from xds_server.health.sim import NodeSim
from xds_server.policy.cluster_routing import FailStaticState, cluster_routing, fail_static

FAST_RAMP = HealthConfig(ramp_step_percent=50, ramp_step_s=1.0)


def healthy_sim(cfg=FAST_RAMP, until=4.0, **kw) -> NodeSim:
    sim = NodeSim(cfg=cfg, **kw)
    sim.run_until(until)
    assert sim.nh.state is S.HEALTHY, sim.events
    return sim


def test_engine_fatal_during_a_phi_suspicion_is_not_undone_by_the_next_heartbeat():
    sim = healthy_sim()
    sim.heartbeat = lambda t: None if t >= 4.05 else HeartbeatObserved()
    sim.run_until(4.28)  # phi convicts ~212 ms after the last heartbeat; the count rule at +380 ms
    assert sim.nh.state is S.UNHEALTHY and sim.nh.ejection.cause is EjectionCause.PHI
    sim.apply(ProbeObserved(K.ENGINE_FATAL, detail="CUDA error"), 4.29)
    assert sim.nh.ejection.cause is EjectionCause.ENGINE and "CUDA error" in sim.nh.reason
    sim.apply(HeartbeatObserved(), 4.3)
    assert sim.nh.state is S.UNHEALTHY and not any("disproved" in e.reason for e in sim.events)


def test_a_disproved_suspicion_in_probation_restarts_the_ramp_at_its_start():
    cfg = HealthConfig(ramp_step_s=0.5)
    sim = NodeSim(cfg=cfg)
    sim.run_until(3.0)
    assert sim.nh.state is S.PROBATION and sim.nh.ramp.percent > cfg.probation.ramp_start_percent
    sim.heartbeat = lambda t: None if 3.05 <= t < 3.3 else HeartbeatObserved()
    sim.run_until(3.31)
    back = sim.events[-1]
    assert (back.from_state, back.to_state) == (S.UNHEALTHY, S.PROBATION) and "disproved" in back.reason
    assert sim.nh.ramp.percent == cfg.probation.ramp_start_percent and sim.nh.ramp.step_at_s == back.at_s


@pytest.mark.parametrize(("cfg", "status", "outcome"), [
    (HealthConfig(), 503, ProbeOutcome.BUSY),
    (HealthConfig(saturated_http_statuses=()), 503, ProbeOutcome.FAIL),
    (HealthConfig(saturated_http_statuses=(500, 503)), 500, ProbeOutcome.BUSY),
])
def test_saturated_http_statuses_come_from_config_while_busy(cfg, status, outcome):
    # busy with evidence: a progress signal moved 0.1 s before the probe result (at 1.0 s)
    busy = replace(initial("n", 0.0), engine=Engine(EngineState.READY, requests_running=8, progress_at_s=0.9,
                                                    progress_detail="engine 0: tokens 10 -> 300"))
    got, what = classify_probe(busy, ProbeObserved(K.HTTP_STATUS, http_status=status), cfg, 1.0)
    assert got is outcome and f"HTTP {status}" in what


def test_busy_http_statuses_are_busy_even_when_idle_and_configurable():
    idle = initial("n", 0.0)
    assert classify_probe(idle, ProbeObserved(K.HTTP_STATUS, http_status=429), HealthConfig(),
                          1.0)[0] is ProbeOutcome.BUSY
    assert classify_probe(idle, ProbeObserved(K.HTTP_STATUS, http_status=503), HealthConfig(),
                          1.0)[0] is ProbeOutcome.FAIL
    cfg = HealthConfig(busy_http_statuses=())
    assert classify_probe(idle, ProbeObserved(K.HTTP_STATUS, http_status=429), cfg, 1.0)[0] is ProbeOutcome.FAIL


def test_fail_static_forgiveness_window_is_config_intervals():
    from xds_server.health.model import FailStaticEnded

    def run(intervals):
        sim = healthy_sim(cfg=HealthConfig(ramp_step_percent=50, fail_static_forgive_intervals=intervals))
        sim.heartbeat = lambda t: None if 4.05 <= t < 7.0 else HeartbeatObserved()  # back 1.35 s after the end
        sim.run_until(5.6)
        sim.apply(FailStaticEnded(burst_start_s=4.0), 5.65)
        sim.run_until(7.2)
        return sim.nh.state

    assert run(10) is S.UNHEALTHY   # 10 x 100 ms: too late
    assert run(20) is S.HEALTHY     # 20 x 100 ms: forgiven


@pytest.mark.parametrize(("window_s", "phi_ejections_at"), [(5.0, [4, 10]), (60.0, [4])])
def test_phi_rate_limit_uses_the_suspicion_window(window_s, phi_ejections_at):
    cfg = HealthConfig(ramp_step_percent=50, phi_max_suspicions_per_min=1, phi_suspicion_window_s=window_s)
    sim = healthy_sim(cfg=cfg)
    gaps = [(4.05, 4.25), (6.05, 6.25), (10.05, 10.25)]  # 300 ms silences: phi convicts, count rule never
    sim.heartbeat = lambda t: None if any(a <= t < b for a, b in gaps) else HeartbeatObserved()
    sim.run_until(11.0)
    ejections = [e for e in sim.events if e.to_state is S.UNHEALTHY]
    assert all("phi" in e.reason for e in ejections)
    assert [int(e.at_s) for e in ejections] == phi_ejections_at  # 6 s: limited (1 disproved in the window)
    assert sim.nh.state is S.HEALTHY


def _unhealthy_clean(ewma_ms: float, baseline_ms: float) -> NodeHealth:
    nh = initial("n", 0.0)
    return replace(nh, state=S.UNHEALTHY, reason="probe", heartbeat=Heartbeats(last_s=99.95),
                   rtt=Rtt(ewma_ms=ewma_ms, baseline_ms=baseline_ms),
                   probe=Probes(clean_since_s=0.0, clean_probes=60), engine=Engine(EngineState.READY),
                   ejection=replace(nh.ejection, cause=EjectionCause.PROBE, from_state=S.HEALTHY))


@pytest.mark.parametrize(("slack_ms", "state"), [(1.0, S.PROBATION), (0.0, S.UNHEALTHY)])
def test_rtt_back_at_baseline_allows_the_configured_slack(slack_ms, state):
    cfg = HealthConfig(rtt_baseline_slack_ms=slack_ms)
    nh, _ = step(_unhealthy_clean(ewma_ms=2.0, baseline_ms=1.0), Tick(), 100.0, cfg)  # 1.5 x 1.0 < 2.0
    assert nh.state is state


def test_bad_inputs_raise_errors_naming_the_field():
    with pytest.raises(ValueError, match=r"HeartbeatObserved\.engine_state: 'BOGUS'"):
        HeartbeatObserved(engine_state="BOGUS")
    with pytest.raises(ValueError, match=r"ProbeObserved\.kind"):
        ProbeObserved("NOPE")
    with pytest.raises(ValueError, match=r"Routing\.health_status: 'UP'"):
        Routing(1, "UP")
    assert HeartbeatObserved(engine_state="WARMING").engine_state is EngineState.WARMING
    assert Routing(5, "DRAINING").health_status is RoutingStatus.DRAINING
    doc = {"clusters": [{"name": "c", "nodes": [{"id": "a", "address": "10.0.0.1:80",
                                                  "probe_address": "10.0.0.1:81"}]}],
           "health": {"saturated_http_statuses": [429, 700]}}
    with pytest.raises(ConfigError, match=r"health\.busy\.saturated_http_statuses: .*700"):
        parse_config(doc)


def test_interval_plus_grace_has_one_home_used_by_misses_and_fail_static():
    cfg = HealthConfig(heartbeat_interval_ms=100, heartbeat_grace_ms=300)
    assert miss_after_s(cfg) == pytest.approx(0.4)
    assert misses_at(0.0, 0.399, cfg) == 0 and misses_at(0.0, 0.4, cfg) == 1
    nodes = {f"n{i}": replace(initial(f"n{i}", 0.0), heartbeat=Heartbeats(last_s=10.0)) for i in range(3)}
    assert not fail_static(FailStaticState(), nodes, 10.35, cfg)[0].active  # within interval + grace
    assert fail_static(FailStaticState(), nodes, 10.45, cfg)[0].active


@pytest.mark.parametrize("probe_ms", [20.0, 450.0])
def test_a_lone_node_gets_the_same_weight_from_route_and_from_cluster_policy(probe_ms):
    sim = healthy_sim()
    sim.apply(ProbeObserved(K.OK, ttft_ms=probe_ms), 4.5)
    alone = cluster_routing([("n", 3, sim.nh)], {}, 4.5, FAST_RAMP).routing["n"]
    assert alone == route(sim.nh, 3, FAST_RAMP) == Routing(300 if probe_ms < 200 else 90, RoutingStatus.HEALTHY)
