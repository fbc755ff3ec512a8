"""The pace of RTT pings: each stream pings every ``health.rtt.ping_interval``, and all streams of one
process together at most ``health.rtt.ping_budget`` times a second.

A ping costs the control plane a message written and one read on its event loop (tens of
microseconds of gRPC's Python layer each): at 2,000 nodes, pings every second took the process
from 0.93 to 1.27 cores, pings every 5 s to 1.06 (benchmarks/RESULTS.md). The round trip moves
weights and outlier ejection, not liveness, so a large fleet pings each node less often rather
than starve the loop that reads liveness.

Shape::

    paced_interval_s(1.0, 2000, 400.0)  # 5.0: 2,000 streams at 400 pings/s in all
    pace = PingPace.acquire(loop)       # one per event loop; this stream pings from now on
    await asyncio.sleep(pace.wait_s(rtt_cfg))  # the wait before this stream's next ping, jittered
    pace.release()                      # this stream stopped pinging
    PingPace.pinging_on(loop)           # streams pinging on that loop now (the metrics read it)
"""
from __future__ import annotations

import asyncio
import random
import weakref
from typing import ClassVar

from xds_server.config.health import RttConfig

__all__ = ["PingPace", "paced_interval_s"]

_JITTER = random.Random()  # the pings' waits (health.rtt.ping_jitter); the global generator is left alone


def paced_interval_s(interval_s: float, pinging: int, budget_per_s: float) -> float:
    """The mean wait between one stream's pings (s): ``interval_s``, stretched so that ``pinging``
    streams send at most ``budget_per_s`` pings a second together (``pinging / budget_per_s``);
    ``budget_per_s`` 0: no budget. Never shorter than ``interval_s``."""
    if budget_per_s <= 0 or pinging <= 0:
        return interval_s
    return max(interval_s, pinging / budget_per_s)


class PingPace:
    """The streams pinging on one event loop (:meth:`acquire` / :meth:`release`), and the wait each
    takes before its next ping (:meth:`wait_s`). One per loop: a process's probe sessions share it
    (the main process and each probe worker have their own)."""

    # one pace per loop, shared by every pinging stream on it: a class-level registry on purpose
    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PingPace]] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.pinging = 0

    @classmethod
    def acquire(cls, loop: asyncio.AbstractEventLoop) -> PingPace:
        """The loop's pace, counting one more pinging stream."""
        pace = cls._by_loop.get(loop)
        if pace is None:
            pace = cls._by_loop[loop] = cls()
        pace.pinging += 1
        return pace

    @classmethod
    def pinging_on(cls, loop: asyncio.AbstractEventLoop) -> int:
        """Streams pinging on ``loop`` now (0 when none has yet)."""
        pace = cls._by_loop.get(loop)
        return pace.pinging if pace is not None else 0

    def release(self) -> None:
        """One pinging stream less."""
        self.pinging = max(0, self.pinging - 1)

    def interval_s(self, rtt: RttConfig) -> float:
        """The mean wait between one stream's pings now (s): :func:`paced_interval_s`."""
        return paced_interval_s(rtt.ping_interval.s, self.pinging, rtt.ping_budget)

    def wait_s(self, rtt: RttConfig) -> float:
        """The wait before a stream's next ping (s): :meth:`interval_s` x a random factor in
        [1 - ``rtt.ping_jitter``, 1 + ``rtt.ping_jitter``]."""
        return self.interval_s(rtt) * _JITTER.uniform(1.0 - rtt.ping_jitter, 1.0 + rtt.ping_jitter)
