"""Backed-off silence Ticks (xds_server.health.clocks.tick_due_s) decide as a Tick every interval.

Two models see the same random observations: one gets its Ticks at :func:`next_check_s` (every
miss boundary), the other at :func:`tick_due_s` (a node ejected by the count rule gets its Ticks
at growing gaps). At every observation and at every Tick the back-off still delivers, both have
the same state, routing (status, weight) and events, and the same records but the stored miss
count, which :func:`misses_shown` makes equal again for display.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from health_strategies import FAST_RECOVERY, observations
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis import target as steer

from xds_server.config import HealthConfig
from xds_server.health.model import (
    HeartbeatObserved,
    NodeState,
    ProbeObserved,
    Tick,
    initial,
    misses_shown,
    next_check_s,
    route,
    step,
    tick_due_s,
    ticks_backed_off,
)
from xds_server.health.model import (
    ProbeResultKind as K,
)

CONFIGS = [
    HealthConfig(**FAST_RECOVERY),
    HealthConfig(**FAST_RECOVERY, failure_detector="count", consecutive_misses=1, silent_tick_max_ms=350.0),
    HealthConfig(**FAST_RECOVERY, consecutive_misses=5, heartbeat_interval_ms=50.0, heartbeat_grace_ms=30.0),
]

heartbeat = st.builds(
    HeartbeatObserved,
    engine_state=st.sampled_from(["READY"] * 8 + ["WARMING", "COLD", "FAILED"]),
    stalled=st.sampled_from([False] * 8 + [True]),
    requests_waiting=st.sampled_from([None, 0.0, 1.0]),
    gpu_free_ratio=st.sampled_from([None, 0.2, 0.9]),
    gpu_fatal=st.sampled_from([""] * 15 + ["GPU 0 Xid 79"]),
    vouched=st.sampled_from([False] * 3 + [True]),
)
observation = observations(heartbeat, with_tick=False)  # Ticks: delivered by each model's own schedule
# heartbeat-sized gaps and silences long enough for ejection and several backed-off Ticks
gap = st.sampled_from([0.1] * 8 + [0.05, 0.25, 0.45, 1.2, 3.0, 3.0, 7.5, 7.5])
timeline = st.lists(st.tuples(gap, observation), max_size=80)


def _without_count(nh):
    return replace(nh, heartbeat=replace(nh.heartbeat, consecutive_misses=0))


def _same(a, b, t, cfg):
    assert _without_count(a) == _without_count(b), (a, b, t)
    assert route(a, 100, cfg) == route(b, 100, cfg), (a, b, t)
    assert b.heartbeat.consecutive_misses <= a.heartbeat.consecutive_misses
    assert misses_shown(b, cfg, t) == a.heartbeat.consecutive_misses, (a, b, t)


class _Timer:
    """One model's Tick timer, as the probe session's: a deadline already past (an observation can
    make one, e.g. a good probe routing a node silent for seconds) runs at once, at the time it
    is set, as the loop runs a ``call_at`` in the past on its next pass. A Tick must not leave its
    own time as the next deadline again (the loop would spin)."""

    def __init__(self) -> None:
        self.t = 0.0          # the model's clock: its last observation or Tick (s)
        self.ticked = False   # a Tick already ran at self.t

    def next(self, due: float | None, limit: float) -> float | None:
        """When the next Tick runs, at most ``limit``; None: none by then."""
        if due is None or due > limit:
            return None
        if due > self.t:
            return due
        assert not self.ticked, f"a Tick at {self.t} leaves a deadline at {due}: the timer would spin"
        return self.t

    def ran(self, at: float) -> None:
        self.t, self.ticked = at, True

    def observed(self, at: float) -> None:
        self.t, self.ticked = at, False


@settings(max_examples=150, deadline=None)
@given(timeline, st.sampled_from(CONFIGS), st.booleans())
def test_backed_off_ticks_decide_as_a_tick_every_interval(items, cfg, routed_first):
    if routed_first:  # most runs start routed (PROBATION), so long silences eject by the count rule
        items = [(0.1, HeartbeatObserved(engine_state="READY")), (0.01, ProbeObserved(K.OK, 10.0)), *items]
    every = backed = initial("p", 0.0)
    te, tb = _Timer(), _Timer()
    ev_every, ev_backed = [], []
    saved = 0
    for dt, obs in items:
        target = max(te.t, tb.t) + dt
        while (due := tb.next(tick_due_s(backed, cfg, tb.t), target)) is not None:
            while (d := te.next(next_check_s(every, cfg), due)) is not None:
                te.ran(d)
                every, evs = step(every, Tick(), d, cfg)
                ev_every += evs
                saved += 1
            saved -= 1
            tb.ran(due)
            backed, evs = step(backed, Tick(), due, cfg)
            ev_backed += evs
            assert ev_every == ev_backed
            _same(every, backed, due, cfg)
        while (d := te.next(next_check_s(every, cfg), target)) is not None:
            te.ran(d)
            every, evs = step(every, Tick(), d, cfg)
            ev_every += evs
            saved += 1
        te.observed(target)
        tb.observed(target)
        every, evs = step(every, obs, target, cfg)
        ev_every += evs
        backed, evs = step(backed, obs, target, cfg)
        ev_backed += evs
        assert ev_every == ev_backed
        _same(every, backed, target, cfg)
    assert saved >= 0
    steer(float(saved), label="Ticks saved")  # steer towards long silences after ejection


def test_an_ejected_silent_node_ticks_at_doubling_gaps_and_recovers_as_before():
    cfg = HealthConfig(failure_detector="count")  # 100 ms heartbeats, 80 ms grace, 3 misses, Ticks <= 1 s apart
    nh = initial("n", 0.0)
    t = 0.0
    for _ in range(20):  # WARMING -> PROBATION with heartbeats and good probes
        t = round(t + 0.1, 3)
        nh, _ = step(nh, HeartbeatObserved(engine_state="READY"), t, cfg)
        nh, _ = step(nh, ProbeObserved(K.OK, 10.0), t, cfg)
    assert nh.state is NodeState.PROBATION
    last = t
    ticks = []
    t = last
    while (due := tick_due_s(nh, cfg, t)) is not None and due <= last + 10.0:
        t = due
        nh, _ = step(nh, Tick(), due, cfg)
        if nh.state is NodeState.UNHEALTHY:
            ticks.append(round(due - last, 3))
    assert ticks_backed_off(nh, cfg)
    # ejected at the third miss (+0.38 s), then Ticks 1, 1, 2, 4, 8, 10, 10 ... intervals apart
    assert ticks[:8] == [0.38, 0.48, 0.58, 0.78, 1.18, 1.98, 2.98, 3.98]
    assert len(ticks) == 14  # a Tick every interval: 97 in the same time
    assert nh.heartbeat.consecutive_misses == 99 and tick_due_s(nh, cfg, t) == pytest.approx(last + 10.98)
    assert tick_due_s(nh, cfg, last + 10.5) == pytest.approx(last + 11.48)  # 104 misses counted, 10 ahead
    assert misses_shown(nh, cfg, last + 10.5) == 104  # between Ticks: from the time, as a Tick would count
    assert next_check_s(nh, cfg) == pytest.approx(last + 10.08)  # the every-interval schedule
    back, events = step(nh, HeartbeatObserved(engine_state="READY"), last + 10.5, cfg)
    assert back.heartbeat.consecutive_misses == 0 and not ticks_backed_off(back, cfg)
    assert back.state is NodeState.UNHEALTHY and [e.reason for e in events] == []
    assert "heartbeats resumed" in back.reason
    assert tick_due_s(back, cfg, last + 10.5) == next_check_s(back, cfg)
