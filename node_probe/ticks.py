"""Fixed-rate ticks on the event loop's clock, for the agent's periodic loops."""

from __future__ import annotations

import asyncio

__all__ = ["sleep_until_tick"]


async def sleep_until_tick(loop: asyncio.AbstractEventLoop, next_t: float, period: float) -> float:
    """Sleep until ``next_t`` (``loop.time()`` seconds) on a fixed-rate grid of ``period``
    seconds; when more than one period late (the process was stalled), skip the missed ticks
    instead of firing them in a burst. Returns the tick slept to."""
    now = loop.time()
    if now - next_t > period:
        next_t += ((now - next_t) // period) * period
    await asyncio.sleep(max(0.0, next_t - now))
    return next_t
