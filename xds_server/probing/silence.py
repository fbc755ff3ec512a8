"""When a probe session may judge its node's silence: not while that silence is our own.

The rule is pure (:mod:`xds_server.probing.stall_hold`); this module is its edge on the event loop:

- :class:`LoopStallWatch` samples the event loop every ``probe.stalls.loop_watch_interval`` (one
  sampler per loop, shared by every session on it, running while a session holds it) and keeps
  the loop's :class:`~xds_server.probing.stall_hold.StallHistory`;
- :class:`SilenceGate`, one per session, asks it whether a verdict on the node's silence (a Tick
  counting misses, a stream found closed, a stream silent for ``probe.channel.silent_stream_redial``)
  must wait for the end of a hold after our own stall, and keeps a stream close found during one.

Shape::

    gate = SilenceGate(health_cfg, probe_cfg)
    gate.start(loop)                    # holds the loop's watch; gate.stop() releases it
    gate.until(now_s, heard_s)          # None: judge now; else the loop time (s) to judge at
    gate.due(now_s, heard_s)            # the detection timer is due: a hold's end, or Tick / StreamClosed
    gate.closed(now_s, detail, heard_s)  # the stream ended: a hold's end (kept), or StreamClosed
    gate.lost(detail)                   # ... its transport lost, already judged the node's: StreamClosed
    gate.measured_us(sent_s, now_s, 0.02)  # a ping's round trip spans our stall or queue: no RTT sample
    gate.stalled_since(since_s, now_s, 0.08)  # we stalled 80 ms or more since then
    gate.unscheduled_since(since_s, now_s, 0.08)  # ... with our thread not running at all
    await gate.silent_for(loop, silent_s, ...)    # returns once the open stream is silent
"""
from __future__ import annotations

import asyncio
import collections
import time
import weakref
from collections.abc import Callable
from typing import ClassVar

from xds_server.config import HealthConfig, ProbeConfig
from xds_server.health.clocks import miss_after_s
from xds_server.health.records import StreamClosed, Tick
from xds_server.probing.stall_hold import (
    StallHistory,
    held_until,
    late_between,
    noted,
    overdue_s,
    ran,
    stalled_between,
    unscheduled_s,
)
from xds_server.probing.timers import recheck_after_s

__all__ = ["LoopStallWatch", "SilenceGate", "SilentStream"]

_KEEP_S = 60.0
"""Stalls are remembered this long (s): the largest ``probe.stalls.stall_hold`` allowed."""
_EARLY_S = 1e-6
"""A hold ending within this (s) of now counts as ended (a timer may run a clock tick early)."""
_LATE_S = 0.002
_LATE_RUNS = 256
"""Sampler runs at least ``_LATE_S`` late (s) are kept for :meth:`SilenceGate.measured_us`, the last
``_LATE_RUNS`` of them (>= 12 s at the 50 ms default period; a round trip needs one period before it)."""


class SilentStream(Exception):
    """The stream stayed open without a heartbeat for ``probe.channel.silent_stream_redial``."""


class LoopStallWatch:
    """Samples one event loop every ``period_s`` and records its stalls (:attr:`history`), its late
    runs (:attr:`late_runs`: (woke, late) s) and the part of each lateness in which the loop's
    thread did not run at all (:attr:`unscheduled_runs`: (woke, s), its CPU time read each run).

    One per loop (:meth:`acquire`), sampling while at least one holder has not called
    :meth:`release`. Stalls shorter than ``period_s`` are not recorded.
    """

    # one watch per loop, shared by every holder: a class-level registry on purpose
    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopStallWatch]] = (
        weakref.WeakKeyDictionary())

    def __init__(self, loop: asyncio.AbstractEventLoop, period_s: float) -> None:
        self.loop = loop
        self.period_s = period_s
        self.history = StallHistory(alive_s=loop.time())
        self.late_runs: collections.deque[tuple[float, float]] = collections.deque(maxlen=_LATE_RUNS)  # (woke, late)
        self.unscheduled_runs: collections.deque[tuple[float, float]] = collections.deque(maxlen=_LATE_RUNS)
        self.cpu_s = time.thread_time()  # the loop thread's CPU time at the sampler's last run
        self._holders = 0
        self._handle: asyncio.TimerHandle | None = None

    @classmethod
    def acquire(cls, loop: asyncio.AbstractEventLoop, period_s: float) -> LoopStallWatch:
        """The loop's watch (created with ``period_s`` if it has none), sampling from now on."""
        w = cls._by_loop.get(loop)
        if w is None:
            w = cls._by_loop[loop] = cls(loop, period_s)
        w._holders += 1
        if w._handle is None:
            w.history = StallHistory(loop.time(), w.history.stalls, w.history.count)
            w.cpu_s = time.thread_time()
            w._handle = loop.call_later(w.period_s, w._run)
        return w

    def release(self) -> None:
        """One holder less; the last one stops the sampling."""
        self._holders = max(0, self._holders - 1)
        if self._holders == 0 and self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _run(self) -> None:
        now, cpu = self.loop.time(), time.thread_time()
        late = overdue_s(self.history, now, self.period_s)
        if late >= _LATE_S:
            self.late_runs.append((now, late))
            off = unscheduled_s(late, cpu - self.cpu_s)
            if off >= _LATE_S:
                self.unscheduled_runs.append((now, off))
        self.cpu_s = cpu
        self.history = ran(self.history, now, self.period_s, self.period_s, _KEEP_S)
        self._handle = self.loop.call_later(self.period_s, self._run)

    def ours(self, now_s: float, gap_s: float) -> None:
        """Record a stall of ours the sampler cannot see (:func:`~xds_server.probing.stall_hold.noted`)."""
        self.history = noted(self.history, now_s, gap_s, _KEEP_S)

    @property
    def stalls(self) -> int:
        """Stalls recorded on this loop so far."""
        return self.history.count


class SilenceGate:
    """One probe session's gate on silence verdicts (see the module docstring). ``stall_s``: one
    heartbeat miss window (``health``: interval + grace), ``hold_s``: ``probe.stalls.stall_hold``.
    ``pending_close``: (detail, loop s) of a stream close found during a hold, to report at its end."""

    __slots__ = ("_watch", "held", "hold_s", "pending_close", "period_s", "stall_s")

    def __init__(self, cfg: HealthConfig, probe: ProbeConfig) -> None:
        self.stall_s = miss_after_s(cfg)
        self.hold_s = probe.stalls.stall_hold.s
        self.period_s = probe.stalls.loop_watch_interval.s
        self.pending_close: tuple[str, float] | None = None
        self.held = 0  # verdicts put off by a hold
        self._watch: LoopStallWatch | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._watch is None:
            self._watch = LoopStallWatch.acquire(loop, self.period_s)

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.release()
            self._watch = None

    def ours(self, now_s: float) -> None:
        """A burst of agent streams dropped or silent at once was judged ours at ``now_s``: every
        node not heard since is held as after a stall of ``hold_s`` (its agent dials again meanwhile)."""
        if self._watch is not None:
            self._watch.ours(now_s, self.hold_s)

    def until(self, now_s: float, heard_s: float | None) -> float | None:
        """None: a verdict on the node's silence may be made at ``now_s``; else the loop time (s)
        the hold after our own stall ends. ``heard_s``: the arrival of the node's last heartbeat on
        its current stream (None: none)."""
        w = self._watch
        if w is None:
            return None
        at = held_until(w.history, now_s, w.period_s, self.stall_s, self.hold_s, heard_s)
        if at is None or at - now_s <= _EARLY_S:
            return None
        self.held += 1
        return at

    def measured_us(self, since_s: float, now_s: float, max_lag_s: float) -> bool:
        """Whether a ping's round trip from ``since_s`` to ``now_s`` (loop times, s) measured us,
        not the network: our loop stalled in it (:func:`~xds_server.probing.stall_hold.stalled_between`),
        or ran ``max_lag_s`` late or more around it, a queue of our own
        (:func:`~xds_server.probing.stall_hold.late_between`; ``max_lag_s`` >= ``_LATE_S``)."""
        w = self._watch
        return w is not None and (stalled_between(w.history, since_s, now_s, w.period_s) or late_between(
            w.late_runs, overdue_s(w.history, now_s, w.period_s), since_s, now_s, w.period_s, max_lag_s))

    def stalled_since(self, since_s: float, now_s: float, min_gap_s: float) -> bool:
        """Whether our loop stalled at least ``min_gap_s`` and woke after ``since_s`` (loop s; the
        stall we are waking from at ``now_s`` included, and those noted for a burst of ours)."""
        w = self._watch
        return w is not None and stalled_between(w.history, since_s, now_s, w.period_s, min_gap_s)

    def unscheduled_since(self, since_s: float, now_s: float, min_gap_s: float) -> bool:
        """Whether our loop's thread did not run at all for at least ``min_gap_s`` around a late
        sampler run that woke after ``since_s`` (loop s), or in the run due by ``now_s`` and still
        pending (:func:`~xds_server.probing.stall_hold.unscheduled_s`): our process stopped or
        starved, not busy with its own work."""
        w = self._watch
        if w is None:
            return False
        pending = unscheduled_s(overdue_s(w.history, now_s, w.period_s), time.thread_time() - w.cpu_s)
        return late_between(w.unscheduled_runs, pending, since_s, now_s, w.period_s, min_gap_s)

    def due(self, now_s: float, heard_s: float | None) -> float | Tick | StreamClosed:
        """The session's detection timer is due at ``now_s``: the end of a running hold (a loop
        time, s: re-arm there), else the observation to emit: the stream close kept during the
        hold (dropped when the node was heard since, on a new stream), or a Tick."""
        held = self.until(now_s, heard_s)
        if held is not None:
            return held
        close, self.pending_close = self.pending_close, None
        if close is not None and (heard_s is None or heard_s <= close[1]):
            return StreamClosed(close[0])
        return Tick()

    def closed(self, now_s: float, detail: str, heard_s: float | None, lost: bool = False) -> float | StreamClosed:
        """The stream ended at ``now_s`` (``detail``: why; ``heard_s``: its last heartbeat's
        arrival; ``lost``: its transport's liveness failed): the StreamClosed to emit now (the whole
        miss threshold when ``lost``), or the end of a running hold (a loop time, s), when
        :meth:`due` gives back a plain close unless the node was heard again by then."""
        held = self.until(now_s, heard_s)
        self.pending_close = (detail, now_s) if held is not None else None
        return held if held is not None else StreamClosed(detail, liveness_lost=lost)

    def lost(self, detail: str) -> StreamClosed:
        """The stream's transport was lost and that was already judged the node's, our own stalls
        weighed (a dial-in drop): the StreamClosed to emit now (the whole miss threshold); a close
        kept from before is dropped."""
        self.pending_close = None
        return StreamClosed(detail, liveness_lost=True)

    async def silent_for(self, loop: asyncio.AbstractEventLoop, silent_s: float, last_hb: Callable[[], float],
                         heard: Callable[[], float | None], lag_tolerance_s: float, lag_recheck_s: float) -> None:
        """Return once the open stream brought no heartbeat for ``silent_s`` (``last_hb()``: its last
        heartbeat's arrival, or its opening; ``heard()``: as ``heard_s`` in :meth:`until`), judged on
        our clock: woken late by ``lag_tolerance_s`` or more, only after the re-check
        (:func:`~xds_server.probing.timers.recheck_after_s`) has let the heartbeats that waited unread
        be read, and never during a hold after our own stall."""
        while True:
            due = max(loop.time() + 0.005, last_hb() + silent_s)
            await asyncio.sleep(due - loop.time())
            late_s = loop.time() - due
            if late_s > lag_tolerance_s:
                await asyncio.sleep(recheck_after_s(late_s, lag_recheck_s, self.stall_s))
            held = self.until(loop.time(), heard())
            if held is not None:
                await asyncio.sleep(held - loop.time())
            elif loop.time() - last_hb() >= silent_s:
                return
