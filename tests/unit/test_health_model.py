"""The per-node health state machine: seed scenarios as tables (docs/DESIGN.md section 4)."""
from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import HealthConfig
from xds_server.health.model import (
    DrainRequested,
    EjectionCause,
    HeartbeatObserved,
    PingObserved,
    ProbeObserved,
    Routing,
    RoutingStatus,
    StreamClosed,
    Tick,
    misses_at,
    node_routing,
    route,
)
from xds_server.health.model import (
    NodeState as S,
)
from xds_server.health.model import (
    ProbeResultKind as K,
)
from xds_server.health.sim import NodeSim

CFG = HealthConfig()
COUNT = HealthConfig(failure_detector="count")
FAST_RAMP = HealthConfig(ramp_step_percent=50, ramp_step_s=1.0)  # PROBATION 1 % -> 51 % -> 100 %


def healthy_sim(cfg=FAST_RAMP, until=4.0, **kw) -> NodeSim:
    sim = NodeSim(cfg=cfg, **kw)
    sim.run_until(until)
    assert sim.nh.state is S.HEALTHY, sim.events
    return sim


def test_cold_warming_probation_healthy_with_startup_grace():
    sim = NodeSim(cfg=FAST_RAMP, probe=lambda t: ProbeObserved(K.TIMEOUT) if t < 2 else ProbeObserved(K.OK, ttft_ms=30))
    sim.run_until(0.05)
    assert sim.nh.state is S.WARMING and route(sim.nh, 1, FAST_RAMP).health_status == "UNHEALTHY"
    sim.run_until(1.9)
    # failures counted and shown, never ejected: a timeout is what a loading engine gives
    assert sim.nh.state is S.WARMING and sim.nh.probe.consecutive_failures >= 2
    assert sim.nh.reason.startswith("warming, no good probe yet (") and "inference timeout" in sim.nh.reason
    sim.run_until(6.0)
    assert [e.to_state for e in sim.events] == [S.WARMING, S.PROBATION, S.HEALTHY]
    assert sim.events[1].reason.startswith("first good probe")


def test_warming_engine_never_routed_before_first_good_probe_then_ramps_from_1pct():
    """Field case fc08."""
    # /health would say 200 from t=10 s, but completions block until t=270 s: every probe times out.
    sim = NodeSim(cfg=CFG, heartbeat=lambda t: HeartbeatObserved(engine_state="WARMING" if t < 270 else "READY"),
                  probe=lambda t: ProbeObserved(K.TIMEOUT) if t < 270 else ProbeObserved(K.OK, ttft_ms=40))
    for t in range(1, 270, 10):
        sim.run_until(float(t))
        r = route(sim.nh, 1, CFG)
        assert r.health_status == "UNHEALTHY" and sim.nh.state in (S.COLD, S.WARMING)
    sim.run_until(271.0)
    # no transition into a routed state before the first good probe at t >= 270 s
    routed_at = [e.at_s for e in sim.events if e.to_state in (S.PROBATION, S.HEALTHY, S.DEGRADED)]
    assert routed_at and min(routed_at) >= 270.0
    assert sim.nh.state is S.PROBATION
    assert route(sim.nh, 1, CFG) == Routing(1, RoutingStatus.HEALTHY)  # 1 % of full weight 100


@pytest.mark.parametrize("silence", ["stream closed", "3 misses counted"])
def test_a_good_probe_does_not_promote_a_warming_node_whose_agent_is_not_heard(silence):
    """A result read before a reconnected agent's first heartbeat (or one for a node whose misses
    are counted): routing the node would have its next Tick eject it by the count rule, for a
    60 s clean period. It stays WARMING; after a heartbeat the next good probe promotes it.
    Found by the tick back-off property test (a past-due deadline after such a promotion)."""
    from xds_server.health.model import initial, step

    nh, _ = step(initial("n", 0.0), HeartbeatObserved(engine_state="READY"), 0.0, CFG)
    if silence == "stream closed":
        nh, _ = step(nh, StreamClosed("agent restarted"), 0.05, CFG)
    else:
        for t in (0.18, 0.28, 0.38):
            nh, _ = step(nh, Tick(), t, CFG)
        assert nh.heartbeat.consecutive_misses == 3
    nh, events = step(nh, ProbeObserved(K.OK, ttft_ms=30), 5.0, CFG)
    assert nh.state is S.WARMING and events == []
    assert route(nh, 1, CFG).health_status == "UNHEALTHY"
    why = "its stream closed" if silence == "stream closed" else "3 heartbeats missed"
    assert nh.reason == (f"warming: the engine answers (TTFT 30 ms) but its agent is not heard ({why}); "
                         "promoted after a heartbeat")   # the table's PROBE_UNHEARD, said
    nh, _ = step(nh, HeartbeatObserved(engine_state="READY"), 5.01, CFG)
    nh, events = step(nh, ProbeObserved(K.OK, ttft_ms=30), 5.02, CFG)
    assert nh.state is S.PROBATION and [e.to_state for e in events] == [S.PROBATION]


def test_misses_counted_at_interval_plus_grace():
    # seed 000: interval 100 ms, grace 80 ms -> misses at +180, +280, +380 ms
    assert [misses_at(0.0, t, CFG) for t in (0.179, 0.180, 0.279, 0.280, 0.380)] == [0, 1, 1, 2, 3]


@pytest.mark.parametrize("freeze_phase_ms", [1, 30, 60, 99])
def test_count_rule_third_miss_ejects_380ms_after_the_last_heartbeat(freeze_phase_ms):
    sim = healthy_sim(cfg=HealthConfig(failure_detector="count", ramp_step_percent=50))
    t_fault = 4.0 + freeze_phase_ms / 1000.0  # last heartbeat at 4.0
    sim.heartbeat = lambda t: None if t >= t_fault else HeartbeatObserved()
    sim.run_until(5.0)
    ej = next(e for e in sim.events if e.to_state is S.UNHEALTHY)
    assert "3 consecutive misses" in ej.reason
    # the third miss is counted 380 ms after the last heartbeat: <= 300 ms after the first
    # heartbeat that failed to arrive (at +100 ms)
    assert abs(ej.at_s - 4.38) < 1e-6
    assert ej.at_s - (4.0 + 0.1) <= 0.3 + 1e-9


@pytest.mark.parametrize("freeze_phase_ms", [1, 50, 99])
def test_phi_suspicion_ejects_a_frozen_node_faster_than_the_count_rule(freeze_phase_ms):
    sim = healthy_sim(cfg=FAST_RAMP)
    t_fault = 4.0 + freeze_phase_ms / 1000.0
    sim.heartbeat = lambda t: None if t >= t_fault else HeartbeatObserved()
    sim.run_until(5.0)
    ej = next(e for e in sim.events if e.to_state is S.UNHEALTHY)
    assert "phi" in ej.reason and ej.at_s - t_fault < 0.24
    assert sim.nh.ejection.cause is EjectionCause.HEARTBEAT  # then proven by the count rule at +380 ms


def test_phi_suspicion_disproved_by_a_late_heartbeat_returns_without_probation():
    sim = healthy_sim(cfg=FAST_RAMP)
    sim.heartbeat = lambda t: None if 4.05 <= t < 4.3 else HeartbeatObserved()  # one 300 ms gap
    sim.run_until(5.0)
    kinds = [(e.from_state, e.to_state) for e in sim.events[-2:]]
    assert kinds == [(S.HEALTHY, S.UNHEALTHY), (S.UNHEALTHY, S.HEALTHY)]
    assert "disproved" in sim.events[-1].reason and sim.nh.state is S.HEALTHY


def test_stream_closed_counts_as_a_miss_at_once():
    sim = healthy_sim(cfg=HealthConfig(failure_detector="count", ramp_step_percent=50))
    sim.heartbeat = lambda t: None
    last = sim.nh.heartbeat.last_s
    sim.apply(StreamClosed("UNAVAILABLE"), last + 0.01)
    assert sim.nh.heartbeat.consecutive_misses == 1
    sim.run_until(5.0)
    ej = next(e for e in sim.events if e.to_state is S.UNHEALTHY)
    assert abs(ej.at_s - (last + 0.28)) < 1e-6  # closed (1) + misses at +180 and +280 ms


def test_ttft_tiers_and_degraded_recovery():
    sim = healthy_sim()
    sim.apply(ProbeObserved(K.OK, ttft_ms=450), 4.5)
    assert sim.nh.state is S.DEGRADED
    assert route(sim.nh, 1, CFG).weight == 30 and route(sim.nh, 1, CFG).health_status == "HEALTHY"
    for _i, t in enumerate((5.5, 6.5)):
        sim.apply(ProbeObserved(K.OK, ttft_ms=50), t)
        assert sim.nh.state is S.DEGRADED
    sim.apply(ProbeObserved(K.OK, ttft_ms=50), 7.5)
    assert sim.nh.state is S.HEALTHY and "3 consecutive good probes" in sim.events[-1].reason


def test_probe_over_800ms_counts_as_timeout_and_two_eject():
    sim = healthy_sim()
    sim.apply(ProbeObserved(K.OK, ttft_ms=900), 4.5)
    assert sim.nh.state is S.DEGRADED
    sim.apply(ProbeObserved(K.TIMEOUT), 5.5)
    assert sim.nh.state is S.UNHEALTHY and "2 consecutive failures" in sim.nh.reason


def test_hung_inference_two_probe_timeouts_eject_and_health_200_never_resets_the_count():
    """Field case fc06."""
    hung = HeartbeatObserved(requests_running=1, requests_waiting=3, stalled=True, stall_detail="tokens frozen 1.2 s")
    sim = healthy_sim(cfg=HealthConfig(ramp_step_percent=50, stall_confirm_ms=10_000))
    sim.heartbeat = lambda t: hung
    sim.probe = lambda t: ProbeObserved(K.TIMEOUT)
    sim.run_until(6.0)
    assert sim.nh.state is S.UNHEALTHY
    assert "inference timeout" in sim.nh.reason or "STALLED" in sim.nh.reason
    sim.run_until(30.0)  # heartbeats (the engine's /health) keep coming: they do not heal it
    assert sim.nh.state is S.UNHEALTHY and not any(e.from_state is S.UNHEALTHY for e in sim.events)


def test_stall_counts_as_timeout_and_a_persisting_stall_ejects_after_stall_confirm_ms():
    sim = healthy_sim()
    t0 = 4.02
    sim.heartbeat = lambda t: HeartbeatObserved(requests_running=4, stalled=t >= t0, stall_detail="frozen")
    sim.probe = lambda t: None
    sim.run_until(5.0)
    trans = [(round(e.at_s, 2), e.to_state) for e in sim.events if e.at_s >= 4.0]
    assert trans[0][1] is S.DEGRADED and "STALLED" in sim.events[-2].reason
    assert trans[1][1] is S.UNHEALTHY and abs(trans[1][0] - (t0 + 0.08 + 0.3)) < 0.11


def test_busy_engine_with_advancing_tokens_is_saturated_not_ejected():
    """Field case fc07."""
    busy = HeartbeatObserved(requests_running=256, requests_waiting=1024, stalled=False, progress_age_ms=50,
                             progress_detail="engine 0: vllm:generation_tokens_total+vllm:prompt_tokens_total "
                                             "1000 -> 1768 0.1 s ago")
    sim = healthy_sim()
    sim.heartbeat = lambda t: busy
    sim.probe = lambda t: (ProbeObserved(K.OK, ttft_ms=900) if int(t) % 2
                           else ProbeObserved(K.HTTP_STATUS, http_status=429))
    sim.run_until(70.0)
    assert sim.nh.state is S.DEGRADED and "saturated" in sim.nh.reason
    assert not any(e.to_state is S.UNHEALTHY for e in sim.events)
    nr = node_routing(sim.nh, CFG)
    assert nr.soft_block.startswith("queue: 1024 waiting")  # > 100 waiting: not routed while it lasts
    sim.heartbeat = lambda t: HeartbeatObserved(requests_running=2, requests_waiting=0)
    sim.probe = lambda t: ProbeObserved(K.OK, ttft_ms=40)
    sim.run_until(75.0)
    assert sim.nh.state is S.HEALTHY and route(sim.nh, 1, CFG).weight == 100


def test_engine_fatal_ejects_at_once_and_engine_failed_report_too():
    sim = healthy_sim()
    sim.apply(ProbeObserved(K.ENGINE_FATAL, detail="CUDA error: an illegal memory access"), 4.5)
    assert sim.nh.state is S.UNHEALTHY and "CUDA error" in sim.nh.reason
    assert sim.nh.ejection.cause is EjectionCause.ENGINE
    sim2 = healthy_sim()
    sim2.apply(HeartbeatObserved(engine_state="FAILED"), 4.05)
    assert sim2.nh.state is S.UNHEALTHY and sim2.nh.reason == "agent reports engine FAILED"


def test_gpu_fatal_xid_ejects_and_low_free_memory_is_a_soft_block():
    sim = healthy_sim()
    sim.apply(HeartbeatObserved(gpu_free_ratio=0.03), 4.05)
    assert sim.nh.state is S.HEALTHY and node_routing(sim.nh, CFG).soft_block.startswith("GPU memory free 3.0 %")
    sim.apply(HeartbeatObserved(gpu_fatal="GPU 0 Xid 79"), 4.15)
    assert sim.nh.state is S.UNHEALTHY and "Xid 79" in sim.nh.reason


def test_queue_warning_halves_weight():
    sim = healthy_sim()
    sim.apply(HeartbeatObserved(requests_waiting=60), 4.05)
    assert route(sim.nh, 1, CFG).weight == 50 and route(sim.nh, 1, CFG).health_status == "HEALTHY"


def test_half_open_after_60s_clean_then_1pct_ramp_then_healthy():
    sim = healthy_sim(cfg=CFG, until=110.0)  # default ramp: 1 % per 1 s step
    sim.apply(ProbeObserved(K.ENGINE_FATAL, detail="out of memory"), 110.5)
    assert sim.nh.state is S.UNHEALTHY
    sim.run_until(110.5 + 59.0)
    assert sim.nh.state is S.UNHEALTHY  # not yet 60 s of clean probes
    sim.run_until(110.5 + 62.0)
    assert sim.nh.state is S.PROBATION and "s of successful probes" in sim.events[-1].reason
    pcts = []
    for _ in range(5):
        sim.run_until(sim.now + 1.0)
        pcts.append(sim.nh.ramp.percent)
    assert [b - a for a, b in pairwise(pcts)] == [1.0] * 4  # +1 % per 1 s step
    assert pcts[0] <= 5
    assert route(sim.nh, 1, CFG).weight == round(pcts[-1])
    sim.run_until(sim.now + 100.0)
    assert sim.nh.state is S.HEALTHY


def test_failure_in_probation_doubles_the_next_clean_period_capped():
    cfg = HealthConfig(probation_clean_s=10, probation_clean_max_s=25, ramp_step_s=1.0)
    sim = NodeSim(cfg=cfg)
    sim.run_until(1.0)
    assert sim.nh.state is S.PROBATION
    clean = []
    for _k in range(3):
        sim.apply(ProbeObserved(K.TIMEOUT), sim.now + 0.01)
        assert sim.nh.state is S.UNHEALTHY and sim.nh.ramp.percent == 0
        clean.append(sim.nh.ejection.clean_period_s)
        sim.run_until(sim.now + clean[-1] + 2.0)
        assert sim.nh.state is S.PROBATION
    assert clean == [20.0, 25.0, 25.0]


def test_rtt_ewma_alpha_02_and_the_baseline_learns_only_while_healthy():
    sim = healthy_sim()
    sim.apply(PingObserved(10.0), 4.01)
    before = sim.nh.rtt.ewma_ms
    base = sim.nh.rtt.baseline_ms
    sim.apply(PingObserved(4.0), 4.02)  # within rtt.spike_factor x the EWMA: counted as measured
    assert sim.nh.rtt.ewma_ms == pytest.approx(0.8 * before + 0.2 * 4.0) and sim.nh.rtt.last_ms == 4.0
    assert sim.nh.rtt.baseline_ms == pytest.approx(0.95 * base + 0.05 * sim.nh.rtt.ewma_ms)  # alpha 0.05
    sim.apply(ProbeObserved(K.OK, ttft_ms=450), 4.03)  # DEGRADED: the baseline holds
    assert sim.nh.state is S.DEGRADED
    held = sim.nh.rtt.baseline_ms
    sim.apply(PingObserved(200.0), 4.04)
    assert sim.nh.rtt.baseline_ms == held and sim.nh.rtt.ewma_ms > held


def test_until_enough_pings_the_rtt_ewma_is_the_smallest_round_trip_seen():
    """A fleet dialling in at once: the first pings read our backlog (here 250 ms, then 120), the
    node's own round trip is 5 ms. Seeded with the backlog, alpha 0.2 would still hold ~80 ms
    after five pings (an outlier against a 5 ms median); the smallest sample is the node's."""
    sim = NodeSim(cfg=FAST_RAMP)
    need = FAST_RAMP.outlier.min_rtt_samples
    samples = [250.0, 120.0, 5.0, 9.0, 6.0][:need] + [7.0] * max(0, need - 5)
    for k, v in enumerate(samples):
        sim.apply(PingObserved(v), 0.01 + k * 0.01)
    assert sim.nh.rtt.samples == need and sim.nh.rtt.ewma_ms == pytest.approx(5.0)
    sim.apply(PingObserved(10.0), 0.5)  # from here on an EWMA (alpha 0.2)
    assert sim.nh.rtt.ewma_ms == pytest.approx(0.8 * 5.0 + 0.2 * 10.0)


def test_one_late_ping_moves_the_rtt_ewma_a_little_and_a_lasting_rise_reaches_it_within_fifteen_pings():
    sim = healthy_sim()
    for k in range(10):
        sim.apply(PingObserved(2.0), 4.0 + k * 0.01)
    sim.apply(PingObserved(500.0), 4.2)  # the agent's loop paused 0.5 s: counted as 4 x 2 ms
    assert sim.nh.rtt.last_ms == 500.0 and sim.nh.rtt.ewma_ms < 3.5
    t = 4.3
    for k in range(15):
        sim.apply(PingObserved(100.0), t)
        t += 0.01
        if k == 9:
            assert sim.nh.rtt.ewma_ms > 70.0  # a real rise: past 3 x a 2 ms median + 50 ms within ten pings
    assert sim.nh.rtt.ewma_ms > 90.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.01, 5000.0), min_size=1, max_size=60))
def test_the_rtt_ewma_stays_between_its_samples_and_one_sample_moves_it_at_most_by_its_cap(samples):
    sim = healthy_sim()
    first, counted = sim.nh.rtt.ewma_ms, sim.nh.rtt.samples
    seen = [] if first is None else [first]
    for k, v in enumerate(samples):
        before = sim.nh.rtt.ewma_ms
        sim.apply(PingObserved(v), 4.0 + k * 0.001)
        seen.append(v)
        e = sim.nh.rtt.ewma_ms
        assert sim.nh.rtt.samples == counted + k + 1  # every ping counts toward outlier.min_rtt_samples
        assert e is not None and min(seen) - 1e-9 <= e <= max(seen) + 1e-9
        if before is not None:
            cap = FAST_RAMP.rtt.spike_factor * max(before, FAST_RAMP.rtt.baseline_slack.ms)
            assert e <= FAST_RAMP.rtt.ewma_alpha * cap + (1 - FAST_RAMP.rtt.ewma_alpha) * before + 1e-9


def test_drain_overrides_everything_until_undrained():
    sim = healthy_sim()
    sim.apply(DrainRequested(True, "maintenance"), 4.01)
    assert sim.nh.effective_state is S.DRAINING and route(sim.nh, 1, CFG).health_status == "DRAINING"
    sim.apply(ProbeObserved(K.ENGINE_FATAL), 4.02)
    assert sim.nh.effective_state is S.DRAINING and sim.nh.state is S.UNHEALTHY
    sim.apply(DrainRequested(False), 4.03)
    assert sim.nh.effective_state is S.UNHEALTHY and route(sim.nh, 1, CFG).health_status == "UNHEALTHY"


def test_engine_restart_goes_back_through_warming():
    sim = healthy_sim()
    sim.apply(HeartbeatObserved(engine_state="WARMING"), 4.05)
    assert sim.nh.state is S.WARMING and "engine restarting" in sim.nh.reason
    sim.apply(ProbeObserved(K.OK, ttft_ms=30), 4.2)
    assert sim.nh.state is S.PROBATION and sim.nh.ramp.percent == 1.0


def test_heartbeat_ejection_during_fail_static_is_forgiven_when_it_ends():
    from xds_server.health.model import FailStaticEnded

    sim = healthy_sim()
    sim.heartbeat = lambda t: None if 4.05 <= t < 5.5 else HeartbeatObserved()
    sim.run_until(5.6)
    assert sim.nh.state is S.UNHEALTHY and sim.nh.ejection.cause is EjectionCause.HEARTBEAT
    sim.apply(FailStaticEnded(burst_start_s=4.0), 5.65)
    assert sim.nh.state is S.HEALTHY and "forgiven" in sim.events[-1].reason
    # a probe-based ejection is never forgiven
    sim.apply(ProbeObserved(K.ENGINE_FATAL, detail="CUDA"), 5.7)
    sim.apply(FailStaticEnded(burst_start_s=4.0), 5.8)
    assert sim.nh.state is S.UNHEALTHY


def test_fail_static_forgiveness_also_for_a_node_whose_heartbeats_return_just_after_the_end():
    from xds_server.health.model import FailStaticEnded

    sim = healthy_sim()
    sim.heartbeat = lambda t: None if 4.05 <= t < 5.75 else HeartbeatObserved()
    sim.run_until(5.6)
    sim.apply(FailStaticEnded(burst_start_s=4.0), 5.65)
    assert sim.nh.state is S.UNHEALTHY and sim.nh.ejection.forgive_since_s == 4.0
    sim.run_until(5.9)
    assert sim.nh.state is S.HEALTHY and "forgiven" in sim.events[-1].reason
    # too late (after ten heartbeat intervals): the normal clean period applies
    late = healthy_sim()
    late.heartbeat = lambda t: None if 4.05 <= t < 7.0 else HeartbeatObserved()
    late.run_until(5.6)
    late.apply(FailStaticEnded(burst_start_s=4.0), 5.65)
    late.run_until(7.2)
    assert late.nh.state is S.UNHEALTHY
