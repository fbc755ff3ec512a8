"""Admission by free slots (xds_server.policy.slot_admission): when the circuit-breaker limit is
published, what it is, and when it is lifted. Pure: inputs and a time argument."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.policy.slot_admission import TRANSITIONS, Admission, admission_step

MARK, AFTER = 0.8, 10.0


EXPLORE = 10.0


def step(state: Admission, now: float, *, overloaded: bool = False, slots=(16.0, 16.0), running=(16.0, 16.0),
         service=(0.8, 0.8), budget: float | None = None, envoys: int = 1) -> Admission:
    return admission_step(state, overloaded=overloaded, slots=list(slots), running=list(running),
                          service_s=list(service), budget_s=budget, envoys=envoys, release_below=MARK,
                          release_after_s=AFTER, now_s=now, explore_s=EXPLORE)


def test_the_table_has_a_next_state_for_every_state_and_event():
    events = {"unknown", "overload", "busy", "quiet", "quiet_long"}
    assert set(TRANSITIONS) == {(on, e) for on in (False, True) for e in events}
    assert [k for k, v in TRANSITIONS.items() if v and not k[0]] == [(False, "overload")]  # the one way in


def test_an_overload_with_known_slots_caps_each_envoy_at_its_share_of_the_slots_with_a_spare_at_first():
    a = step(Admission(), 0.0, overloaded=True, envoys=3)
    assert (a.limit, a.total, a.slots, a.spare, a.queue, a.envoys) == (12, 34, 32, 2, 0, 3)
    assert "32 slots + 2 spare" in a.reason and "12 per Envoy (3)" in a.reason
    queued = step(Admission(), 0.0, overloaded=True, budget=0.1)  # 40 finished per s: 4 within 0.1 s
    assert (queued.limit, queued.queue) == (38, 4)


def test_the_spare_places_last_while_the_slots_grow_and_explore_s_after():
    a = step(Admission(), 0.0, overloaded=True, slots=(15.0, 14.0), running=(15.0, 14.0))
    assert (a.limit, a.spare) == (31, 2)
    a = step(a, 6.0, slots=(16.0, 14.0), running=(16.0, 14.0))  # a node read low showed one more
    assert (a.limit, a.grown_s) == (32, 6.0)
    a = step(a, 15.9, slots=(16.0, 14.0), running=(16.0, 14.0))
    assert a.limit == 32
    a = step(a, 16.0, slots=(16.0, 14.0), running=(16.0, 14.0))  # 10 s without growth: no spare
    assert (a.limit, a.spare) == (30, 0)


def test_no_cap_without_an_overload_or_while_a_nodes_slots_are_unknown():
    assert step(Admission(), 0.0).limit is None
    assert step(Admission(), 0.0, overloaded=True, slots=(16.0, None)).limit is None
    assert step(Admission(), 0.0, overloaded=True, running=(16.0, None)).limit is None
    assert step(Admission(), 0.0, overloaded=True, slots=(), running=(), service=()).limit is None
    on = step(Admission(), 0.0, overloaded=True)
    off = step(on, 1.0, slots=(16.0, None))
    assert off.limit is None and "slots are unknown" in off.reason


def test_the_cap_is_lifted_only_after_occupancy_stayed_under_the_mark_for_release_after():
    a = step(Admission(), 0.0, overloaded=True)
    a = step(a, 2.0, running=(10.0, 10.0))   # 62 %: quiet from 2 s
    a = step(a, 6.0, running=(16.0, 15.0))   # 97 %: busy again, the clock restarts
    assert a.limit == 34 and a.low_since_s is None
    a = step(a, 8.0, running=(5.0, 5.0))
    a = step(a, 17.9, running=(5.0, 5.0))
    assert a.limit == 32 and a.low_since_s == 8.0  # (the spare places ended at 10 s)
    a = step(a, 18.0, running=(5.0, 5.0))
    assert a.limit is None and "under 80% of the slots for 10 s" in a.reason


def test_slots_that_grow_or_other_envoys_change_the_limit_a_queue_allowance_that_jitters_does_not():
    a = step(Admission(), 0.0, overloaded=True)
    assert step(a, 1.0, slots=(16.0, 17.0)).limit == 35        # a node read low shows one more
    assert step(a, 1.0, envoys=2).limit == 17
    q = step(Admission(), 0.0, overloaded=True, budget=0.1)   # 38 = 32 + 2 spare + 4
    assert step(q, 1.0, budget=0.11).limit == 38               # 4 -> 4.4: kept
    assert step(q, 1.0, budget=0.12, service=(0.75, 0.8)).limit == 38  # 4.8 + jitter: within 10 %
    assert step(q, 1.0, budget=0.2).limit == 42                # 8 queued: republished


_opt = st.one_of(st.none(), st.floats(0.0, 64.0))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_opt, _opt, st.one_of(st.none(), st.floats(0.01, 5.0))), min_size=0, max_size=6),
       st.booleans(), st.one_of(st.none(), st.floats(0.0, 2.0)), st.integers(0, 5))
def test_a_cap_is_published_only_when_every_slot_is_known_and_shares_the_total(nodes, overloaded, budget, envoys):
    slots = [s for s, _, _ in nodes]
    running = [r for _, r, _ in nodes]
    service = [t for _, _, t in nodes]
    a = admission_step(Admission(), overloaded=overloaded, slots=slots, running=running, service_s=service,
                       budget_s=budget, envoys=envoys, release_below=MARK, release_after_s=AFTER, now_s=0.0)
    known = bool(nodes) and all(s is not None and s > 0 for s in slots) and all(r is not None for r in running)
    assert (a.limit is not None) == (overloaded and known)
    if a.limit is not None:
        n = max(1, envoys)
        assert a.total == a.slots + a.spare + a.queue and a.spare == len(slots)
        assert a.slots == math.ceil(sum(slots))
        assert a.limit * n >= a.total and (a.limit - 1) * n < max(a.total, 1)
        rate = sum(s / t for s, t in zip(slots, service, strict=True) if t is not None)
        assert a.queue == 0 if budget is None or any(t is None for t in service) else a.queue <= budget * rate + 1e-9


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.1, 4.0)), min_size=1, max_size=40))
def test_once_admitting_the_cap_ends_only_after_a_continuous_quiet_stretch(occupancies):
    a = step(Admission(), 0.0, overloaded=True)
    now, low_from = 0.0, None
    for occ, dt in occupancies:
        now += dt
        a = step(a, now, running=(16.0 * occ, 16.0 * occ))
        low_from = None if occ >= MARK else (now if low_from is None else low_from)
        if a.limit is None:
            assert low_from is not None and now - low_from >= AFTER
            break
        assert low_from is None or now - low_from < AFTER
