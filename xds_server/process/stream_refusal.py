"""Ending a refused gRPC stream so that the client reads the refusal's status.

A server that ends a stream while the client is still writing sends its trailers (the status)
and then ``RST_STREAM``; a grpcio asyncio client whose write fails after that replaces the
server's status with ``INTERNAL: Internal error from Core`` (grpc/grpc#36066, measured here on
grpcio 1.85: a client that writes 3 requests back to back got INTERNAL on 4 of 40 refused delta
xDS streams and 11 of 40 refused agent streams). Envoy reads the status either way; our own
clients (the control plane dialing agents, a replica forwarding load reports) and operators'
tools use grpcio. So a refusal first reads what the client has already sent, until it is quiet
for ``quiet_s`` (or half-closes), then ends the stream with the refusal's code: a client that
writes its requests back to back and then reads gets the refusal, not INTERNAL.

The wait is bounded (``max_s``, ``max_messages``), so a client that keeps writing is cut off
all the same; it costs a refused client at most ``max_s`` of one stream.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable
from typing import Any, NoReturn

import grpc

__all__ = ["drain", "refuse"]

QUIET_S = 0.05
"""The client is done writing when nothing arrived for this long, s (a burst of writes on
loopback arrives within a millisecond; 50 ms covers a busy machine's scheduling)."""
MAX_S = 0.5
"""The longest a refusal waits for the client to stop writing, s."""
MAX_MESSAGES = 4096
"""The most requests a refusal reads before ending the stream (a client writing 400 forged
reports back to back is read to its end in a few ms; ``max_s`` bounds it in time)."""


async def drain(requests: AsyncIterable[Any], *, quiet_s: float = QUIET_S, max_s: float = MAX_S,
                max_messages: int = MAX_MESSAGES) -> int:
    """Read and discard ``requests`` until the client is quiet for ``quiet_s``, half-closes,
    the stream fails, ``max_s`` passed or ``max_messages`` were read; returns how many were
    read. The iterator is unusable afterwards (a timed-out read closes it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_s
    it = aiter(requests)
    n = 0
    while n < max_messages:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            await asyncio.wait_for(anext(it), min(quiet_s, left))
        except (StopAsyncIteration, TimeoutError):
            break
        except asyncio.CancelledError:
            raise
        except Exception:  # the stream broke: nothing more to read
            break
        n += 1
    return n


async def refuse(context: grpc.aio.ServicerContext[Any, Any], requests: AsyncIterable[Any],
                 code: grpc.StatusCode, details: str) -> NoReturn:
    """:func:`drain` the client's requests, then end the stream with ``code`` and ``details``
    (``context.abort``: raises, as it does)."""
    await drain(requests)
    await context.abort(code, details)
    raise AssertionError("context.abort returned")  # it raises; for the type checker
