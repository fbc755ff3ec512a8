"""The per-node pipeline (xds_server.health.pipeline.advance) that the control core and the probe
workers' detector both run: its steady lane and folded runs give the records the full step gives,
a kept state is resumed by the first heartbeat only, and anchored ramps sit on the Unix-time grid."""
from __future__ import annotations

import dataclasses

from health_strategies import FAST_RECOVERY, observations
from hypothesis import given, settings
from hypothesis import strategies as st
from test_health_fast_path import steady_heartbeat

from xds_server.config import HealthConfig
from xds_server.health.anchor import grid_point
from xds_server.health.model import HeartbeatObserved, NodeState, Tick, initial, next_check_s, step
from xds_server.health.pipeline import advance

CFG = HealthConfig(**FAST_RECOVERY)
gap = st.sampled_from([0.1] * 8 + [0.09, 0.11, 0.25, 0.45, 1.2])
# (gap, observation, repeat): repeat sends the last heartbeat object again, as an agent whose
# telemetry did not change does (the edge keeps one object), so the steady lane's runs fold it
timeline = st.lists(st.tuples(gap, observations(steady_heartbeat, with_tick=True), st.booleans()), max_size=120)


@settings(max_examples=300, deadline=None)
@given(timeline)
def test_the_steady_lane_and_its_runs_give_the_full_steps_records(items):
    full = lane = initial("p", 0.0)
    run = None
    last_beat = None
    t = 0.0
    for dt, obs, repeat in items:
        if repeat and last_beat is not None:
            obs = last_beat
        if type(obs) is HeartbeatObserved:
            last_beat = obs
        target = t + dt
        while (due := next_check_s(full, CFG)) is not None and t < due <= target:
            t = due
            full = advance(full, Tick(), t, CFG, steady_lane=False).nh
            lane = advance(run.settled() if run is not None else lane, Tick(), t, CFG).nh
            run = None  # a Tick is stepped in full: the run ends
            assert lane == full
        t = target
        a = advance(full, obs, t, CFG, steady_lane=False)
        folded = run.fold(obs, t, CFG) if run is not None and type(obs) is HeartbeatObserved else None
        if folded is not None:
            assert folded == a.due_s
            lane = run.settled()
        else:
            b = advance(run.settled() if run is not None else lane, obs, t, CFG)
            assert (b.nh, b.resumed, b.events, b.due_s) == (a.nh, a.resumed, a.events, a.due_s)
            lane, run = b.nh, b.run
        full = a.nh
        assert lane == full


def test_a_kept_state_is_resumed_by_the_first_heartbeat_only():
    kept = initial("p", 0.0)
    kept = step(kept, HeartbeatObserved(engine_state="READY"), 0.0, CFG)[0]
    healthy = dataclasses.replace(kept, state=NodeState.HEALTHY, reason="was healthy")
    cold = initial("p", 5.0)
    a = advance(cold, Tick(), 5.0, CFG, kept=healthy)
    assert a.resumed == () and a.nh.state is NodeState.COLD  # a Tick does not take it
    b = advance(cold, HeartbeatObserved(engine_state="READY"), 5.1, CFG, kept=healthy)
    assert [(e.from_state, e.to_state) for e in b.resumed] == [(NodeState.COLD, NodeState.HEALTHY)]
    assert b.nh.state is NodeState.HEALTHY and not b.steady


@settings(max_examples=200, deadline=None)
@given(timeline, st.floats(-1e4, 1e4, allow_nan=False))
def test_anchored_ramps_step_on_the_unix_time_grid(items, offset):
    nh = initial("p", 0.0)
    t = 0.0
    for dt, obs, _ in items:
        t += dt
        nh = advance(nh, obs, t, CFG, wall_offset_s=lambda: offset).nh
        at = nh.ramp.step_at_s
        if nh.state is NodeState.PROBATION and at is not None:
            assert abs(grid_point(at, CFG.probation.ramp_step.s, offset) - at) <= 1e-6
