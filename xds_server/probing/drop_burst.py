"""Dropped agent streams that are ours, not the nodes': many at once. The rule is pure (times are
arguments, s on the event loop's clock); :class:`DropWatch` keeps its state, one per event loop.

A dial-in stream whose transport ends under us (a keepalive PING unanswered within
``probe.dial_in.ping_timeout``, a connection reset) is a node's whole miss threshold at once. When
our own process is starved (CPU burners, a noisy neighbour), gRPC's threads may read the PING
ACKs late and drop the connections of live agents, several within milliseconds of each other
(measured: 3 of 6 runs at 500 connections on a loaded host). So a drop is judged after a short
wait (``probe.dial_in.drop_confirm``):

- the agent dialled again meanwhile: it is alive, the drop was the transport's (no verdict);
- at least ``max(burst_min, burst_share x open streams)`` streams dropped within
  ``burst_window`` of it (before or during the wait): ours, judged as a plain stream end (one
  miss, counted and said), the node's next heartbeat clearing it;
- else the node's transport died: the whole miss threshold.

A burst judged ours holds the nodes not heard since for ``probe.stalls.stall_hold``; a starved
control plane may take far longer than that to take their agents' new streams (measured: 407
streams cut by a 5 s stop, all back 4.9 s later; 2,000 agents on two loaded cores, 30-90 s to
dial in). While agents keep dialling in (at least ``burst_min`` within a hold,
:func:`returns_hold`), back after a lost stream or for the first time (a fleet still dialling a
started control plane), each holds them again: an agent that came in was taken, and the ones still
queued behind it are most likely alive. Such a hold rests on the stretch of verdicts of ours
before it and never renews its bound (:func:`extended`). Evidence that rests on earlier verdicts of ours
(returns; a drop found within a hold after a stall noted for a burst) counts for at most
``probe.dial_in.burst_recovery`` after the stretch of such verdicts began (:func:`chain_holds`):
verdicts that hold each other up cannot hold a dead node for ever.

The same threshold judges a stream found silent (open, no heartbeat for ``silent_after_s``): one
alone is the agent's (its own loop hung), one silent while many others have missed their refresh
too is ours: a control plane starved of CPU reads every stream late, and the heartbeats wait
unread in gRPC's queues (measured: 1,000 agents, two CPU burners on the control plane's core for
10 s: 979 streams ended as silent, 989 healthy nodes ejected). :func:`silent_with` counts the
open streams (:attr:`DropWatch.serving`) that heard nothing for one and a half refreshes, at once:
no wait for their own timers, which a starved loop runs late.

Shape::

    d = Drops()
    d = dropped(d, now_s, keep_s=1.0)                     # one transport drop at now_s
    is_burst(d, at_s, window_s=0.2, streams=300, min_drops=3, share=0.1)   # bool
    silent_with(now_s - 1.5, (s.last_heard() for s in w.serving))          # streams past a refresh
    st = stretched(st, now_s, gap_s=1.17)   # a verdict of ours at now_s, in the stretch before it or a new one
    chain_holds(st, now_s, gap_s=1.17, horizon_s=30.0)   # a drop after a stall noted for one still ours?
    returns_hold(returns, now_s, window_s=1.0, min_returns=3, st=st, horizon_s=30.0)  # hold again
    burst_size(streams=300, min_drops=3, share=0.1)                          # 30: what makes a burst
"""
from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, Protocol

__all__ = ["DropWatch", "Drops", "Heard", "Stretch", "burst_size", "chain_holds", "dropped", "extended", "is_burst",
           "returns_hold", "silent_with", "stretched"]


class Heard(Protocol):
    """An open stream, as the silence rule reads it."""

    def last_heard(self) -> float | None:
        """Its last heartbeat's arrival (or its opening), loop s; None when not serving one."""
        ...


@dataclass(frozen=True, slots=True)
class Drops:
    """Recent transport drops: their times (s, ascending)."""

    times: tuple[float, ...] = ()


def dropped(d: Drops, now_s: float, keep_s: float) -> Drops:
    """``d`` with a drop at ``now_s``, the drops older than ``keep_s`` forgotten."""
    return Drops(tuple(t for t in d.times if t >= now_s - keep_s) + (now_s,))


def burst_size(streams: int, min_drops: int, share: float) -> int:
    """How many make a burst among ``streams`` open: at least ``min_drops`` and ``share`` of them
    (rounded up)."""
    return max(min_drops, math.ceil(share * streams))


def is_burst(d: Drops, at_s: float, window_s: float, streams: int, min_drops: int, share: float) -> bool:
    """Whether the drop at ``at_s`` is one of a burst: drops within ``window_s`` of it (either
    side, itself included) number at least :func:`burst_size` of the ``streams`` that were open."""
    n = sum(1 for t in d.times if abs(t - at_s) <= window_s)
    return n >= burst_size(streams, min_drops, share)


@dataclass(frozen=True, slots=True)
class Stretch:
    """Verdicts of ours (bursts, drops after a stall of ours, returns that held the rest again),
    each within a gap of the one before: the first's time and the latest's (loop s)."""

    since_s: float
    last_s: float


def stretched(st: Stretch | None, at_s: float, gap_s: float) -> Stretch:
    """``st`` with a verdict of ours at ``at_s``: the same stretch when its latest came at most
    ``gap_s`` before, else a new one from ``at_s``."""
    if st is not None and at_s - st.last_s <= gap_s:
        return Stretch(st.since_s, at_s)
    return Stretch(at_s, at_s)


def extended(st: Stretch, at_s: float) -> Stretch:
    """``st`` with a verdict at ``at_s`` that rests on it (agents dialling in that held the rest
    again): its latest moves to ``at_s``, its start stays, so such verdicts never renew the bound
    (``burst_recovery``) of the stretch they rest on, however far apart they come."""
    return Stretch(st.since_s, max(st.last_s, at_s))


def chain_holds(st: Stretch | None, at_s: float, gap_s: float, horizon_s: float) -> bool:
    """Whether evidence that rests on an earlier verdict of ours (a drop within a hold after a
    stall noted for a burst) still counts at ``at_s``: a stretch of such verdicts is running (its
    latest within ``gap_s``) and began at most ``horizon_s`` ago. None running: no noted stall to
    rest on (the loop's own stalls are judged apart, by how long its thread did not run). So
    verdicts that hold each other up end ``horizon_s`` after they began."""
    return st is not None and at_s - st.last_s <= gap_s and at_s - st.since_s <= horizon_s


def returns_hold(returns: Drops, at_s: float, window_s: float, min_returns: int, st: Stretch | None,
                 horizon_s: float) -> bool:
    """Whether agents dialling in (``returns``: when agents dialled again after their streams were
    lost under us, or for the first time, one per agent within ``window_s``, the one at ``at_s``
    included) prove a stretch of ours still going at ``at_s``: ``st`` (None: never one) began no
    more than ``horizon_s`` ago, and at least ``min_returns`` agents came in within ``window_s`` up
    to ``at_s``. One agent that keeps dropping and dialling again is not enough; a fleet dialling
    (back) into a starved control plane is."""
    if st is None or at_s - st.since_s > horizon_s:
        return False
    return sum(1 for t in returns.times if at_s - window_s <= t <= at_s) >= min_returns


def silent_with(before_s: float, last_heard: Iterable[float | None]) -> int:
    """How many open streams (``last_heard``: each one's last heartbeat, None: not serving) have
    heard nothing since ``before_s`` (the caller's: now less one and a half telemetry refreshes,
    which a stream read in time never is)."""
    return sum(1 for t in last_heard if t is not None and t <= before_s)


class DropWatch:
    """The drops and open dial-in streams of one event loop (:meth:`of`; ``serving``: their
    sessions), the agents' returns and the stretch of verdicts of ours. What was judged is counted
    in :class:`~xds_server.process.counters.Counters` (``transport_drops``, ``silent_streams``)."""

    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DropWatch]] = (
        weakref.WeakKeyDictionary())

    def __init__(self) -> None:
        self.drops = Drops()
        self.returns = Drops()  # when agents dialled in (back after a lost stream, or for the first time)
        self.stretch: Stretch | None = None  # the verdicts of ours (bursts, drops after our stalls) lately
        self.serving: set[Heard] = set()  # the sessions serving a stream now

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> DropWatch:
        w = cls._by_loop.get(loop)
        if w is None:
            w = cls._by_loop[loop] = cls()
        return w

    @property
    def open(self) -> int:
        """Dial-in streams being served now."""
        return len(self.serving)

    def ours(self, now_s: float, gap_s: float) -> None:
        """A verdict of ours at ``now_s`` (a burst of drops or silences, a drop after a stall of
        ours): :func:`stretched`."""
        self.stretch = stretched(self.stretch, now_s, gap_s)

    def held_again(self, now_s: float) -> None:
        """Agents dialling in held the rest again at ``now_s`` (:func:`returns_hold`): the
        stretch they rest on goes on from its own start (:func:`extended`)."""
        if self.stretch is not None:
            self.stretch = extended(self.stretch, now_s)

    def dropped(self, now_s: float, keep_s: float) -> int:
        """Record a drop at ``now_s``; returns the streams open just before it."""
        self.drops = dropped(self.drops, now_s, keep_s)
        return self.open + 1
