"""The detection timer of one probe source: when the next Tick is due, on the event loop's clock.

One timer per node. The health model says when a Tick can next change something
(``next_check_s``); each heartbeat moves that deadline about one interval later. Re-arming an
asyncio timer per heartbeat (cancel + ``call_at``) costs a handle and heap work every 100 ms per
node, so a deadline that moves *later* only records the wish: the armed timer fires at its
earlier time, finds the later wish and re-arms there, without a Tick. A deadline that moves
earlier re-arms at once. The Tick runs at the wished time, as if re-armed each time.

If the timer fires later than ``lag_tolerance_s`` (our own event loop stalled, heartbeats may
be waiting unread), the Tick is put off once by ``lag_recheck_s`` (counted in ``deferrals``), or
by ``stall_recheck_s`` when it fired at least that late: after a stall of our own as long as a
heartbeat miss window (a SIGSTOP, a VM pause, a long GC) every heartbeat the agent sent meanwhile,
and its next one, arrive within one more window, so the silence judged is the node's, not ours.

Shape::

    t = TickTimer(loop, on_tick, lag_tolerance_s=0.05, lag_recheck_s=0.01, retry_s=0.1)
    t.arm(at_s)        # at_s: loop time (s) or None (nothing pending: cancel)
    t.cancel()

``on_tick()`` is called with no argument; if it raises, the Tick is retried ``retry_s`` later
and the exception is passed on to the caller-supplied ``on_error(where="tick")``.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["TickTimer", "recheck_after_s"]


def recheck_after_s(late_s: float, lag_recheck_s: float, stall_recheck_s: float | None) -> float:
    """How long (s) after waking ``late_s`` late to judge a node instead (see the module docstring).

    ``lag_recheck_s`` after a short lag; ``stall_recheck_s`` (one heartbeat miss window) after a
    stall of our own at least that long. Measured by the fault matrix: a 5 s SIGSTOP of the
    control plane ejected every node (or one, without fail-static) when re-checked after 5 ms."""
    if stall_recheck_s is not None and late_s >= stall_recheck_s:
        return stall_recheck_s
    return lag_recheck_s


class TickTimer:
    """A single re-armable detection timer (see the module docstring). Not thread-safe."""

    __slots__ = ("_loop", "_on_tick", "_on_error", "_lag_s", "_recheck_s", "_retry_s", "_stall_s", "_handle", "_at",
                 "_want", "_deferred", "deferrals", "fired", "rearmed")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_tick: Callable[[], None], *,
                 lag_tolerance_s: float, lag_recheck_s: float, retry_s: float,
                 stall_recheck_s: float | None = None,
                 on_error: Callable[[], None] | None = None) -> None:
        self._loop = loop
        self._on_tick = on_tick
        self._on_error = on_error
        self._lag_s = lag_tolerance_s
        self._recheck_s = lag_recheck_s
        self._retry_s = retry_s
        self._stall_s = stall_recheck_s
        self._handle: asyncio.TimerHandle | None = None
        self._at = 0.0              # when the armed handle fires (loop s)
        self._want: float | None = None  # when the next Tick is due (loop s); None: none pending
        self._deferred = False
        self.deferrals = 0          # Ticks put off because the loop was late
        self.fired = 0              # Ticks run
        self.rearmed = 0            # handle firings that found a later deadline and re-armed

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self, at_s: float | None) -> None:
        """The next Tick is due at ``at_s`` (loop clock, s); None: nothing pending (cancel)."""
        self._want = at_s
        if at_s is None:
            self.cancel()
            return
        if self._handle is not None and self._at <= at_s:
            return  # fires earlier and re-arms then
        if self._handle is not None:
            self._handle.cancel()
        self._at = at_s
        self._deferred = False  # a new handle: a deferral it replaces is over
        self._handle = self._loop.call_at(at_s, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        loop = self._loop
        want = self._want
        if want is not None and want > self._at:
            # the deadline moved later since this handle was armed: nothing is due yet. A
            # deferral is over too (a heartbeat came while it waited): the handle armed now is
            # judged on its own lateness. (Kept set, it let the next stall's late Tick run at
            # once: the fault matrix's SIGSTOP ejected a node alone.)
            self.rearmed += 1
            self._deferred = False
            self._at = want
            self._handle = loop.call_at(want, self._fire)
            return
        late_s = loop.time() - self._at
        if late_s > self._lag_s and not self._deferred:
            # Our own event loop stalled: heartbeats may be waiting unread. Let it drain first.
            self._deferred = True
            self.deferrals += 1
            self._at = loop.time()
            self._handle = loop.call_later(recheck_after_s(late_s, self._recheck_s, self._stall_s), self._fire)
            return
        self._deferred = False
        self.fired += 1
        try:
            self._on_tick()
        except Exception:  # noqa: BLE001 - a Tick that fails is retried at the next interval
            if self._on_error is not None:
                self._on_error()
            self._at = loop.time() + self._retry_s
            self._handle = loop.call_at(self._at, self._fire)
