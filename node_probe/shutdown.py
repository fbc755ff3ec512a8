"""The agent's stop, one cleanup step at a time, none waited for without end.

A stop that never ends keeps a SIGTERMed agent running until it is killed. Each step (background
tasks, streams, the gRPC server, the HTTP session, the metrics endpoint) ends within its grace when
it works; grpc.aio's server stop has known hangs when a stream is cancelled while it stops
(grpc/grpc#28999), and one such step must not keep the rest from running.

Shape::

    await bounded(server.stop(0.5), "grpc server", 0.5)   # at most 0.5 + STEP_S s, then logged and left
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

__all__ = ["STEP_S", "bounded"]

log = logging.getLogger("node_probe.agent")

STEP_S = 5.0
"""How long one step is waited for beyond its grace (s; ours: each ends within its grace when it
works, in ms on loopback)."""


async def bounded(step: Awaitable[Any], what: str, grace_s: float = 0.0) -> None:
    """Await ``step`` for at most ``grace_s`` + :data:`STEP_S` seconds; a step that raises or takes
    longer is logged, naming ``what``, and left (cancelled). Raises nothing but CancelledError."""
    try:
        await asyncio.wait_for(step, grace_s + STEP_S)
    except TimeoutError:
        log.warning("stop: %s did not end within %.1f s; going on", what, grace_s + STEP_S)
    except Exception:
        log.exception("stop: %s failed", what)
