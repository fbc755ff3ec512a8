"""Gated shifts over generated inputs (xds_server.policy.shift_machine, shift_layout, shift_doc): no data
never rolls back, one bad window never rolls back when fail_windows > 1, the share stays within
0..100 and moves by the step, the layout's locality weights carry the commanded share."""
from __future__ import annotations

import itertools
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import ShiftConfig
from xds_server.policy import shift_machine as hs
from xds_server.policy.shift_document import from_doc, to_doc
from xds_server.policy.shift_layout import WEIGHT_TOTAL, NodeSpot, layout

CFG = ShiftConfig(min_requests=50, fail_windows=2, max_rollbacks=100)
GOOD = hs.GateReading(2000, 0, 100.0, 100.0)
BAD = hs.GateReading(2000, 200, 100.0, 100.0)


def _readings() -> st.SearchStrategy[hs.GateReading]:
    ttft = st.one_of(st.none(), st.floats(1.0, 1000.0))
    return st.builds(lambda n, frac, t, s: hs.GateReading(n, int(n * frac), t, s),
                     st.integers(0, 5000), st.floats(0.0, 1.0), ttft, ttft)


def _run(spec: hs.ShiftSpec, readings: list[hs.GateReading], cfg: ShiftConfig = CFG) -> list[hs.ShiftState]:
    st_, _ = hs.start(spec, 0.0)
    out = [st_]
    t = 0.0
    for r in readings:
        if st_.next_decision_s is None:
            break
        t = st_.next_decision_s
        st_, _ = hs.decide(st_, hs.judge(r, cfg), t, cfg)
        out.append(st_)
    return out


SPECS = st.builds(lambda step, every: hs.ShiftSpec("llm", "priority", "1", step, every),
                  st.floats(0.5, 100.0), st.floats(0.5, 600.0))


@settings(max_examples=200, deadline=None)
@given(SPECS, st.lists(_readings(), max_size=40))
def test_share_within_bounds_and_moves_by_the_step(spec, readings):
    states = _run(spec, readings)
    for a, b in itertools.pairwise(states):
        assert 0.0 <= b.share_percent <= 100.0
        moved = b.share_percent - a.share_percent
        if b.share_percent < 100.0:  # the last step may be smaller (capped at 100)
            assert moved in (0.0,) or abs(abs(moved) - spec.step_percent) < 1e-9
        assert abs(b.steps - a.steps) <= 1


@settings(max_examples=200, deadline=None)
@given(SPECS, st.lists(st.builds(hs.GateReading, st.integers(0, 49), st.integers(0, 49),
                                 st.one_of(st.none(), st.floats(1, 1e4)), st.one_of(st.none(), st.floats(1, 1e4))),
                       min_size=1, max_size=30))
def test_too_little_data_holds_never_rolls_back(spec, readings):
    # fewer than min_requests completed: the error gate holds whatever the latency says, so no
    # window can fail on errors; and no data never counts as failure
    readings = [hs.GateReading(r.completed, min(r.errored, r.completed), 100.0, 100.0) for r in readings]
    states = _run(spec, readings)
    assert all(s.rollbacks == 0 and s.steps == 1 for s in states)
    assert all(s.phase in (hs.Phase.STEPPING, hs.Phase.HOLDING) for s in states)
    assert states[-1].phase is hs.Phase.HOLDING and "too little data" in states[-1].reason


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["good", "bad", "none"]), max_size=40), st.integers(2, 5))
def test_a_single_bad_window_never_rolls_back(pattern, n_fail):
    # windows fail only in isolation (never n_fail in a row): no rollback ever
    cfg = CFG.model_copy(update={"fail_windows": n_fail})
    seq, run = [], 0
    for p in pattern:
        if p == "bad" and run + 1 >= n_fail:
            p = "good"
        run = run + 1 if p == "bad" else (run if p == "none" else 0)
        seq.append({"good": GOOD, "bad": BAD, "none": hs.GateReading(0, 0, None, None)}[p])
    states = _run(hs.ShiftSpec("llm", "priority", "1", 5.0, 1.0), seq, cfg)
    assert all(s.rollbacks == 0 for s in states)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5))
def test_consecutive_failures_roll_back_exactly_one_step(good_first, n_fail):
    cfg = CFG.model_copy(update={"fail_windows": n_fail})
    states = _run(hs.ShiftSpec("llm", "priority", "1", 10.0, 1.0), [GOOD] * good_first + [BAD] * n_fail, cfg)
    before, after = states[-2], states[-1]
    assert before.share_percent == min(100.0, 10.0 * (1 + good_first)) or before.phase is hs.Phase.DONE
    if before.phase is not hs.Phase.DONE:
        assert after.steps == before.steps - 1 and after.rollbacks == 1
        assert after.phase is hs.Phase.ROLLED_BACK


def test_wilson_bounds_decide_with_enough_samples_only():
    cfg = ShiftConfig()  # seed 002: < 0.5 %, 95 % Wilson
    assert hs.judge(hs.GateReading(3, 0, 10, 10), cfg).error is hs.Verdict.HOLD  # 3 requests prove nothing
    assert hs.judge(hs.GateReading(3, 3, 10, 10), cfg).error is hs.Verdict.HOLD
    assert hs.judge(hs.GateReading(200, 0, 10, 10), cfg).error is hs.Verdict.HOLD  # upper bound 1.9 %
    assert hs.judge(hs.GateReading(1000, 0, 10, 10), cfg).error is hs.Verdict.PASS  # upper bound 0.38 %
    assert hs.judge(hs.GateReading(1000, 20, 10, 10), cfg).error is hs.Verdict.FAIL  # 2 %: lower bound 1.3 %
    lat = hs.judge(hs.GateReading(1000, 0, 116, 100), cfg)
    assert lat.latency is hs.Verdict.FAIL and lat.verdict is hs.Verdict.FAIL and abs(lat.latency_increase - 0.16) < 1e-9
    assert hs.judge(hs.GateReading(1000, 0, 114, 100), cfg).verdict is hs.Verdict.PASS


@given(st.floats(0.0, 0.0049), st.sampled_from([1.0, 1.96, 2.58]), st.integers(1, 200))
def test_requests_needed_is_the_first_count_whose_window_passes(ratio, z, min_requests):
    cfg = ShiftConfig(wilson_z=z, min_requests=min_requests)
    need = hs.requests_needed(ratio, cfg)
    assert need is not None and need >= min_requests

    def reading(n: int) -> hs.GateReading:
        return hs.GateReading(n, min(n, math.ceil(ratio * n)), 100.0, 100.0)  # as the window would count them

    assert hs.judge(reading(need), cfg).error is hs.Verdict.PASS
    if need > min_requests:
        assert hs.judge(reading(need - 1), cfg).error is not hs.Verdict.PASS


def test_the_window_arithmetic_an_operator_reads():
    cfg = ShiftConfig()  # 0.5 %, z 1.96, 50 requests
    assert hs.requests_needed(0.0, cfg) == 765  # 0 errors: 765 requests prove < 0.5 %
    assert hs.requests_needed(0.005, cfg) is None  # at the limit: no window passes
    held = hs.judge(hs.GateReading(12, 0, 100.0, 100.0), cfg)
    assert held.reason == "too little data: 12 of 50 requests; a window needs 765 at 0.00% errors"


def test_the_latency_gate_allows_the_noise_among_the_sources_own_nodes():
    cfg = ShiftConfig()  # +15 %
    assert hs.judge(hs.GateReading(1000, 0, 120.0, 100.0), cfg).latency is hs.Verdict.FAIL
    noisy = hs.judge(hs.GateReading(1000, 0, 120.0, 100.0, source_noise=0.1), cfg)  # equal engines, busy machine
    assert noisy.latency is hs.Verdict.PASS
    slow = hs.judge(hs.GateReading(1000, 0, 130.0, 100.0, source_noise=0.1), cfg)
    assert slow.latency is hs.Verdict.FAIL and "+ 10.0% noise among its own nodes" in slow.reason


def test_commands_table_and_hard_switch():
    st_, ev = hs.start(hs.ShiftSpec("llm", "region", "eu", 10, 60), 100.0)
    assert st_.phase is hs.Phase.STEPPING and st_.share_percent == 10 and st_.next_decision_s == 160.0
    p, _ = hs.command(st_, "pause", 110.0)
    assert p.phase is hs.Phase.PAUSED and p.next_decision_s is None and p.share_percent == 10
    r, _ = hs.command(p, "resume", 130.0)
    assert r.phase is hs.Phase.STEPPING and r.next_decision_s == 190.0  # a fresh window
    c, ev = hs.command(r, "cancel", 131.0)
    assert c.phase is hs.Phase.CANCELLED and c.share_percent == 0 and ev[0].kind == "cancelled"
    for what in ("pause", "resume", "cancel"):
        try:
            hs.command(c, what, 132.0)
        except ValueError as e:
            assert "cancelled" in str(e)
        else:
            raise AssertionError(f"{what} on a cancelled shift")
    h, ev = hs.start(hs.ShiftSpec("llm", "priority", "1", 10, 60, hard=True), 0.0)
    assert h.phase is hs.Phase.DONE and h.share_percent == 100 and ev[0].kind == "done"


def test_rollback_to_zero_pauses_and_missed_decisions_keep_the_grid():
    cfg = CFG.model_copy(update={"fail_windows": 1})
    s, _ = hs.start(hs.ShiftSpec("llm", "priority", "1", 10, 10), 0.0)
    s, ev = hs.decide(s, hs.judge(BAD, cfg), 10.0, cfg)
    assert s.phase is hs.Phase.PAUSED and s.share_percent == 0 and [e.kind for e in ev] == ["rolled_back", "paused"]
    s, _ = hs.start(hs.ShiftSpec("llm", "priority", "1", 10, 10), 0.0)
    s, _ = hs.decide(s, hs.judge(GOOD, cfg), 55.0, cfg)  # down 4 windows: one decision, grid kept
    assert s.share_percent == 20 and s.next_decision_s == 60.0


NODES = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["a", "b", "c"]), st.integers(1, 4)),
                 min_size=2, max_size=8)


@settings(max_examples=200, deadline=None)
@given(NODES, st.floats(0.0, 100.0))
def test_layout_weights_carry_the_share(raw, share):
    spots = [NodeSpot(f"n{i}", p, (r, "", ""), cap) for i, (p, r, cap) in enumerate(raw)]
    prios = sorted({s.priority for s in spots})
    spots = [NodeSpot(s.id, prios.index(s.priority), s.locality, s.capacity) for s in spots]  # contiguous
    target = {s.id for s in spots if s.priority == max(s.priority for s in spots)}
    if len(target) == len(spots):
        return
    lay = layout(spots, target, share)
    assert sorted(set(lay.priority.values())) == list(range(len(set(lay.priority.values()))))
    locs = {(lay.priority[s.id], lay.locality[s.id]) for s in spots}
    if lay.locality_weights is None:
        assert share <= 0 or share >= 100
        if share >= 100:
            assert all(lay.priority[i] == 0 for i in target)
            assert all(lay.priority[s.id] > 0 for s in spots if s.id not in target)
        return
    assert set(lay.locality_weights) == locs and all(w >= 1 for w in lay.locality_weights.values())
    top_t = sum(w for (p, loc), w in lay.locality_weights.items()
                if p == 0 and any(lay.locality[i] == loc for i in target))
    top = sum(w for (p, _), w in lay.locality_weights.items() if p == 0)
    assert abs(100.0 * top_t / top - share) < 0.1
    assert top <= WEIGHT_TOTAL + len(locs)
    # a target locality never merges with a source one
    assert not ({lay.locality[i] for i in target if lay.priority[i] == 0}
                & {lay.locality[s.id] for s in spots if s.id not in target and lay.priority[s.id] == 0})


@given(SPECS, st.lists(_readings(), max_size=8))
def test_state_document_round_trip(spec, readings):
    s = _run(spec, readings)[-1]
    doc = json.loads(json.dumps(to_doc({"llm": s}, {"llm": {"n0": 1}}, 5.0)))
    back, base = from_doc(doc)
    assert base == {"llm": {"n0": 1}}
    b = back["llm"]
    assert (b.phase, b.steps, b.share_percent, b.next_decision_s, b.failures, b.rollbacks) == \
        (s.phase, s.steps, s.share_percent, s.next_decision_s, s.failures, s.rollbacks)


def test_two_percent_errors_roll_back_one_step_with_the_seed_defaults():
    cfg = ShiftConfig()  # seed 002: < 0.5 % errors, +15 % latency; 2 consecutive failed windows
    two_percent = hs.GateReading(1000, 20, 100.0, 105.0)
    states = _run(hs.ShiftSpec("llm", "region", "eu", 10, 300), [hs.GateReading(1000, 0, 100.0, 105.0),
                                                                 two_percent, two_percent], cfg)
    assert [s.share_percent for s in states] == [10, 20, 20, 10]
    assert [s.phase for s in states] == [hs.Phase.STEPPING, hs.Phase.STEPPING, hs.Phase.STEPPING,
                                         hs.Phase.ROLLED_BACK]
    assert states[2].failures == 1 and states[3].rollbacks == 1 and states[3].last_gate.error is hs.Verdict.FAIL


@given(st.integers(0, 5000), st.integers(0, 50), st.lists(st.sampled_from(["gpu-c", "gpu-d", "gpu-e"]), min_size=1,
                                                          max_size=3, unique=True))
def test_a_shift_back_waits_for_the_targets_switch_back_verdicts_whatever_the_gates_say(n, e, waiting):
    r = hs.GateReading(n, min(e, n), 100.0, 100.0, awaiting_validation=tuple(sorted(waiting)))
    g = hs.judge(r, ShiftConfig())
    assert g.verdict is hs.Verdict.HOLD and g.reason.startswith("waiting for the target's switch-back verdicts (")
