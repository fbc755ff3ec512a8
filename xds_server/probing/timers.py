"""The detection timers of the probe sources: when each node's next Tick is due, on the event loop's clock.

One :class:`TickTimer` per node, all of one event loop in one :class:`DeadlineQueue`: a heap of
``(due s, seq, timer)`` and a single loop timer at its earliest entry. The health model says
when a Tick can next change something (``tick_due_s``); each heartbeat moves that deadline
about one interval later. A deadline that moves *later* only records the wish: the queued entry
comes due at its earlier time, finds the later wish and is queued again there, without a Tick.
A deadline that moves earlier is queued at once (the older entry is left in the heap, stale, and
skipped when it comes due). The Tick runs at the wished time, as if an asyncio timer were
re-armed on every call; per heartbeat that is a tuple pushed on our heap instead of an asyncio
handle (whose heap compares handles in Python) per node.

If a timer comes due later than ``lag_tolerance_s`` (our own event loop stalled, heartbeats may
be waiting unread), the Tick is put off once by ``lag_recheck_s`` (counted in ``deferrals``), or
by ``stall_recheck_s`` when it fired at least that late: after a stall of our own as long as a
heartbeat miss window (a SIGSTOP, a VM pause, a long GC) every heartbeat the agent sent meanwhile,
and its next one, arrive within one more window, so the silence judged is the node's, not ours.

Shape::

    t = TickTimer(loop, on_tick, lag_tolerance_s=0.05, lag_recheck_s=0.01, retry_s=0.1)
    t.arm(at_s)        # at_s: loop time (s) or None (nothing pending: cancel)
    t.cancel()
    DeadlineQueue.of(loop)   # the loop's queue (made at the first TickTimer of that loop)

``on_tick()`` is called with no argument; if it raises, the Tick is retried ``retry_s`` later
and the exception is passed on to the caller-supplied ``on_error(where="tick")``.
"""
from __future__ import annotations

import asyncio
import heapq
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["DeadlineQueue", "TickTimer", "recheck_after_s"]


def recheck_after_s(late_s: float, lag_recheck_s: float, stall_recheck_s: float | None) -> float:
    """How long (s) after waking ``late_s`` late to judge a node instead (see the module docstring).

    ``lag_recheck_s`` after a short lag; ``stall_recheck_s`` (one heartbeat miss window) after a
    stall of our own at least that long. Measured by the fault matrix: a 5 s SIGSTOP of the
    control plane ejected every node (or one, without fail-static) when re-checked after 5 ms."""
    if stall_recheck_s is not None and late_s >= stall_recheck_s:
        return stall_recheck_s
    return lag_recheck_s


_QUEUES: weakref.WeakKeyDictionary[Any, DeadlineQueue] = weakref.WeakKeyDictionary()

_COMPACT_MIN = 256  # stale entries before the heap is rebuilt without them (and only when most are stale)


class DeadlineQueue:
    """The due times of every :class:`TickTimer` of one event loop, with one loop timer.

    ``loop`` needs ``time()`` and ``call_at(at_s, fn)`` (an asyncio loop, or a test's stand-in).
    Entries come due in (due time, queueing order); one loop-timer firing runs every entry due
    by then (the loop's time read once for the batch; each timer reads it again). ``stale``:
    entries left in the heap by a timer re-queued earlier or cancelled (skipped when due; the heap
    is rebuilt when they are most of it). Not thread-safe."""

    __slots__ = ("__weakref__", "_handle", "_handle_at", "_heap", "_loop", "_running", "_seq", "stale")

    def __init__(self, loop: Any) -> None:
        self._loop = loop
        self._heap: list[tuple[float, int, TickTimer]] = []
        self._seq = 0
        self._handle: Any = None     # the loop timer, at _handle_at (loop s)
        self._handle_at = 0.0
        self._running = False        # in _run: it arms the loop timer when done
        self.stale = 0

    @classmethod
    def of(cls, loop: Any) -> DeadlineQueue:
        """The queue of ``loop`` (made on first use, dropped with the loop)."""
        q = _QUEUES.get(loop)
        if q is None:
            q = _QUEUES[loop] = cls(loop)
        return q

    def __len__(self) -> int:
        """Live entries (queued timers)."""
        return len(self._heap) - self.stale

    def push(self, timer: TickTimer, at_s: float) -> int:
        """Queue ``timer`` to come due at ``at_s`` (loop s); returns the entry's seq (> 0)."""
        self._seq += 1
        seq = self._seq
        heapq.heappush(self._heap, (at_s, seq, timer))
        if not self._running and (self._handle is None or at_s < self._handle_at):
            self._arm(at_s)
        return seq

    def drop(self) -> None:
        """A queued entry became stale: its timer was cancelled or is queued again earlier (the
        timer's ``_seq`` no longer names it when this is called)."""
        self.stale += 1
        heap = self._heap
        if self.stale >= _COMPACT_MIN and self.stale * 2 > len(heap):
            self._heap = [e for e in heap if e[2]._seq == e[1]]
            heapq.heapify(self._heap)
            self.stale = 0
            if not self._running:
                self._arm(self._heap[0][0] if self._heap else None)

    def _arm(self, at_s: float | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if at_s is not None:
            self._handle_at = at_s
            self._handle = self._loop.call_at(at_s, self._run)

    def _run(self) -> None:
        """The loop timer: run every entry due by now (the loop ran it, so its own time is due)
        that was queued before this run began. One queued meanwhile (a Tick re-arming at a time
        already past) waits for the loop's next iteration, as ``call_at`` from a callback does:
        a timer that keeps asking for the past cannot hold the loop in here."""
        self._handle = None
        self._running = True
        heap = self._heap
        limit = max(self._loop.time(), self._handle_at)
        last_seq = self._seq
        try:
            while heap and heap[0][0] <= limit and heap[0][1] <= last_seq:
                _, seq, timer = heapq.heappop(heap)
                if timer._seq != seq:
                    self.stale -= 1
                    continue
                timer._seq = 0
                timer._fire()
                heap = self._heap  # a compaction may have replaced it
        finally:
            self._running = False
            if heap:
                self._arm(heap[0][0])


class TickTimer:
    """A single re-armable detection timer (see the module docstring). Not thread-safe."""

    __slots__ = (
        "_at",
        "_deferred",
        "_lag_s",
        "_loop",
        "_on_error",
        "_on_tick",
        "_q",
        "_recheck_s",
        "_retry_s",
        "_seq",
        "_stall_s",
        "_want",
        "deferrals",
        "fired",
        "rearmed",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, on_tick: Callable[[], None], *,
                 lag_tolerance_s: float, lag_recheck_s: float, retry_s: float,
                 stall_recheck_s: float | None = None,
                 on_error: Callable[[], None] | None = None) -> None:
        self._loop = loop
        self._q = DeadlineQueue.of(loop)
        self._on_tick = on_tick
        self._on_error = on_error
        self._lag_s = lag_tolerance_s
        self._recheck_s = lag_recheck_s
        self._retry_s = retry_s
        self._stall_s = stall_recheck_s
        self._seq = 0               # this timer's live entry in the queue; 0: none
        self._at = 0.0              # the due time being waited for (loop s; after a deferral: its start)
        self._want: float | None = None  # when the next Tick is due (loop s); None: none pending
        self._deferred = False
        self.deferrals = 0          # Ticks put off because the loop was late
        self.fired = 0              # Ticks run
        self.rearmed = 0            # entries that came due, found a later deadline and were queued again

    @property
    def armed(self) -> bool:
        return self._seq != 0

    def arm(self, at_s: float | None) -> None:
        """The next Tick is due at ``at_s`` (loop clock, s); None: nothing pending (cancel)."""
        self._want = at_s
        if at_s is None:
            self.cancel()
            return
        if self._seq:
            if self._at <= at_s:
                return  # comes due earlier and is queued again then
            self._seq = 0
            self._q.drop()
        self._at = at_s
        self._deferred = False  # a new entry: a deferral it replaces is over
        self._seq = self._q.push(self, at_s)

    def cancel(self) -> None:
        if self._seq:
            self._seq = 0
            self._q.drop()

    def _fire(self) -> None:
        """This timer's entry came due (called by the queue, which cleared ``_seq``)."""
        loop = self._loop
        want = self._want
        if want is not None and want > self._at:
            # the deadline moved later since this entry was queued: nothing is due yet. A
            # deferral is over too (a heartbeat came while it waited): the entry queued now is
            # judged on its own lateness. (Kept set, it let the next stall's late Tick run at
            # once: the fault matrix's SIGSTOP ejected a node alone.)
            self.rearmed += 1
            self._deferred = False
            self._at = want
            self._seq = self._q.push(self, want)
            return
        now = loop.time()
        late_s = now - self._at
        if late_s > self._lag_s and not self._deferred:
            # Our own event loop stalled: heartbeats may be waiting unread. Let it drain first.
            self._deferred = True
            self.deferrals += 1
            self._at = now
            self._seq = self._q.push(self, now + recheck_after_s(late_s, self._recheck_s, self._stall_s))
            return
        self._deferred = False
        self.fired += 1
        try:
            self._on_tick()
        except Exception:  # a Tick that fails is retried at the next interval
            if self._on_error is not None:
                self._on_error()
            if self._seq:  # the failed Tick had queued one already: the retry replaces it
                self._seq = 0
                self._q.drop()
            self._at = loop.time() + self._retry_s
            self._seq = self._q.push(self, self._at)
