"""The relay's connection layer: every client connection is bounded before a request reaches
:class:`~sentinel_relay.server.Relay`.

:class:`BoundedServer` is aiohttp's low-level ``Server`` whose connections (:class:`_Conn`):

- must deliver a whole request head within ``header_timeout_s`` of its first byte (of the
  connection, for the first request), else the connection is closed (a slowloris holds a
  connection for that long at most);
- must deliver the request body within ``body_timeout_s`` of the head, else 408 and closed;
- are closed after ``keepalive_timeout_s`` idle between requests (aiohttp's keep-alive timer);
- number at most ``max_connections`` (RelayConfig.connection_cap()): one more evicts the
  connection idle longest (between requests, or still sending its head), or, when every
  connection has a request in flight, is answered 503 and closed.

A client that goes away mid-body is one rate-limited log line, never a traceback. Counters
(``sentinel_relay_connections``, ``sentinel_relay_connections_closed_total{reason}``) are
registered on the relay's registry.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xds_server.process.untrusted import RateLimitedLog

from .config import RelayConfig

__all__ = ["CLOSE_REASONS", "BoundedServer", "ConnectionBook", "bounded_runner"]

log = logging.getLogger("sentinel_relay")

#: Why the relay closed a client connection (``sentinel_relay_connections_closed_total`` label).
CLOSE_REASONS = ("header_timeout", "body_timeout", "evicted", "refused", "client_gone")

_BUSY_503 = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
             b"Retry-After: 1\r\nContent-Length: 62\r\n\r\n"
             b'{"error":{"message":"relay at its connection cap","code":503}}')
assert len(_BUSY_503.rpartition(b"\r\n\r\n")[2]) == 62


class ConnectionBook:
    """The open connections: idle ones (between requests or sending a head) oldest first, busy
    ones (a request in flight); the cap and the counters."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.idle: collections.OrderedDict[_Conn, None] = collections.OrderedDict()
        self.busy: set[_Conn] = set()
        self.closed: collections.Counter[str] = collections.Counter()
        self.rl = RateLimitedLog(log, 10.0, max_keys=16)

    def __len__(self) -> int:
        return len(self.idle) + len(self.busy)

    def admit(self, conn: _Conn) -> bool:
        """Room for ``conn``: evict the oldest idle connection at the cap; False when all are busy."""
        if len(self) >= self.cap:
            if not self.idle:
                self.note("refused", "connection refused: %d connections open, each with a request "
                          "in flight (max_connections)", self.cap)
                return False
            victim, _ = self.idle.popitem(last=False)
            self.note("evicted", "idle connection closed for a new one: %d open (max_connections)", self.cap)
            victim.force_close()
        self.idle[conn] = None
        return True

    def set_busy(self, conn: _Conn, busy: bool) -> None:
        if busy:
            self.idle.pop(conn, None)
            self.busy.add(conn)
        elif conn in self.busy:
            self.busy.discard(conn)
            self.idle[conn] = None

    def forget(self, conn: _Conn) -> None:
        self.idle.pop(conn, None)
        self.busy.discard(conn)

    def note(self, reason: str, msg: str, *args: object) -> None:
        """Count a close by ``reason``; log at most one line per reason per 10 s."""
        self.closed[reason] += 1
        self.rl.warning(time.monotonic(), reason, "relay: " + msg, *args)

    def collect(self) -> Iterator[Any]:
        g = GaugeMetricFamily("sentinel_relay_connections", "client connections open")
        g.add_metric([], len(self))
        yield g
        c = CounterMetricFamily("sentinel_relay_connections_closed", "client connections the relay closed or "
                                "refused, by reason (header_timeout, body_timeout, evicted: idle one closed "
                                "at max_connections, refused: 503 at max_connections, client_gone: it left "
                                "mid-body)", labels=["reason"])
        for r in CLOSE_REASONS:
            c.add_metric([r], self.closed[r])
        yield c


class _Conn(RequestHandler):
    """One client connection with a head deadline (see the module docstring)."""

    def __init__(self, manager: Server, *, book: ConnectionBook, header_timeout_s: float, **kw: Any) -> None:
        super().__init__(manager, **kw)
        self._book = book
        self._header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_request = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self._book.admit(self):
            tr = self.transport
            if tr is not None:
                tr.write(_BUSY_503)
            self.force_close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._in_request and self._head_timer is None:
            self._arm()  # the first byte of a head on a kept-alive connection
        super().data_received(data)

    def _arm(self) -> None:
        self._head_timer = self._loop.call_later(self._header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if not self._in_request and self.transport is not None:
            self._book.forget(self)
            self._book.note("header_timeout", "connection closed: no whole request head within %.1f s "
                            "(header_timeout_s)", self._header_timeout_s)
            self.force_close()

    async def _handle_request(self, request: web.BaseRequest, start_time: float | None,
                              request_handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
                              ) -> tuple[web.StreamResponse, bool]:
        self._in_request = True
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._book.set_busy(self, True)
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            self._in_request = False
            self._book.set_busy(self, False)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._book.forget(self)
        super().connection_lost(exc)


def bounded_runner(handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]], cfg: RelayConfig,
                   registry: CollectorRegistry) -> web.ServerRunner:
    """The relay's runner: a :class:`BoundedServer` over ``handler``, no access log (the relay
    logs what matters itself), no signal handlers (the CLI's)."""
    return web.ServerRunner(BoundedServer(handler, cfg, registry, access_log=None), handle_signals=False)


class BoundedServer(Server):
    """aiohttp's ``Server`` over ``handler`` with the bounds of ``cfg``; the request body is read
    (within ``body_timeout_s``) before ``handler`` runs, so its ``request.read()`` is at once.
    Counters go to ``registry``."""

    def __init__(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]], cfg: RelayConfig,
                 registry: CollectorRegistry, **kwargs: Any) -> None:
        self.book = ConnectionBook(cfg.connection_cap())
        self._cfg = cfg
        self._inner = handler
        registry.register(self.book)
        super().__init__(self._bounded, keepalive_timeout=cfg.keepalive_timeout_s, **kwargs)

    def __call__(self) -> RequestHandler:
        return _Conn(self, loop=self._loop, book=self.book, header_timeout_s=self._cfg.header_timeout_s,
                     **self._kwargs)

    async def _bounded(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            async with asyncio.timeout(self._cfg.body_timeout_s):
                await request.read()  # kept by aiohttp: the handler's read returns it
        except TimeoutError:
            self.book.note("body_timeout", "connection closed: request body not whole within %.1f s "
                           "(body_timeout_s)", self._cfg.body_timeout_s)
            return await _closing(request, web.json_response(
                {"error": {"message": f"request body not received within {self._cfg.body_timeout_s:g} s",
                           "code": 408}}, status=408))
        except ConnectionError as e:
            self.book.note("client_gone", "client went away mid-body (%s)", type(e).__name__)
            return web.Response(status=499)
        except HttpProcessingError as e:
            self.book.note("client_gone", "request body malformed or cut (%s)", type(e).__name__)
            return await _closing(request, web.json_response(
                {"error": {"message": "request body malformed or incomplete", "code": 400}}, status=400))
        return await self._inner(request)


async def _closing(request: web.BaseRequest, resp: web.Response) -> web.Response:
    """Send ``resp``, then close the connection at once (the rest of the body is never read;
    aiohttp would otherwise linger reading it for 10 s)."""
    resp.force_close()
    with contextlib.suppress(ConnectionError):
        await resp.prepare(request)
        await resp.write_eof()
    proto = request.protocol
    if isinstance(proto, RequestHandler):
        proto.force_close()
    return resp
