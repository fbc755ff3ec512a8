"""The quiet heartbeat's fast path (xds_server.health.beats.quiet_heartbeat) decides exactly as
the full step: same node record, same events, for random observation sequences; the steady lane
(steady_heartbeat) gives that record and the Tick deadline tick_due_s gives."""
from __future__ import annotations

from health_strategies import FAST_RECOVERY, observations
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import HealthConfig
from xds_server.health.beats import BeatRun, quiet_heartbeat
from xds_server.health.beats import steady_heartbeat as steady_lane
from xds_server.health.clocks import miss_after_s, phi_delay_s, stall_confirm_at_s
from xds_server.health.model import (
    HeartbeatObserved,
    ProbeObserved,
    Tick,
    initial,
    next_check_s,
    step,
    tick_due_s,
)
from xds_server.health.model import (
    ProbeResultKind as K,
)
from xds_server.health.records import ROUTED_STATES, EjectionCause
from xds_server.health.rules import _step_full

CFG = HealthConfig(**FAST_RECOVERY)

steady_heartbeat = st.builds(
    HeartbeatObserved,
    engine_state=st.sampled_from(["READY"] * 8 + ["WARMING", "COLD", "FAILED"]),
    stalled=st.sampled_from([False] * 8 + [True]),
    requests_running=st.sampled_from([None, 0.0, -0.0, 4.0, 4.0, 5.0]),
    requests_waiting=st.sampled_from([None, 0.0, 1.0, 1.0]),
    gpu_free_ratio=st.sampled_from([None, 0.0, 0.2, 0.2]),
    gpu_fatal=st.sampled_from([""] * 12 + ["GPU 0 Xid 79"]),
    progress_age_ms=st.sampled_from([None] * 6 + [50.0, 2500.0]),
    progress_detail=st.sampled_from(["", "tokens"]),
    vouched=st.sampled_from([False] * 3 + [True]),  # a transport stream's telemetry refresh
)
observation = observations(steady_heartbeat, with_tick=True)
# mostly heartbeat-sized gaps, some silences long enough for misses and phi suspicions
gap = st.sampled_from([0.1] * 8 + [0.09, 0.11, 0.05, 0.25, 0.45, 1.2])
timeline = st.lists(st.tuples(gap, observation), max_size=150)


@settings(max_examples=400, deadline=None)
@given(timeline)
def test_step_with_the_fast_path_equals_the_full_step(items):
    nh = initial("p", 0.0)
    t = 0.0
    quiet = 0
    for dt, obs in items:
        target = t + dt
        while (due := next_check_s(nh, CFG)) is not None and t < due <= target:  # Ticks as a session delivers them
            t = due
            nh, _ = step(nh, Tick(), t, CFG)
        t = target
        fast, fast_events = step(nh, obs, t, CFG)
        full, full_events = _step_full(nh, obs, t, CFG)
        assert fast == full and fast_events == full_events, (nh, obs, t)
        if isinstance(obs, HeartbeatObserved):
            q = quiet_heartbeat(nh, obs, t, CFG)
            lane = steady_lane(nh, obs, t, CFG)
            if q is not None:
                quiet += 1
                assert not full_events
            heard = nh.heartbeat.consecutive_misses == 0 and not nh.heartbeat.stream_closed
            assert (lane is not None) == (q is not None and heard)
            if lane is not None:
                assert lane == (full, tick_due_s(full, CFG, t))
        nh = full
        assert next_check_s(nh, CFG) == _next_check_reference(nh)


def _next_check_reference(nh):
    """next_check_s as it was written before (a list of candidates and min), for comparison."""
    cands = []
    hb = nh.heartbeat
    if hb.last_s is not None:
        counted = max(hb.consecutive_misses - (1 if hb.stream_closed else 0), 0)
        if not hb.vouched or nh.probe.busy_timeout_s is not None:  # vouched: no miss to count
            cands.append(hb.last_s + miss_after_s(CFG) + CFG.heartbeat.interval.s * counted)
        if nh.ejection.cause is not EjectionCause.PHI and nh.state in ROUTED_STATES:
            d = phi_delay_s(nh, CFG)
            if d is not None:
                cands.append(hb.last_s + d)
    if nh.ramp.step_at_s is not None:
        cands.append(nh.ramp.step_at_s + CFG.probation.ramp_step.s)
    confirm = stall_confirm_at_s(nh, CFG)
    if confirm is not None and nh.engine.stall_counted == 1 and nh.state in ROUTED_STATES:
        cands.append(confirm)
    return min(cands) if cands else None


def test_a_steady_healthy_node_takes_the_fast_path_and_a_changed_rule_input_does_not():
    hb = HeartbeatObserved(engine_state="READY", requests_running=4.0)
    nh = initial("p", 0.0)
    t = 0.0
    for kind in ("hb", "probe", "hb", "probe"):
        t += 0.1
        nh, _ = step(nh, hb if kind == "hb" else ProbeObserved(K.OK, 10.0), t, CFG)
    while nh.state.value != "HEALTHY" and t < 10.0:  # clean period, ramp, heartbeats flowing
        t += 0.1
        nh, _ = step(nh, hb, t, CFG)
        nh, _ = step(nh, Tick(), t, CFG)
        nh, _ = step(nh, ProbeObserved(K.OK, 10.0), t, CFG)
    assert nh.state.value == "HEALTHY"
    t += 0.1
    out = quiet_heartbeat(nh, hb, t, CFG)
    assert out is not None and out.heartbeat.last_s == t and out.engine is nh.engine  # engine record kept
    assert out == _step_full(nh, hb, t, CFG)[0]
    assert steady_lane(nh, hb, t, CFG) == (out, tick_due_s(out, CFG, t))  # the control plane's lane
    assert quiet_heartbeat(nh, HeartbeatObserved(engine_state="READY", gpu_fatal="GPU 0 Xid 79"), t, CFG) is None
    assert quiet_heartbeat(nh, HeartbeatObserved(engine_state="WARMING"), t, CFG) is None  # restarting
    assert quiet_heartbeat(nh, HeartbeatObserved(engine_state="READY", stalled=True), t, CFG) is None
    assert step(nh, HeartbeatObserved(engine_state="FAILED"), t, CFG)[0].state.value == "UNHEALTHY"


plain_heartbeat = st.builds(HeartbeatObserved, engine_state=st.just("READY"),
                            requests_running=st.sampled_from([4.0, 5.0]), gpu_free_ratio=st.sampled_from([None, 0.2]),
                            progress_age_ms=st.sampled_from([None] * 5 + [50.0]),
                            vouched=st.sampled_from([False] * 3 + [True]))
good_probe = st.builds(ProbeObserved, st.just(K.OK), st.sampled_from([10.0, 10.0, 900.0]))
# a node mostly steady (repeated heartbeats, good probes), with any observation now and then
folding_timeline = st.lists(st.tuples(gap, st.one_of(*[plain_heartbeat] * 8, good_probe, good_probe, observation),
                                      st.sampled_from([True] * 3 + [False])), min_size=40, max_size=200)


@settings(max_examples=300, deadline=None)
@given(folding_timeline)
def test_heartbeats_folded_in_place_give_the_record_and_deadline_of_the_steady_lane(items):
    """A BeatRun (the control plane's in-place fold of a steady node's repeated heartbeat) gives,
    after each folded heartbeat, the record and the next Tick's deadline the steady lane gives
    step by step; it refuses what the lane would not take or what would change more than the
    arrival record. ``again``: the agent repeats its last heartbeat (the same object, as the
    edge gives it for unchanged telemetry)."""
    nh, t, run, last_hb, folded = initial("p", 0.0), 0.0, None, None, 0
    for dt, obs, again in items:
        target = t + dt
        while (due := next_check_s(nh, CFG)) is not None and t < due <= target:
            t, run = due, None  # a Tick reads the node: the run is settled (ControlCore)
            nh, _ = step(nh, Tick(), t, CFG)
        t = target
        if again and last_hb is not None and isinstance(obs, HeartbeatObserved):
            obs = last_hb
        full, _ = step(nh, obs, t, CFG)
        if not isinstance(obs, HeartbeatObserved):
            run = None
        else:
            last_hb = obs
            lane = steady_lane(nh, obs, t, CFG)
            got = None if run is None else run.fold(obs, t, CFG)
            if got is not None:
                folded += 1
                assert lane is not None and got == lane[1] and run.settled() == full == lane[0]
            else:
                run = None if lane is None else BeatRun.start(full, obs, CFG)
        nh = full
    if run is not None:
        assert run.settled() == nh


def test_a_repeated_heartbeat_of_a_healthy_node_is_folded_and_a_changed_one_is_not():
    hb = HeartbeatObserved(engine_state="READY", requests_running=4.0)
    nh, t = initial("p", 0.0), 0.0
    while nh.state.value != "HEALTHY" and t < 10.0:
        t += 0.1
        nh, _ = step(nh, hb, t, CFG)
        nh, _ = step(nh, ProbeObserved(K.OK, 10.0), t, CFG)
    run = BeatRun.start(nh, hb, CFG)
    assert run is not None
    for _ in range(5):
        t += 0.1
        ref, _ = step(nh, hb, t, CFG)
        assert run.fold(hb, t, CFG) == tick_due_s(ref, CFG, t) and run.settled() == ref
        nh = ref
    # another object
    assert run.fold(HeartbeatObserved(engine_state="READY", requests_running=4.0), t + 0.1, CFG) is None
    assert BeatRun.start(nh, HeartbeatObserved(engine_state="READY", progress_age_ms=5.0), CFG) is None
