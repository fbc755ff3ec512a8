"""The agent's probe schedule (node_probe.schedule): a pure object driven by the time passed in.
Property tests run arbitrary sequences of time steps, requests, load changes and probes."""
from __future__ import annotations

import random
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_probe.engines import EngineLoadReading, GroupLoad
from node_probe.schedule import Decision, ProbeScheduler, ScheduleSettings, Trigger, load_is_busy

SETTINGS = ScheduleSettings(busy_interval_s=4.0, idle_interval_s=0.5, jitter_ratio=0.25,
                            min_request_gap_s=1.0, deep_interval_s=10.0)

ops = st.lists(st.one_of(
    st.tuples(st.just("advance"), st.floats(0.0, 3.0)),
    st.tuples(st.just("request"), st.sampled_from([Trigger.PROBE_NOW, Trigger.STALL])),
    st.tuples(st.just("busy"), st.booleans()),
    st.tuples(st.just("decide"), st.floats(0.0, 1.5)),  # the probe's duration if one starts
), max_size=80)


def run(sched: ProbeScheduler, script, t0: float = 100.0):
    """Play ``script``; returns [(start, end, trigger, request time or None)] of every probe and
    every decision (now, Decision, pending before)."""
    now, probes, decisions = t0, [], []
    requested_at: float | None = None
    for op, arg in script:
        if op == "advance":
            now += arg
        elif op == "request":
            if sched.pending is None:
                requested_at = now
            sched.request(arg)
        elif op == "busy":
            sched.set_busy(arg)
        else:
            pending = sched.pending
            d = sched.decide(now)
            decisions.append((now, d, pending, requested_at))
            if d.trigger is not None:
                if d.trigger in (Trigger.PROBE_NOW, Trigger.STALL):
                    requested_at = None
                probes.append((now, now + arg, d.trigger))
                now += arg
                sched.probe_done(now)
    return probes, decisions


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(0, 2**32))
def test_prop_schedule_invariants(script, seed):
    s = SETTINGS
    probes, decisions = run(ProbeScheduler(s, random.Random(seed)), script)
    lo = min(s.busy_interval_s, s.idle_interval_s) * (1 - s.jitter_ratio)
    hi = max(s.busy_interval_s, s.idle_interval_s) * (1 + s.jitter_ratio)
    # a decision either starts a probe now or names a positive wait, never longer than the
    # longest jittered interval
    for _now, d, _pending, _req in decisions:
        assert (d.trigger is None) == (d.wait_s > 0)
        assert 0 <= d.wait_s <= hi + 1e-9
    # the first probe starts at the first decision
    if decisions:
        assert decisions[0][1].trigger is not None
    # requested probes start at least the request gap apart
    req_starts = [p[0] for p in probes if p[2] in (Trigger.PROBE_NOW, Trigger.STALL)]
    assert all(b - a >= s.min_request_gap_s - 1e-9 for a, b in pairwise(req_starts))
    # deep checks start at least deep_interval_s apart
    deep = [p[0] for p in probes if p[2] == Trigger.DEEP]
    assert all(b - a >= s.deep_interval_s - 1e-9 for a, b in pairwise(deep))
    # a scheduled (or deep) probe never starts sooner than the shortest jittered interval
    # after the previous probe ended
    for prev, cur in pairwise(probes):
        if cur[2] in (Trigger.SCHEDULED, Trigger.DEEP):
            assert cur[0] - prev[1] >= lo - 1e-9
    # a pending request is served at the first decision at which the gap allows it
    last_req_start = None
    for now, d, pending, _req in decisions:
        if pending is not None and (last_req_start is None or now >= last_req_start + s.min_request_gap_s):
            assert d.trigger == pending
        if d.trigger in (Trigger.PROBE_NOW, Trigger.STALL):
            last_req_start = now


@given(ops, st.integers(0, 2**32))
def test_prop_same_inputs_same_schedule(script, seed):
    a = run(ProbeScheduler(SETTINGS, random.Random(seed)), script)
    b = run(ProbeScheduler(SETTINGS, random.Random(seed)), script)
    assert a == b


def test_probe_now_names_the_probe_over_a_pending_stall_request():
    sched = ProbeScheduler(ScheduleSettings(busy_interval_s=5.0, idle_interval_s=5.0, jitter_ratio=0.0,
                                            min_request_gap_s=1.0, deep_interval_s=10.0))
    assert sched.decide(0.0) == Decision(Trigger.DEEP)  # first probe at once; deep is due
    sched.probe_done(0.1)
    sched.request(Trigger.STALL)
    sched.request(Trigger.PROBE_NOW)
    assert sched.decide(0.2) == Decision(Trigger.PROBE_NOW)
    sched.probe_done(0.3)
    sched.request(Trigger.PROBE_NOW)
    sched.request(Trigger.STALL)  # does not rename the pending ProbeNow
    # inside the 1 s gap: wait until it ends (0.2 + 1.0), then run it
    assert sched.decide(0.5) == Decision(None, pytest.approx(0.7))
    assert sched.decide(1.2) == Decision(Trigger.PROBE_NOW)
    assert sched.pending is None


def test_load_change_replans_with_the_same_jitter():
    sched = ProbeScheduler(ScheduleSettings(busy_interval_s=4.0, idle_interval_s=0.5, jitter_ratio=0.0))
    assert sched.decide(0.0).trigger == Trigger.SCHEDULED
    sched.probe_done(1.0)
    assert sched.decide(1.0) == Decision(None, 0.5)
    assert sched.set_busy(True) and not sched.set_busy(True)
    assert sched.decide(1.0) == Decision(None, 4.0)
    assert sched.decide(5.0) == Decision(Trigger.SCHEDULED)


def test_no_deep_checks_when_off():
    sched = ProbeScheduler(ScheduleSettings(busy_interval_s=1.0, idle_interval_s=1.0, deep_interval_s=0))
    triggers = []
    t = 0.0
    for _ in range(5):
        triggers.append(sched.decide(t).trigger)
        sched.probe_done(t)
        t += 2.0
    assert triggers == [Trigger.SCHEDULED] * 5


def test_busy_needs_load_and_an_observable_progress_counter():
    def reading(running, waiting=0.0, progress=1.0):
        return EngineLoadReading(requests_running=running, requests_waiting=waiting,
                                 groups={"0": GroupLoad(running, waiting, progress)})

    assert load_is_busy(reading(2), stalled=False)
    assert load_is_busy(reading(0, waiting=3), stalled=False)
    assert not load_is_busy(reading(0), stalled=False)
    assert not load_is_busy(reading(2), stalled=True)
    assert not load_is_busy(reading(2, progress=None), stalled=False)
    assert not load_is_busy(None, stalled=False)


@pytest.mark.parametrize("kw", [{"busy_interval_s": 0}, {"idle_interval_s": -1}, {"jitter_ratio": 1.0},
                                {"min_request_gap_s": -0.1}, {"deep_interval_s": -1}])
def test_settings_reject_out_of_range(kw):
    base = {"busy_interval_s": 1.0, "idle_interval_s": 1.0}
    with pytest.raises(ValueError):
        ScheduleSettings(**{**base, **kw})


def test_a_probe_without_answer_is_rechecked_at_the_500ms_idle_cadence_even_while_busy_4s():
    """A busy node whose probe timed out (e.g. queued behind a 5.5 s prefill) is probed
    again at the idle cadence, so its recovery is seen within ~0.5 s of the load easing; an
    answered probe goes back to the busy cadence."""
    sch = ProbeScheduler(ScheduleSettings(busy_interval_s=4.0, idle_interval_s=0.5, jitter_ratio=0.0))
    sch.set_busy(True)
    assert sch.decide(0.0).trigger is Trigger.SCHEDULED
    sch.probe_done(0.8, answered=False)
    assert sch.decide(0.8).wait_s == pytest.approx(0.5)
    assert sch.decide(1.3).trigger is Trigger.SCHEDULED
    sch.probe_done(1.33, answered=True)
    assert sch.decide(1.33).wait_s == pytest.approx(4.0)
