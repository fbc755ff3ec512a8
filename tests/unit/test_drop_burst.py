"""Dropped agent streams judged as ours when many drop at once (xds_server.probing.drop_burst, pure)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from xds_server.probing.drop_burst import Drops, dropped, is_burst


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
