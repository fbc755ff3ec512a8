"""Clocks for the control plane: the real one (the asyncio loop) and a manual one for tests.

Shape::

    clock.now()                       # monotonic seconds (loop.time() for LoopClock)
    clock.wall()                      # unix seconds, for event records only
    t = clock.call_at(at_s, fn, *a)   # run fn(*a) at monotonic time at_s; t.cancel() stops it

:class:`ManualClock` runs nothing by itself: ``advance(dt_s)`` moves time and runs every due
callback in time order, so the control plane can be driven without an event loop.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Clock", "LoopClock", "ManualClock", "Timer"]


class Timer(Protocol):
    """A scheduled callback; ``cancel()`` is idempotent."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Time source and timer service (see module docstring)."""

    def now(self) -> float: ...

    def wall(self) -> float: ...

    def call_at(self, at_s: float, fn: Callable[..., Any], *args: Any) -> Timer: ...


class LoopClock:
    """The running asyncio loop's clock (``loop.time()``) and ``loop.call_at``.

    The loop is looked up on first use, so the clock can be built before the loop runs.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def now(self) -> float:
        """Loop time, s (0.0 before any loop runs)."""
        if self._loop is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                return 0.0
        return self._loop.time()

    def wall(self) -> float:
        return time.time()

    def call_at(self, at_s: float, fn: Callable[..., Any], *args: Any) -> asyncio.TimerHandle:
        return self.loop.call_at(at_s, fn, *args)


class _ManualTimer:
    __slots__ = ("args", "at_s", "cancelled", "fn")

    def __init__(self, at_s: float, fn: Callable[..., Any], args: tuple) -> None:
        self.at_s = at_s
        self.fn = fn
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that moves only when told: ``advance(dt_s)`` / ``advance_to(t_s)``.

    ``wall()`` is ``wall_offset_s + now()``. Callbacks scheduled for a time <= the new time run
    in (time, scheduling order), each seeing ``now()`` equal to its own due time.
    """

    def __init__(self, start_s: float = 0.0, wall_offset_s: float = 1_700_000_000.0) -> None:
        self._now = start_s
        self.wall_offset_s = wall_offset_s
        self._heap: list[tuple[float, int, _ManualTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def __call__(self) -> float:
        """``now()``, so the clock can stand in for a ``Callable[[], float]`` like ``time.monotonic``."""
        return self._now

    def wall(self) -> float:
        return self.wall_offset_s + self._now

    def call_at(self, at_s: float, fn: Callable[..., Any], *args: Any) -> _ManualTimer:
        t = _ManualTimer(at_s, fn, args)
        heapq.heappush(self._heap, (at_s, next(self._seq), t))
        return t

    def pending(self) -> int:
        """Scheduled callbacks not cancelled and not yet run."""
        return sum(1 for _, _, t in self._heap if not t.cancelled)

    def advance(self, dt_s: float) -> None:
        """Move time forward by ``dt_s`` (>= 0), running due callbacks. ValueError if negative."""
        if dt_s < 0:
            raise ValueError(f"dt_s must be >= 0, got {dt_s}")
        self.advance_to(self._now + dt_s)

    def advance_to(self, t_s: float) -> None:
        """Move time to ``t_s`` (never backwards), running due callbacks in order."""
        while self._heap and self._heap[0][0] <= t_s:
            at_s, _, t = heapq.heappop(self._heap)
            if t.cancelled:
                continue
            self._now = max(self._now, at_s)
            t.cancelled = True
            t.fn(*t.args)
        self._now = max(self._now, t_s)
