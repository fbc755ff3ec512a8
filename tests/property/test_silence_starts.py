"""The counted silences' starts (xds_server.policy.silence_starts): kept sorted through adds, moves and
discards, and the look near one start finds exactly the fail-static windows a full walk would find
once that start is added (the walk: cluster_routing.fail_static, ``need`` starts within
``window_s``)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from xds_server.policy.silence_starts import SilenceStarts

starts = st.floats(0.0, 5.0).map(lambda x: round(x, 2))  # rounded: equal starts happen (a burst)
ops = st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", "e", "f", "g", "h"]), st.one_of(st.none(), starts)),
               max_size=40)


def full_walk(values: list[float], need: int, window_s: float) -> bool:
    """fail_static's own test: ``need`` consecutive sorted starts within ``window_s``."""
    s = sorted(values)
    return any(s[i + need - 1] - s[i] <= window_s for i in range(len(s) - need + 1))


@given(ops, st.integers(1, 5), st.sampled_from([0.0, 0.1, 0.5, 2.0]))
def test_near_window_says_what_the_walk_says_once_one_start_completes_a_window(ops, need, window_s):
    s, model = SilenceStarts(), {}
    for node_id, start in ops:
        before = full_walk(list(model.values()), need, window_s)
        if start is None:
            s.discard(node_id)
            model.pop(node_id, None)
            continue
        assert s.add(node_id, start) == (model.get(node_id) != start)  # new or moved: the core's "added"
        model[node_id] = start
        after = full_walk(list(model.values()), need, window_s)
        if not before:  # a window now is one the new start completed: the look near it finds it
            assert s.near_window(start, need, window_s) == after, (sorted(model.values()), start)
        elif s.near_window(start, need, window_s):
            assert after  # it never reports a window that is not there
    assert s.nodes() == set(model) and len(s) == len(model)
    for node_id, start in model.items():  # moves and discards left no stale start behind
        assert node_id in s
        assert s.near_window(start, 1, 0.0)
    assert not any(s.near_window(x, len(model) + 1, 10.0) for x in model.values())
    built = SilenceStarts(model)  # built at once (a recount) answers as the one kept step by step
    assert built.nodes() == s.nodes()
    assert all(built.near_window(x, need, window_s) == s.near_window(x, need, window_s) for x in model.values())


def test_a_burst_is_a_window_and_a_wave_is_not():
    s = SilenceStarts()
    for i in range(10):  # a wave: one silence every 0.3 s
        s.add(f"w{i}", i * 0.3)
    assert not any(s.near_window(i * 0.3, 3, 0.5) for i in range(10))
    s.add("b1", 1.0)  # with 0.9 and 1.2: three within 0.5 s
    assert s.near_window(1.0, 3, 0.5)
    s.discard("b1")
    assert not s.near_window(1.0, 3, 0.5) and len(s) == 10
