"""The detection timer (xds_server.probing.timers): a later deadline records a wish instead of
re-arming, and the Ticks come exactly when a timer re-armed on every call would give them."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.probing.timers import DeadlineQueue, TickTimer
from xds_server.process.clock import ManualClock


class _Loop:
    """The three event-loop calls TickTimer uses, on a ManualClock (callbacks run on time)."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.handles = 0  # handles created (call_at / call_later)

    def time(self) -> float:
        return self.clock.now()

    def call_at(self, at_s, fn, *args):
        self.handles += 1
        return self.clock.call_at(at_s, fn, *args)

    def call_later(self, d_s, fn, *args):
        return self.call_at(self.clock.now() + d_s, fn, *args)


def _timer(clock: ManualClock, ticks: list[float]) -> tuple[TickTimer, _Loop]:
    loop = _Loop(clock)
    t = TickTimer(loop, lambda: ticks.append(clock.now()), lag_tolerance_s=0.05, lag_recheck_s=0.01,
                  retry_s=0.1)
    return t, loop


def test_heartbeats_moving_the_deadline_later_do_not_rearm_and_the_tick_comes_at_the_last_deadline():
    clock, ticks = ManualClock(), []
    t, loop = _timer(clock, ticks)
    for k in range(10):  # a heartbeat every 100 ms: deadline = arrival + 180 ms
        clock.advance_to(k * 0.1)
        t.arm(k * 0.1 + 0.18)
    assert ticks == []
    clock.advance_to(2.0)
    assert ticks == [0.9 + 0.18]
    # 10 deadlines; the first armed a handle, later ones only when the earlier handle fired
    # (every 100 ms here: about one handle per heartbeat, never a cancel)
    assert loop.handles <= 11
    assert t.rearmed >= 1 and t.fired == 1


def test_an_earlier_deadline_rearms_at_once_and_none_cancels():
    clock, ticks = ManualClock(), []
    t, _ = _timer(clock, ticks)
    t.arm(1.0)
    t.arm(0.5)
    clock.advance_to(0.6)
    assert ticks == [0.5]
    t.arm(0.8)
    t.arm(None)
    clock.advance_to(3.0)
    assert ticks == [0.5] and not t.armed


def test_a_failing_tick_is_retried_after_retry_s():
    clock, calls = ManualClock(), []
    errors = []

    def tick():
        calls.append(clock.now())
        if len(calls) == 1:
            raise RuntimeError("boom")

    t = TickTimer(_Loop(clock), tick, lag_tolerance_s=0.05, lag_recheck_s=0.01, retry_s=0.1,
                  on_error=lambda: errors.append("tick"))
    t.arm(0.2)
    clock.advance_to(1.0)
    assert calls == [0.2, 0.2 + 0.1] and errors == ["tick"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.one_of(st.none(), st.integers(0, 600))), max_size=40))
def test_ticks_equal_a_timer_rearmed_on_every_call(steps):
    """Same Tick times as the reference (cancel + call_at on every arm) for any sequence of
    (advance ms, arm at +ms or None)."""
    clock, ticks = ManualClock(), []
    t, _ = _timer(clock, ticks)
    ref_clock, ref_ticks = ManualClock(), []
    ref = [None]

    def ref_arm(at):
        if ref[0] is not None:
            ref[0].cancel()
        ref[0] = None if at is None else ref_clock.call_at(at, lambda: ref_ticks.append(ref_clock.now()))

    for adv_ms, at_ms in steps:
        now = clock.now() + adv_ms / 1000.0
        clock.advance_to(now)
        ref_clock.advance_to(now)
        at = None if at_ms is None else now + at_ms / 1000.0
        t.arm(at)
        ref_arm(at)
    clock.advance_to(clock.now() + 10.0)
    ref_clock.advance_to(ref_clock.now() + 10.0)
    assert ticks == ref_ticks


class _JumpLoop:
    """An event loop's clock and timers that can also stall: :meth:`stall_to` moves time at once
    and only then runs what fell due, late (our own process stopped, then resumed)."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def call_at(self, at_s, fn, *args):
        return self.clock.call_at(at_s, self._run, fn, args)

    def call_later(self, d_s, fn, *args):
        return self.call_at(self.now + d_s, fn, *args)

    def _run(self, fn, args) -> None:
        self.now = max(self.now, self.clock.now())
        fn(*args)

    def advance_to(self, t_s: float) -> None:
        """On time: each callback runs at its due time."""
        self.clock.advance_to(t_s)
        self.now = max(self.now, t_s)

    def stall_to(self, t_s: float) -> None:
        """Late: the loop ran nothing until ``t_s``; every callback due by then runs at ``t_s``."""
        self.now = t_s
        self.clock.advance_to(t_s)


def test_a_deferral_ended_by_a_heartbeat_leaves_the_next_stall_deferred_too():
    """Regression (the fault matrix's SIGSTOP ejected one node alone): a short lag deferred a Tick,
    a heartbeat came during the re-check, and the deferral flag stayed set; the next stall of our
    own then ran its late Tick at once, before the heartbeats that waited unread were read."""
    loop, ticks = _JumpLoop(), []
    t = TickTimer(loop, lambda: ticks.append(loop.time()), lag_tolerance_s=0.05, lag_recheck_s=0.01, retry_s=0.1,
                  stall_recheck_s=0.18)
    for k in range(10):  # heartbeats every 100 ms
        loop.advance_to(k * 0.1)
        t.arm(k * 0.1 + 0.18)
    loop.stall_to(1.2)  # a 0.1 s lag of our own: the Tick is put off
    assert t.deferrals == 1 and ticks == []
    for k in range(12, 20):  # the heartbeats that waited are read during the re-check, then flow
        loop.advance_to(k * 0.1 + 0.005)
        t.arm(k * 0.1 + 0.005 + 0.18)
    loop.stall_to(7.0)  # a 5 s stall (SIGSTOP): judged one miss window later, not at once
    assert ticks == [] and t.deferrals == 2
    loop.advance_to(7.05)
    t.arm(7.05 + 0.18)  # a heartbeat read in the window: no Tick at all
    loop.advance_to(7.2)
    assert ticks == []


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 400)), max_size=30), st.integers(250, 5000))
def test_a_late_tick_is_never_run_at_the_instant_the_loop_wakes(steps, stall_ms):
    """For any history of heartbeats read on time or after a lag of our own (``(lagged, ms)``),
    a stall that makes the armed Tick late by more than the tolerance (its deadline is at most
    180 ms away; the stall 250 ms or more) and starts with no re-check pending never runs it at
    the instant we wake: it is deferred first."""
    loop, ticks = _JumpLoop(), []
    t = TickTimer(loop, lambda: ticks.append(loop.time()), lag_tolerance_s=0.05, lag_recheck_s=0.01, retry_s=0.1,
                  stall_recheck_s=0.18)
    for lagged, ms in steps:
        (loop.stall_to if lagged else loop.advance_to)(loop.now + ms / 1000.0)
        t.arm(loop.now + 0.18)
    loop.advance_to(loop.now + 0.02)  # any re-check still pending runs (on time)
    t.arm(loop.now + 0.18)
    wake = loop.now + stall_ms / 1000.0
    loop.stall_to(wake)
    assert wake not in ticks


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 150),
                          st.one_of(st.none(), st.integers(0, 400))), max_size=60))
def test_many_timers_in_one_queue_tick_as_their_own_naive_timers(steps):
    """Five timers sharing one DeadlineQueue (one loop timer): every timer's Tick times equal
    those of its own asyncio-style timer re-armed on every call, for any sequence of
    (timer, advance ms, arm at +ms or None); some Ticks re-arm their timer, as a node's does."""
    clock, ref_clock = ManualClock(), ManualClock()
    loop = _Loop(clock)
    ticks: list[list[float]] = [[] for _ in range(5)]
    ref_ticks: list[list[float]] = [[] for _ in range(5)]
    timers: list[TickTimer] = []
    refs: list = [None] * 5

    def ref_arm(i, at):
        if refs[i] is not None:
            refs[i].cancel()
        refs[i] = None if at is None else ref_clock.call_at(at, ref_tick, i)

    def ref_tick(i):
        ref_ticks[i].append(ref_clock.now())
        if i % 2:  # odd timers re-arm 70 ms after each Tick (a node still silent)
            ref_arm(i, ref_clock.now() + 0.07) if len(ref_ticks[i]) < 4 else None

    def tick(i):
        ticks[i].append(clock.now())
        if i % 2:
            timers[i].arm(clock.now() + 0.07) if len(ticks[i]) < 4 else None

    for i in range(5):
        timers.append(TickTimer(loop, lambda i=i: tick(i), lag_tolerance_s=10.0, lag_recheck_s=0.01, retry_s=0.1))
    for i, adv_ms, at_ms in steps:
        now = clock.now() + adv_ms / 1000.0
        clock.advance_to(now)
        ref_clock.advance_to(now)
        at = None if at_ms is None else now + at_ms / 1000.0
        timers[i].arm(at)
        ref_arm(i, at)
    clock.advance_to(clock.now() + 10.0)
    ref_clock.advance_to(ref_clock.now() + 10.0)
    assert ticks == ref_ticks
    q = DeadlineQueue.of(loop)
    assert len(q) == 0 and not any(t.armed for t in timers)


def test_one_loop_timer_serves_every_node_and_stale_entries_are_compacted():
    clock = ManualClock()
    loop = _Loop(clock)
    ticks: list[int] = []
    timers = [TickTimer(loop, lambda i=i: ticks.append(i), lag_tolerance_s=0.05, lag_recheck_s=0.01,
                        retry_s=0.1) for i in range(300)]
    for k in range(10):  # 300 nodes, a heartbeat each every 100 ms (deadline +180 ms)
        for i, t in enumerate(timers):
            clock.advance_to(k * 0.1 + i * 0.0003)
            t.arm(clock.now() + 0.18)
    q = DeadlineQueue.of(loop)
    assert ticks == [] and len(q) == 300
    assert clock.pending() <= 1  # one loop timer, however many nodes
    for t in timers:  # each moved earlier then cancelled: stale entries, rebuilt away
        t.arm(clock.now() + 0.01)
        t.cancel()
    assert len(q) == 0 and q.stale < 256
    clock.advance_to(clock.now() + 5.0)
    assert ticks == []
    timers[7].arm(clock.now() + 0.05)
    clock.advance_to(clock.now() + 1.0)
    assert ticks == [7]


def test_a_late_loop_defers_each_due_timer_once():
    """Woken 300 ms late (our loop stalled): every due timer is put off once by the stall
    re-check (180 ms) before its Tick, as a timer of its own would be."""
    clock = ManualClock()
    loop = _Loop(clock)
    ticks: list[tuple[int, float]] = []
    timers = [TickTimer(loop, lambda i=i: ticks.append((i, clock.now())), lag_tolerance_s=0.05,
                        lag_recheck_s=0.01, retry_s=0.1, stall_recheck_s=0.18) for i in range(3)]
    for i, t in enumerate(timers):
        t.arm(0.1 + i * 0.01)
    real_time = loop.time
    loop.time = lambda: real_time() + 0.3  # the loop reads its clock 300 ms after the due time
    clock.advance_to(0.1)
    loop.time = real_time
    assert ticks == [] and all(t.deferrals == 1 for t in timers)
    clock.advance_to(1.0)
    assert [i for i, _ in ticks] == [0, 1, 2]


def test_a_tick_rearming_in_the_past_waits_for_the_next_loop_iteration():
    """A Tick that asks for a time already past does not run again inside the same firing of
    the loop timer (it would hold the event loop: no I/O between): the loop timer is armed again
    and the next iteration runs it, as asyncio runs a call_at made from a callback."""
    armed: list[float] = []

    class _Stub:
        now = 1.0

        def time(self):
            return self.now

        def call_at(self, at_s, fn, *args):
            armed.append(at_s)
            return type("H", (), {"cancel": lambda self: None})()

    loop = _Stub()
    runs: list[float] = []
    t = TickTimer(loop, lambda: (runs.append(loop.now), t.arm(loop.now - 0.5)), lag_tolerance_s=10.0,
                  lag_recheck_s=0.01, retry_s=0.1)
    t.arm(1.0)
    q = DeadlineQueue.of(loop)
    q._run()
    assert runs == [1.0] and t.armed and armed[-1] == 0.5  # queued again, for the next iteration
    q._run()
    assert runs == [1.0, 1.0]
