"""Overload shedding (xds_server.health.shed, pure): entry from the measured excess, hysteresis,
steps while critical, lifting, and fail open on stale or missing telemetry (hypothesis)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from xds_server.config import ShedConfig
from xds_server.health.shed import ShedInputs, ShedState, shed_step

CFG = ShedConfig(enabled=True, lift_after_s=3.0)


def inp(waiting, offered=100.0, completed=100.0, age=0.5, reporters=3):
    return ShedInputs(list(waiting), [age] * len(waiting), offered, completed, reporters)


def step(state, i, now=0.0, cfg=CFG):
    return shed_step(state, i, cfg, 50.0, 100.0, now)


def test_half_the_capacity_lost_sheds_the_excess_then_holds_and_lifts():
    # survivors complete 55 rps of 100 offered: drop 1 - 55 x 0.9 / 100 = 50.5 % -> 55 %
    s = step(ShedState(), inp([120, 130], completed=55.0))
    assert s.percent == 55.0 and "mean waiting 125 > 50" in s.reason
    s2 = step(s, inp([150, 160], completed=45.0), 1.0)    # still critical: one more step
    assert s2.percent == 60.0 and s2.flip != s.flip         # a change flips (Envoy 1.40 applies it)
    s3 = step(s2, inp([60, 70]), 2.0)                       # between 25 and 100: hold
    assert s3.percent == 60.0 and s3.flip == s2.flip
    s4 = step(s3, inp([10, 20]), 3.0)                       # low, not for long enough yet
    assert s4.percent == 60.0 and s4.low_since_s == 3.0
    assert step(s4, inp([30, 40]), 4.0).low_since_s is None  # back above the low mark: the wait restarts
    s5 = step(s4, inp([5, 5]), 6.0)
    assert s5.percent == 0.0 and s5.reason.startswith("lifted")


def test_below_warning_nothing_is_shed_and_off_means_off():
    assert step(ShedState(), inp([50, 50], completed=10.0)).percent == 0.0
    off = ShedConfig(enabled=False)
    assert step(ShedState(60.0), inp([300, 300]), cfg=off).percent == 0.0


@given(st.lists(st.one_of(st.none(), st.floats(0, 10_000)), min_size=0, max_size=6),
       st.lists(st.one_of(st.none(), st.floats(0, 100)), min_size=0, max_size=6),
       st.floats(0, 1e6), st.floats(0, 1e6), st.integers(0, 5), st.floats(0, 100))
def test_stale_or_missing_telemetry_never_sheds(waiting, ages, offered, completed, reporters, before):
    s = shed_step(ShedState(before), ShedInputs(waiting, ages, offered, completed, reporters), CFG, 50, 100, 10.0)
    fresh = (waiting and len(ages) == len(waiting) and all(a is not None and a <= CFG.stale_after_s for a in ages)
             and all(w is not None for w in waiting) and reporters > 0)
    if not fresh:
        assert s.percent == 0.0 and s.reason.startswith("fail open")
    assert 0.0 <= s.percent <= CFG.max_percent


def test_seed_002_queue_levels():
    from xds_server.config import HealthConfig
    from xds_server.control.queue import queue_level
    cfg = HealthConfig()
    assert [queue_level(w, cfg) for w in (None, 0, 50, 51, 100, 101)] == \
        ["ok", "ok", "ok", "warning", "warning", "critical"]
