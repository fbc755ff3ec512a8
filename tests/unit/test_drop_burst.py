"""Dropped agent streams judged as ours when many drop at once (xds_server.probing.drop_burst, pure)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from xds_server.probing.drop_burst import Drops, DropWatch, dropped, is_burst


def _drops(*times: float) -> Drops:
    d = Drops()
    for t in times:
        d = dropped(d, t, keep_s=10.0)
    return d


def test_one_drop_alone_is_the_nodes_and_three_together_are_ours():
    assert not is_burst(_drops(5.0), 5.0, 0.2, streams=10, min_drops=3, share=0.1)
    d = _drops(5.0, 5.05, 5.1)
    assert all(is_burst(d, t, 0.2, streams=10, min_drops=3, share=0.1) for t in (5.0, 5.05, 5.1))


def test_a_burst_must_also_be_a_share_of_the_open_streams():
    d = _drops(1.0, 1.01, 1.02, 1.03)
    assert is_burst(d, 1.0, 0.2, streams=40, min_drops=3, share=0.1)       # 4 >= 4
    assert not is_burst(d, 1.0, 0.2, streams=41, min_drops=3, share=0.1)   # 4 < ceil(4.1)


def test_drops_further_apart_than_the_window_do_not_add_up():
    d = _drops(1.0, 1.5, 2.0, 2.5)
    assert not any(is_burst(d, t, 0.2, streams=4, min_drops=2, share=0.0) for t in (1.0, 1.5, 2.0, 2.5))


def test_old_drops_are_forgotten():
    d = dropped(_drops(1.0, 1.1), 5.0, keep_s=1.0)
    assert d.times == (5.0,)


@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=30),
       st.integers(1, 1000), st.integers(2, 10), st.floats(0, 1))
def test_a_burst_needs_both_bounds_and_adding_drops_never_undoes_one(times, streams, min_drops, share):
    times = sorted(times)
    d = _drops(*times)
    at = times[-1]
    n = sum(1 for t in times if abs(t - at) <= 0.2)
    burst = is_burst(d, at, 0.2, streams, min_drops, share)
    assert burst == (n >= min_drops and n >= share * streams - 1e-9 and n >= -(-share * streams // 1))
    if burst:
        assert is_burst(dropped(d, at, 10.0), at, 0.2, streams, min_drops, share)


def test_silences_are_kept_apart_from_drops_one_per_node_by_when_they_began():
    w = DropWatch()
    w.open = 20
    assert w.fell_silent("a", 1.0, now_s=4.0) == 20  # silent streams are still open
    assert w.dropped(4.0, keep_s=1.0) == 21  # a dropped one was open just before
    assert w.silences.times == (1.0,) and w.drops.times == (4.0,)
    for now in (4.2, 4.4, 6.0):
        w.fell_silent("a", 1.0, now)  # the same silence looked at again: still one, still begun at 1.0
    assert w.silences.times == (1.0,)
    assert not is_burst(w.silences, 1.0, 3.0, streams=w.open, min_drops=3, share=0.1)
    w.fell_silent("b", 1.5, now_s=6.1)  # still silent when the rest are heard: with the others that began then
    w.fell_silent("c", 2.9, now_s=6.2)
    assert is_burst(w.silences, 1.5, 3.0, streams=w.open, min_drops=3, share=0.1)  # 3 of 20 began within 3 s
    assert not is_burst(w.drops, 4.0, 0.2, streams=w.open, min_drops=3, share=0.1)  # 1 drop alone
    w.fell_silent("a", 9.0, now_s=12.0)  # heard since, silent again: its new silence replaces the old
    assert w.silences.times == (1.5, 2.9, 9.0)
    assert not is_burst(w.silences, 9.0, 3.0, streams=w.open, min_drops=3, share=0.1)
    w.fell_silent("d", 68.0, now_s=70.0)
    assert w.silences.times == (68.0,)  # begun more than SILENCE_KEEP_S (60 s) ago: forgotten
