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

The same rule judges streams that fell silent (open, no heartbeat for ``silent_after_s``): one
alone is the agent's (its own loop hung), many at once are ours: a control plane starved of CPU
reads every stream late, and the heartbeats wait unread in gRPC's queues (measured: 1,000 agents,
two CPU burners on the control plane's core for 10 s: 979 streams ended as silent, 989 healthy
nodes ejected). :meth:`DropWatch.fell_silent` keeps them apart from the drops, one per node and by when its
silence began (its last heartbeat): a node still silent when the rest are heard again was silent
with them, and a stream looked at again never makes a burst of itself.

Shape::

    d = Drops()
    d = dropped(d, now_s, keep_s=1.0)                     # one transport drop at now_s
    is_burst(d, at_s, window_s=0.2, streams=300, min_drops=3, share=0.1)   # bool
"""
from __future__ import annotations

import asyncio
import math
import weakref
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["SILENCE_KEEP_S", "DropWatch", "Drops", "dropped", "is_burst"]

SILENCE_KEEP_S = 60.0
"""A silence is remembered this long after it began (s): a starvation of ours as long keeps the
nodes silent through it judged with the burst they fell silent in (ours)."""


@dataclass(frozen=True, slots=True)
class Drops:
    """Recent transport drops: their times (s, ascending)."""

    times: tuple[float, ...] = ()


def dropped(d: Drops, now_s: float, keep_s: float) -> Drops:
    """``d`` with a drop at ``now_s``, the drops older than ``keep_s`` forgotten."""
    return Drops(tuple(t for t in d.times if t >= now_s - keep_s) + (now_s,))


def is_burst(d: Drops, at_s: float, window_s: float, streams: int, min_drops: int, share: float) -> bool:
    """Whether the drop at ``at_s`` is one of a burst: drops within ``window_s`` of it (either
    side, itself included) number at least ``min_drops`` and ``share`` of the ``streams`` that
    were open (rounded up)."""
    n = sum(1 for t in d.times if abs(t - at_s) <= window_s)
    return n >= max(min_drops, math.ceil(share * streams))


class DropWatch:
    """The drops, silences and open dial-in streams of one event loop (:meth:`of`). ``bursts``:
    drops judged ours so far; ``redialled``: drops after which the agent dialled again in time."""

    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DropWatch]] = (
        weakref.WeakKeyDictionary())

    def __init__(self) -> None:
        self.drops = Drops()
        self._silent_at: dict[str, float] = {}  # node -> when its stream was last found silent
        self.open = 0
        self.bursts = 0
        self.redialled = 0

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> DropWatch:
        w = cls._by_loop.get(loop)
        if w is None:
            w = cls._by_loop[loop] = cls()
        return w

    def dropped(self, now_s: float, keep_s: float) -> int:
        """Record a drop at ``now_s``; returns the streams open just before it."""
        self.drops = dropped(self.drops, now_s, keep_s)
        return self.open + 1

    def fell_silent(self, node_id: str, since_s: float, now_s: float) -> int:
        """Record that ``node_id``'s stream has been silent since ``since_s`` (its last heartbeat):
        a node counts once, by when its silence began; silences begun more than
        :data:`SILENCE_KEEP_S` before ``now_s`` are forgotten. Returns the streams open now."""
        self._silent_at[node_id] = since_s
        for k in [k for k, t in self._silent_at.items() if t < now_s - SILENCE_KEEP_S]:
            del self._silent_at[k]
        return self.open

    @property
    def silences(self) -> Drops:
        """When the recorded silences began, one per node (:func:`is_burst` judges them as drops)."""
        return Drops(tuple(sorted(self._silent_at.values())))
