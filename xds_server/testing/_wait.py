"""Polling for tests: :func:`wait_for` a condition with a deadline."""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["wait_for"]


async def wait_for(pred: Callable[[], Any | Awaitable[Any]], timeout_s: float = 10.0, step_s: float = 0.05,
                   what: str | Callable[[], str] = "condition") -> Any:
    """Poll ``pred`` (sync or async) every ``step_s`` seconds until it returns something truthy,
    and return that value.

    Raises:
        AssertionError: not truthy within ``timeout_s`` seconds (``time.monotonic``); the message
            starts with ``what`` (a callable is called at that moment, for a fresh diagnosis).
    """
    end = time.monotonic() + timeout_s
    while True:
        v = pred()
        if inspect.isawaitable(v):
            v = await v
        if v:
            return v
        if time.monotonic() >= end:
            break
        await asyncio.sleep(step_s)
    label = what() if callable(what) else what
    raise AssertionError(f"{label}: not met within {timeout_s} s")
