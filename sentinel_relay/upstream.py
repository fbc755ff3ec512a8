"""One upstream HTTP/1.1 exchange as an asyncio protocol: the relay's hot path.

No coroutine wakes per chunk: body pieces go from ``data_received`` straight to the consumer
callback (which runs the stream book and writes to the client). ``head`` (a future) resolves with
the reader once status and headers are in; ``done`` resolves with None when the body ended
cleanly, or with a short reason (``"reset"``, ``"framing"``) when the connection broke first;
:meth:`abort` ends it at once (a rescue). Bytes that arrive before a consumer is set are kept.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

from .http1 import HTTPFramingError, ResponseReader

__all__ = ["UpstreamExchange", "open_exchange"]


class UpstreamExchange(asyncio.Protocol):
    def __init__(self, request: bytes, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.reader = ResponseReader()
        self.head: asyncio.Future[ResponseReader] = loop.create_future()
        self.done: asyncio.Future[str | None] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self._consumer: Callable[[bytes], None] | None = None
        self._early: list[bytes] = []

    # -- protocol --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # open_exchange connects over TCP: the loop hands a stream transport (BaseTransport by signature)
        self.transport = stream = cast("asyncio.Transport", transport)
        stream.write(self.request)

    def data_received(self, data: bytes) -> None:
        try:
            pieces = self.reader.feed(data)
        except HTTPFramingError:
            self._end("framing")
            return
        if not self.head.done() and self.reader.head_done:
            self.head.set_result(self.reader)
        if pieces:
            if self._consumer is None:
                self._early.extend(pieces)
            else:
                consume = self._consumer
                for p in pieces:
                    consume(p)
        if self.reader.complete:
            self._end(None)

    def eof_received(self) -> bool:
        self._end(None if self.reader.eof() else "reset")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(None if self.reader.complete else "reset")

    # -- control ---------------------------------------------------------------------------------
    def consume(self, fn: Callable[[bytes], None]) -> None:
        """Send body pieces to ``fn`` from now on (first those that came early)."""
        self._consumer = fn
        early, self._early = self._early, []
        for p in early:
            fn(p)

    def _end(self, reason: str | None) -> None:
        if not self.head.done():
            self.head.set_exception(ConnectionResetError(reason or "closed before the response head"))
        if not self.done.done():
            self.done.set_result(reason)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self, reason: str = "abort") -> None:
        """End the exchange now (the connection is reset; Envoy cancels the upstream request)."""
        if self.transport is not None:
            self.transport.abort()
        self._end(reason)

    def pause(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()


async def open_exchange(host: str, port: int, request: bytes, timeout_s: float = 5.0) -> UpstreamExchange:
    """Connect and send ``request``. Raises OSError / TimeoutError when it cannot connect."""
    loop = asyncio.get_running_loop()
    _, proto = await asyncio.wait_for(
        loop.create_connection(lambda: UpstreamExchange(request, loop), host, port), timeout_s)
    return proto
