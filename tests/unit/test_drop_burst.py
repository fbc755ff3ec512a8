"""Dropped agent streams judged as ours when many drop at once (xds_server.probing.drop_burst, pure)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from node_probe.dial_stream import CHANNEL_OPTIONS
from xds_server.probing.dial_in import AGENT_PING_TIMEOUT_S, ours_after_s
from xds_server.probing.drop_burst import (
    Drops,
    DropWatch,
    Stretch,
    burst_size,
    chain_holds,
    dropped,
    extended,
    is_burst,
    returns_hold,
    silent_with,
    stretched,
)


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


def test_a_silence_is_ours_when_enough_open_streams_have_missed_their_refresh_too():
    # now 10.0, a refresh every 1 s: streams heard nothing since 8.5 have missed theirs
    assert silent_with(8.5, [7.0, 7.5, 8.4, 8.5, 9.9, None]) == 4  # one not serving
    assert silent_with(8.5, [7.0, 9.2, 9.6, 9.9]) == 1  # the rest heard in time: alone
    assert burst_size(streams=20, min_drops=3, share=0.1) == 3
    assert burst_size(streams=1000, min_drops=3, share=0.1) == 100


@given(st.floats(0, 100), st.lists(st.one_of(st.none(), st.floats(0, 100)), max_size=50), st.floats(0, 5))
def test_a_stream_heard_later_never_adds_to_the_silent_and_an_earlier_mark_never_counts_more(before, heard, later):
    n = silent_with(before, heard)
    moved = [None if t is None else t + later for t in heard]  # every stream heard later (or as late)
    assert silent_with(before, moved) <= n
    assert silent_with(before - later, heard) <= n


def test_agents_coming_back_after_a_burst_of_ours_hold_again_one_agent_alone_does_not():
    back = Drops()
    for t in (10.6, 10.9, 11.5):  # three agents dialled back after the burst judged ours at 10.0
        back = dropped(back, t, 1.0)
    burst = stretched(None, 10.0, 1.2)
    assert returns_hold(back, 11.5, 1.0, min_returns=3, st=burst, horizon_s=30.0)
    assert not returns_hold(back, 11.5, 1.0, min_returns=3, st=None, horizon_s=30.0)   # no burst of ours
    assert not returns_hold(back, 11.5, 1.0, min_returns=3, st=stretched(None, -20.0, 1.2), horizon_s=30.0)
    assert not returns_hold(back, 11.5, 0.5, min_returns=3, st=burst, horizon_s=30.0)   # too far apart
    assert not returns_hold(dropped(Drops(), 10.7, 1.0), 10.7, 1.0, min_returns=3, st=burst, horizon_s=30.0)


def test_verdicts_of_ours_that_hold_each_other_up_end_a_horizon_after_they_began():
    run = None
    for t in range(40):  # a verdict of ours every second, each within the 1.2 s gap of the last
        run = stretched(run, float(t), 1.2)
    assert run == Stretch(0.0, 39.0)
    assert chain_holds(run, 20.5, 1.2, horizon_s=30.0) is True   # running since 0 s: 20 s in
    assert chain_holds(run, 39.5, 1.2, horizon_s=30.0) is False  # past 30 s
    assert chain_holds(run, 41.0, 1.2, horizon_s=30.0) is False  # none for 2 s: nothing noted to rest on
    assert chain_holds(None, 5.0, 1.2, horizon_s=30.0) is False
    assert stretched(run, 41.0, 1.2) == Stretch(41.0, 41.0)      # and a verdict then starts a new stretch


def test_agents_dialling_in_keep_a_stretch_going_but_never_renew_its_bound():
    """Dials that held the rest again, however far apart (a fleet dialling in for minutes), rest on
    the stretch they came in: it goes on from its own start, and its horizon ends them."""
    run = stretched(None, 10.0, 1.2)  # a burst of ours at 10 s
    for t in (11.0, 14.0, 25.0, 39.0):  # each one more than the 1.2 s gap after the one before
        run = extended(run, t)
        assert run.since_s == 10.0 and run.last_s == t
    assert extended(run, 30.0) == run  # an earlier time moves nothing
    back = Drops()
    for t in (40.2, 40.5, 40.8):
        back = dropped(back, t, 1.0)
    assert not returns_hold(back, 40.8, 1.0, min_returns=3, st=run, horizon_s=30.0)  # 30.8 s after it began
    w = DropWatch()
    w.held_again(5.0)  # no verdict of ours to rest on: nothing begins
    assert w.stretch is None
    w.ours(10.0, 1.2)
    w.held_again(14.0)  # past the gap: the same stretch, not a new one (as a verdict of ours would start)
    assert w.stretch == Stretch(10.0, 14.0)


@settings(max_examples=300)
@given(st.lists(st.integers(0, 4000), max_size=30), st.integers(0, 4000), st.integers(1, 2000),
       st.integers(1, 6), st.one_of(st.none(), st.tuples(st.integers(-4000, 4000), st.integers(0, 4000))),
       st.integers(0, 8000))
def test_a_return_holds_exactly_with_a_recent_stretch_and_enough_returns_in_the_window(
        times_ms, at_ms, window_ms, min_returns, stretch_ms, horizon_ms):
    ts = sorted(t / 1000 for t in times_ms if t <= at_ms) + [at_ms / 1000]
    back = Drops()
    for t in ts:
        back = dropped(back, t, window_ms / 1000)
    at, window, horizon = at_ms / 1000, window_ms / 1000, horizon_ms / 1000
    ours = None if stretch_ms is None else Stretch(stretch_ms[0] / 1000, (stretch_ms[0] + stretch_ms[1]) / 1000)
    want = (ours is not None and at - ours.since_s <= horizon
            and sum(1 for t in ts if at - window <= t <= at) >= min_returns)
    assert returns_hold(back, at, window, min_returns, ours, horizon) == want


@settings(max_examples=300)
@given(st.lists(st.integers(0, 3000), max_size=30), st.integers(1, 2000))
def test_a_stretch_begins_at_the_first_verdict_after_a_gap_and_ends_at_the_latest(gaps_ms, gap_ms):
    u = 1 / 1024  # whole multiples of it: differences are exact in binary floating point
    t, run, since = 0, None, 0
    for g in gaps_ms:  # verdicts of ours, each g units after the one before
        t += g
        if run is None or g > gap_ms:
            since = t
        run = stretched(run, t * u, gap_ms * u)
    assert run is None or run == Stretch(since * u, t * u)


def test_a_stop_of_ours_as_long_as_the_agents_own_ping_deadline_is_ours_whatever_our_deadline():
    """The agent cuts a stream whose PING we leave unanswered for its keepalive timeout: a stop that
    long is ours even where probe.dial_in.ping_timeout is set longer (its maximum is 60 s)."""
    assert AGENT_PING_TIMEOUT_S * 1000 == dict(CHANNEL_OPTIONS)["grpc.keepalive_timeout_ms"]
    assert ours_after_s(0.08) == 0.08
    assert ours_after_s(30.0) == AGENT_PING_TIMEOUT_S == 5.0
