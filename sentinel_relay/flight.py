"""The relay's handle on one armed stream in flight (:class:`StreamCtx`): its upstream exchange,
the node it runs on, its client's transport and the timers the watchdog reads (monotonic s).
Writes to the client go straight to the transport (chunked framing as aiohttp set it up)."""
from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from .upstream import UpstreamExchange

__all__ = ["HIGH_WATER", "LOW_WATER", "StreamCtx"]

HIGH_WATER, LOW_WATER = 1 << 20, 256 << 10  # client write buffer: pause / resume upstream (bytes)


class StreamCtx:
    """One armed stream in flight (the shell's handle on it)."""

    __slots__ = (
        "chunked",
        "client",
        "client_gone",
        "fault_tx",
        "first_chunk",
        "kill_reason",
        "last_rx",
        "last_tx",
        "node",
        "paused",
        "rescuing",
        "transport",
        "up",
    )

    def __init__(self, now: float) -> None:
        self.up: UpstreamExchange | None = None
        self.node: str | None = None
        self.last_rx = now
        self.last_tx = now
        self.rescuing = False
        self.fault_tx = now
        self.kill_reason: str | None = None
        self.client: web.StreamResponse | None = None
        self.transport: asyncio.Transport | None = None
        self.chunked = False
        self.first_chunk = False
        self.client_gone = False
        self.paused = False

    def bind_client(self, client: web.StreamResponse, transport: Any) -> None:
        self.client, self.transport = client, transport
        w = client._payload_writer
        self.chunked = bool(getattr(w, "chunked", False))

    def send(self, data: bytes) -> None:
        """Write to the client now (chunked framing as aiohttp set up); flags a gone client and
        pauses the upstream while the client's buffer is over 1 MiB (the watchdog resumes it)."""
        tr = self.transport
        if tr is None or tr.is_closing():
            self.client_gone = True
            return
        tr.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        if tr.get_write_buffer_size() > HIGH_WATER and self.up is not None:
            self.up.pause()
            self.paused = True

    def kill(self, reason: str) -> None:
        if self.kill_reason is None and self.up is not None:
            self.kill_reason = reason
            self.up.abort(reason)
