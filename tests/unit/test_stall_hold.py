"""Our own event-loop stalls hold verdicts on a node's silence (xds_server.probing.stall_hold, pure):
the compact history answers like one that keeps every stall, and a hold ends at the node's first
heartbeat after we woke or ``hold_s`` after waking. A ping's round trip spans a stall exactly when
one that the full record holds woke inside it."""
from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.probing.stall_hold import (
    Stall,
    StallHistory,
    held_until,
    late_between,
    noted,
    overdue_s,
    ran,
    stalled_between,
    stalls_at,
    unscheduled_s,
)

U = 1 / 1024  # times are whole multiples of this (s), so sums are exact in binary floating point
PERIOD, MIN_GAP, KEEP = 64 * U, 64 * U, 60.0

#: sampler runs: how late each ran beyond its period (U; 0: on time)
_runs = st.lists(st.one_of(st.just(0), st.integers(0, 6000)), max_size=40)


def _replay(runs: list[int]) -> tuple[StallHistory, list[Stall], float]:
    """The compact history, every recorded stall (the reference) and the last run's time."""
    h, all_stalls, now = StallHistory(alive_s=0.0), [], 0.0
    for late in runs:
        now = h.alive_s + PERIOD + late * U
        h = ran(h, now, PERIOD, MIN_GAP, KEEP)
        if late * U >= MIN_GAP:
            all_stalls.append(Stall(now, late * U))
    return h, all_stalls, now


def _reference(every: list[Stall], h: StallHistory, last: float, now: float, stall_s: float, hold_s: float,
               heard: float | None) -> float | None:
    """held_until over every stall ever recorded (none pruned but by age), and the pending one."""
    cands = [s for s in every if s.woke_s >= last - KEEP]
    if now - h.alive_s - PERIOD > 0:
        cands.append(Stall(now, now - h.alive_s - PERIOD))
    ends = [s.woke_s + min(hold_s, s.gap_s) for s in cands
            if s.gap_s >= stall_s and (heard is None or heard < s.woke_s)]
    ends = [e for e in ends if e > now]
    return max(ends) if ends else None


@settings(max_examples=400, deadline=None)
@given(_runs, st.integers(0, 3000), st.integers(1, 3000), st.integers(1, 2000),
       st.one_of(st.none(), st.integers(-8000, 3000)))
def test_the_hold_equals_one_computed_over_every_stall_ever_recorded(runs, later_u, stall_u, hold_u, heard_rel_u):
    h, every, last = _replay(runs)
    now = last + later_u * U
    stall_s, hold_s = stall_u * U, hold_u * U
    heard = None if heard_rel_u is None else now + heard_rel_u * U
    at = held_until(h, now, PERIOD, stall_s, hold_s, heard)
    assert at == _reference(every, h, last, now, stall_s, hold_s, heard)
    if at is not None:  # a hold ends after now, at most hold_s after waking from the stall
        assert now < at <= now + hold_s
    # the compact form stays small: waking order, gaps strictly decreasing
    assert all(a.woke_s < b.woke_s and a.gap_s > b.gap_s for a, b in pairwise(h.stalls))


def test_a_five_second_sigstop_holds_a_silent_node_for_hold_s_and_a_heard_one_not_at_all():
    h = StallHistory(alive_s=10.0)
    for k in range(1, 5):  # sampled on time
        h = ran(h, 10.0 + k * PERIOD, PERIOD, MIN_GAP, KEEP)
    woke = 10.0 + 5 * PERIOD + 5.0
    # waking, before the sampler ran: the pending stall is seen already
    assert held_until(h, woke, PERIOD, 0.18, 1.0, heard_s=10.2) == woke + 1.0
    h = ran(h, woke, PERIOD, MIN_GAP, KEEP)
    assert h.count == 1 and h.stalls == (Stall(woke, 5.0),)
    assert held_until(h, woke + 0.18, PERIOD, 0.18, 1.0, heard_s=10.2) == woke + 1.0    # not heard since
    assert held_until(h, woke + 0.18, PERIOD, 0.18, 1.0, heard_s=woke + 0.01) is None   # heard: judged
    for k in range(1, 17):  # the sampler runs on time again
        h = ran(h, woke + k * PERIOD, PERIOD, MIN_GAP, KEEP)
    assert held_until(h, woke + 1.0, PERIOD, 0.18, 1.0, heard_s=10.2) is None           # bounded
    assert held_until(h, woke + 0.1, PERIOD, 6.0, 1.0, heard_s=None) is None            # shorter than stall_s


def test_a_shorter_stall_after_a_long_one_keeps_both_and_a_longer_one_replaces_them():
    h = StallHistory(alive_s=0.0)
    h = ran(h, PERIOD + 5.0, PERIOD, MIN_GAP, KEEP)                # 5 s
    h = ran(h, h.alive_s + PERIOD + 0.25, PERIOD, MIN_GAP, KEEP)   # 0.25 s
    assert [s.gap_s for s in h.stalls] == [5.0, 0.25]
    woke_long, woke_short = h.stalls[0].woke_s, h.stalls[1].woke_s
    now = h.alive_s + 0.01
    assert stalls_at(h, now, PERIOD) == h.stalls
    # not heard since before the long stall: held by it (1 s from its waking), longer than the short one's
    assert held_until(h, now, PERIOD, 0.2, 1.0, heard_s=0.0) == woke_long + 1.0
    # heard between them: only the short stall holds it, for its own length
    assert held_until(h, now, PERIOD, 0.2, 1.0, heard_s=woke_long + 0.01) == woke_short + 0.25
    assert held_until(h, now, PERIOD, 0.3, 1.0, heard_s=woke_long + 0.01) is None  # too short to count
    h = ran(h, h.alive_s + PERIOD + 6.0, PERIOD, MIN_GAP, KEEP)
    assert [s.gap_s for s in h.stalls] == [6.0]
    assert ran(h, h.alive_s + KEEP + 1.0, PERIOD, MIN_GAP, KEEP).stalls[:-1] == ()  # old ones forgotten


@settings(max_examples=400, deadline=None)
@given(_runs, st.integers(0, 3000), st.integers(0, 12000), st.integers(1, 3000))
def test_a_round_trip_spans_a_stall_exactly_when_one_of_every_recorded_stall_woke_inside_it(runs, later_u, rtt_u,
                                                                                          least_u):
    h, every, last = _replay(runs)
    now = last + later_u * U
    since = now - rtt_u * U
    cands = [s for s in every if s.woke_s >= last - KEEP]
    if now - h.alive_s - PERIOD > 0:  # the stall we are waking from, not sampled yet
        cands.append(Stall(now, now - h.alive_s - PERIOD))
    assert stalled_between(h, since, now, PERIOD) == any(s.woke_s > since and s.gap_s >= PERIOD for s in cands)
    least = least_u * U  # a stall at least this long (a transport drop asks for the PING timeout)
    assert stalled_between(h, since, now, PERIOD, least) == any(s.woke_s > since and s.gap_s >= least
                                                                for s in cands)


def test_the_five_second_sigstop_pong_is_dropped_and_a_round_trip_after_it_is_kept():
    h = StallHistory(alive_s=10.0)
    sent = 10.01
    woke = 10.0 + PERIOD + 5.0
    # waking, the sampler not run yet: the pong read now spans the stall
    assert stalled_between(h, sent, woke + 0.001, PERIOD)
    h = ran(h, woke, PERIOD, MIN_GAP, KEEP)
    assert stalled_between(h, sent, woke + 0.001, PERIOD)
    # a ping sent after waking measures the network again
    assert not stalled_between(h, woke + 0.01, woke + 0.012, PERIOD)
    # a late run shorter than the sampler's period is no stall
    h2 = ran(StallHistory(alive_s=0.0), PERIOD + PERIOD / 2, PERIOD, MIN_GAP, KEEP)
    assert not stalled_between(h2, 0.0, h2.alive_s + 0.001, PERIOD)


def _replay_late(runs: list[int]) -> tuple[StallHistory, list[tuple[float, float]], float]:
    """The history after ``runs``, the late runs as the sampler keeps them ((woke, late), oldest
    first) and the last run's time."""
    h, late_runs, last = StallHistory(alive_s=0.0), [], 0.0
    for late in runs:
        last = h.alive_s + PERIOD + late * U
        h = ran(h, last, PERIOD, MIN_GAP, KEEP)
        if late:
            late_runs.append((last, late * U))
    return h, late_runs, last


@settings(max_examples=400, deadline=None)
@given(_runs, st.integers(0, 3000), st.integers(0, 12000), st.integers(1, 200))
def test_a_round_trip_waited_on_our_queue_exactly_when_a_late_run_overlaps_it(runs, later_u, rtt_u, min_late_u):
    """``late_between`` over the late runs kept (oldest first) equals a walk over every run: one at
    least ``min_late`` late that woke within a period before the ping or after it and before the
    pong's read, or the run due and pending."""
    h, late_runs, last = _replay_late(runs)
    now = last + later_u * U
    since = now - rtt_u * U
    min_late = min_late_u * U
    want = (now - h.alive_s - PERIOD >= min_late
            or any(w > since - PERIOD and lt >= min_late and w - lt < now for w, lt in late_runs))
    assert late_between(late_runs, overdue_s(h, now, PERIOD), since, now, PERIOD, min_late) == want


@settings(max_examples=400, deadline=None)
@given(_runs, st.integers(0, 3000), _runs, st.integers(0, 12000), st.integers(1, 200))
def test_a_ping_not_sent_while_our_loop_runs_late_would_have_given_no_sample(runs, later_u, more, rtt_u, min_late_u):
    """The pinger asks ``late_between(runs, overdue_s(h, now, ...), now, now, ...)`` before it sends: when that says our
    loop runs late, the round trip of a ping sent now would be dropped at its pong, whatever the
    sampler records meanwhile (``more``: its runs after ``now``) and however long the trip."""
    h, late_runs, last = _replay_late(runs)
    now = last + later_u * U  # the pinger wakes; the sampler has not run since ``last``
    if now >= h.alive_s + PERIOD:  # it is due by now: its run wakes no earlier than now
        more = [max(more[0] if more else 0, round((now - h.alive_s - PERIOD) / U))] + more[1:]
    min_late = min_late_u * U
    if not late_between(late_runs, overdue_s(h, now, PERIOD), now, now, PERIOD, min_late):
        return
    pong = now + rtt_u * U
    for late in more:  # the sampler's runs up to the pong's read
        woke = h.alive_s + PERIOD + late * U
        if woke > pong:
            break
        h = ran(h, woke, PERIOD, MIN_GAP, KEEP)
        if late:
            late_runs.append((woke, late * U))
    assert late_between(late_runs, overdue_s(h, pong, PERIOD), now, pong, PERIOD, min_late)


def test_a_pong_read_behind_a_30_ms_queue_is_dropped_and_one_on_an_idle_loop_is_kept():
    h = StallHistory(alive_s=1.0)
    runs = [(1.0 + PERIOD + 0.03, 0.03)]  # the sampler ran 30 ms late: a queue, no stall
    h = ran(h, runs[0][0], PERIOD, MIN_GAP, KEEP)
    woke = runs[0][0]

    def late(runs: list[tuple[float, float]], since: float, now: float, min_late: float) -> bool:
        return late_between(runs, overdue_s(h, now, PERIOD), since, now, PERIOD, min_late)

    assert not stalled_between(h, woke - 0.02, woke + 0.001, PERIOD)
    assert late(runs, woke - 0.02, woke + 0.001, 0.02)       # in flight meanwhile
    assert not late(runs, woke - 0.02, woke + 0.001, 0.04)   # under the bound
    assert late(runs, woke + 0.005, woke + 0.01, 0.02)       # sent just after it
    assert not late(runs, woke + PERIOD + 0.005, woke + PERIOD + 0.01, 0.02)  # a period on
    assert late([], woke + PERIOD, woke + PERIOD + 0.03, 0.02)  # the next run 30 ms overdue


@given(st.integers(0, 10_000), st.integers(0, 10_000))
def test_the_time_our_thread_surely_did_not_run_is_the_lateness_less_its_cpu(late_u, cpu_u):
    """Never negative, never more than the lateness; all of it when the thread used no CPU (a
    SIGSTOP), none when it used at least the lateness (a collection, a publish)."""
    off = unscheduled_s(late_u * U, cpu_u * U)
    assert 0.0 <= off <= late_u * U
    assert off == max(0, late_u - cpu_u) * U
    assert unscheduled_s(late_u * U, 0.0) == late_u * U


@settings(max_examples=300, deadline=None)
@given(_runs, st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 3000)), max_size=12), st.integers(1, 2000),
       st.one_of(st.none(), st.integers(-8000, 3000)))
def test_bursts_noted_as_stalls_hold_as_the_full_record_would(runs, bursts, hold_u, heard_rel_u):
    """A burst of drops or silences judged ours is noted as a stall of ``gap`` at its time: the
    compact history then answers as one that keeps it with every sampler stall."""
    h, every, now = _replay(runs)
    for after_u, gap_u in bursts:  # bursts after the sampler's last run, in time order
        now += after_u * U
        h = noted(h, now, gap_u * U, KEEP)
        every.append(Stall(now, gap_u * U))
    hold_s, stall_s = hold_u * U, 180 * U
    heard = None if heard_rel_u is None else now + heard_rel_u * U
    assert held_until(h, now, PERIOD, stall_s, hold_s, heard) == _reference(every, h, now, now, stall_s, hold_s, heard)
    assert all(a.woke_s <= b.woke_s and a.gap_s > b.gap_s for a, b in pairwise(h.stalls))


def test_a_burst_noted_at_t_holds_a_node_not_heard_since_for_hold_s_and_a_later_burst_extends_it():
    h = StallHistory(alive_s=10.0)
    h = noted(h, 10.0, 1.0, KEEP)
    assert held_until(h, 10.0, PERIOD, 0.18, 1.0, heard_s=9.9) == 11.0
    assert held_until(h, 10.0, PERIOD, 0.18, 1.0, heard_s=10.01) is None  # heard after it: no hold
    h = noted(StallHistory(10.04, h.stalls, h.count), 10.04, 1.0, KEEP)  # the sampler ran; a second burst
    assert held_until(h, 10.05, PERIOD, 0.18, 1.0, heard_s=9.9) == 11.04
    assert len(h.stalls) == 1 and h.count == 2
