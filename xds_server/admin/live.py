"""The dashboard's live feed: Server-Sent Events from the admin endpoint.

:class:`LiveFeed` samples the :class:`~xds_server.admin.views.ControlPlaneView` every
``admin.live_interval`` while at least one client listens, and hands each client a ``state``
message (every node and cluster, fail-static) and one ``event`` message per new health event.
Each message is encoded once and shared by every client's queue. Nothing here writes to the view.

Bounds (a :class:`~xds_server.process.fanout.FanOut`; settings in ``admin:``): at most
``live_max_clients`` clients (one more is answered 503); at most ``live_queue_max`` messages
queued per client; a write may take at most ``live_write_timeout_s``; the kernel holds at most
``live_send_buffer_bytes`` (SO_SNDBUF) per client and our transport ``live_write_buffer_bytes``
before a write waits. A client that falls behind
(queue full) or does not take a write in time (it stopped reading) is disconnected: its socket is
aborted at once, which frees its buffers and ends its handler; the dashboard retries (1 s doubling
to 30 s, jittered, never sooner than a 503's Retry-After) and starts again from a fresh snapshot.
``/metrics``: ``sentinel_admin_live_clients``,
``sentinel_admin_live_dropped_total{reason}`` (slow, deadline, shutdown),
``sentinel_admin_live_refused_total``.

Wire format (``GET /live``, ``text/event-stream``): ``event: state`` / ``event: event`` with one
JSON ``data:`` line each; a ``: ping`` comment every ``admin.live_ping`` keeps proxies from
closing an idle stream.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xds_server.admin.views import ControlPlaneView
from xds_server.control.events import EventRecord
from xds_server.process.cancellation import cancel_and_wait
from xds_server.process.fanout import CLOSE_REASONS, FanOut, Subscriber
from xds_server.process.untrusted import RateLimitedLog

__all__ = ["LiveFeed"]

log = logging.getLogger(__name__)

#: Events sent to a client when it connects (the newest, oldest first).
BACKLOG_EVENTS = 50
PING = b": ping\n\n"


class _Conn:
    """What the feed needs of one connected client besides its bookkeeping: a wake-up and the
    way to close its socket."""

    __slots__ = ("abort", "wake")

    def __init__(self, abort: Callable[[], None]) -> None:
        self.wake = asyncio.Event()
        self.abort = abort


class LiveFeed:
    """Fan-out of view snapshots and new events to SSE clients (see module docstring).

    ``dumps`` turns a JSON-able object into strict JSON text (the admin's ``json_dumps``). A
    prometheus_client collector too (``collect``: the clients and drops).
    """

    def __init__(self, view: ControlPlaneView, dumps: Callable[[Any], str]) -> None:
        self.view = view
        self.dumps = dumps
        a = view.config.admin
        self.book: FanOut[bytes] = FanOut(a.live_max_clients, a.live_queue_max, a.live_write_timeout.s)
        self._conns: dict[int, _Conn] = {}
        self._last_event: EventRecord | None = None
        self._state: tuple[float, bytes] | None = None  # (monotonic s, frame) of the last tick
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._rl = RateLimitedLog(log, 10.0, max_keys=8)

    @property
    def dropped_total(self) -> int:
        """Clients the feed gave up on (slow or deadline)."""
        return self.book.dropped["slow"] + self.book.dropped["deadline"]

    def _limits(self) -> None:
        """Follow a reloaded ``admin:`` section (open clients beyond a lowered cap stay)."""
        a = self.view.config.admin
        b = self.book
        b.max_subscribers, b.queue_max, b.send_timeout_s = a.live_max_clients, a.live_queue_max, a.live_write_timeout.s

    # -- what is sent ----------------------------------------------------------------------------

    def snapshot(self) -> str:
        """The ``state`` message: wall time (unix s), fail-static, clusters and nodes (as the
        ``/clusters`` and ``/nodes`` views)."""
        v = self.view
        return self.dumps({"time": time.time(), "fail_static": v.fail_static_active,
                           "clusters": v.cluster_summaries(), "nodes": v.nodes()})

    def _state_frame(self) -> bytes:
        """The last tick's ``state`` frame when younger than a tick, else a new one: a burst of
        connecting clients costs one view, not one each."""
        now = time.monotonic()
        if self._state is None or now - self._state[0] >= self.view.config.admin.live_interval.s:
            self._state = (now, _sse("state", self.snapshot()))
        return self._state[1]

    def _new_events(self) -> list[EventRecord]:
        records = self.view.event_records()
        if self._last_event is None:
            new = records
        else:
            idx = next((i for i in range(len(records) - 1, -1, -1) if records[i] is self._last_event), None)
            new = records if idx is None else records[idx + 1:]
        if records:
            self._last_event = records[-1]
        return new

    def backlog(self) -> list[str]:
        """The newest :data:`BACKLOG_EVENTS` events as ``event`` messages, oldest first."""
        return [self.dumps(r.to_json()) for r in self.view.event_records()[-BACKLOG_EVENTS:]]

    # -- fan-out -----------------------------------------------------------------------------------

    def subscribe(self, abort: Callable[[], None]) -> Subscriber[bytes] | None:
        """A new client (``abort`` closes its socket), or None past ``admin.live_max_clients``."""
        self._limits()
        was_idle = not self.book.subs
        sub = self.book.join()
        if sub is None:
            return None
        if was_idle:
            # The feed was idle (no tick ran): the backlog covers the past, only later events are
            # new. With clients connected the marker stays, so none of theirs is skipped (the new
            # client may see an event of the last interval twice: in its backlog and as new).
            self._new_events()
        self._conns[sub.sid] = _Conn(abort)
        self._wake.set()
        return sub

    def unsubscribe(self, sub: Subscriber[bytes]) -> None:
        self.book.leave(sub)
        self._conns.pop(sub.sid, None)
        if not self._conns and sub.closed in ("slow", "deadline"):
            _give_memory_back()


    def drop(self, sub: Subscriber[bytes], reason: str) -> None:
        """Give up on ``sub``: close its socket now (its pending write fails, its handler ends)."""
        if self.book.close(sub, reason) or sub.closed == reason:
            conn = self._conns.pop(sub.sid, None)
            if conn is not None:
                conn.wake.set()
                conn.abort()
            if reason != "shutdown":
                why = (f"read slower than the feed; queue of {self.book.queue_max} full" if reason == "slow"
                       else f"a write pending over {self.book.send_timeout_s:.1f} s")
                self._rl.warning(time.monotonic(), reason, "admin: live client disconnected (%s)", why)

    def tick(self) -> None:
        """Queue one snapshot and the new events for every client; disconnect those behind or
        stuck in a write."""
        self._limits()
        if not self.book.subs:
            self._new_events()
            return
        frames = [_sse("event", self.dumps(r.to_json())) for r in self._new_events()]
        self._state = (time.monotonic(), _sse("state", self.snapshot()))
        frames.append(self._state[1])
        for sub in self.book.publish(frames):
            self.drop(sub, "slow")
        for sub in self.book.overdue(time.monotonic()):
            self.drop(sub, "deadline")
        for conn in self._conns.values():
            conn.wake.set()

    async def run(self) -> None:
        """Tick every ``admin.live_interval`` while clients listen; idle otherwise."""
        while True:
            if not self.book.subs:
                self._wake.clear()
                await self._wake.wait()
            try:
                self.tick()
            except Exception:  # a view error must not end the feed for every later client
                log.exception("admin: live feed tick failed")
            await asyncio.sleep(self.view.config.admin.live_interval.s)

    async def start(self, _app: web.Application | None = None) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def close(self, _app: web.Application | None = None) -> None:
        """End every client's stream and stop the ticker."""
        for sub in list(self.book.subs.values()):
            self.book.close(sub, "shutdown")
            conn = self._conns.pop(sub.sid, None)
            if conn is not None:
                conn.wake.set()
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)

    # -- the HTTP handler --------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """``GET /live``: the SSE stream for one client (503 past ``admin.live_max_clients``)."""
        transport = request.transport
        sub = self.subscribe(transport.abort if transport is not None else (lambda: None))
        if sub is None:
            n = self.book.max_subscribers
            self._rl.warning(time.monotonic(), "refused", "admin: live client refused (%d open, the cap)", n)
            busy = web.json_response(
                {"error": f"too many live-feed clients ({n} open, admin.live_max_clients); try again later"},
                status=503, headers={"Retry-After": "5"})
            busy.force_close()  # the connection too: a refused client holds nothing here
            return busy
        conn = self._conns[sub.sid]
        sock = transport.get_extra_info("socket") if transport is not None else None
        admin = self.view.config.admin
        if sock is not None:  # what the kernel may hold for a client that stopped reading
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, admin.live_send_buffer_bytes)
        if transport is not None:  # and what we hold beyond it before a write waits
            transport.set_write_buffer_limits(high=admin.live_write_buffer_bytes)
        ping_s = self.view.config.admin.live_ping.s
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        try:
            await resp.prepare(request)
            first = b"".join(_sse("event", e) for e in self.backlog()) + self._state_frame()
            await self._write(sub, resp, first)
            while sub.closed is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(conn.wake.wait(), timeout=ping_s)
                conn.wake.clear()
                if sub.closed is not None:
                    break
                items = self.book.take(sub, time.monotonic())
                if items:
                    await self._write(sub, resp, b"".join(items), begun=True)
                else:
                    await self._write(sub, resp, PING)
        except (ConnectionResetError, TimeoutError):  # the browser went away, or stopped reading
            pass
        finally:
            self.unsubscribe(sub)
        return resp

    async def _write(self, sub: Subscriber[bytes], resp: web.StreamResponse, data: bytes, begun: bool = False) -> None:
        """Write ``data``, disconnecting ``sub`` when the write takes over ``admin.live_write_timeout``
        (raises TimeoutError then)."""
        if not begun:
            self.book.begin(sub, time.monotonic())
        try:
            async with asyncio.timeout(self.book.send_timeout_s):
                await resp.write(data)
                writer = resp._payload_writer  # aiohttp drains only past 64 KiB written; we, past the high-water mark
                if writer is not None:
                    await writer.drain()
        except TimeoutError:
            self.drop(sub, "deadline")
            raise
        self.book.sent(sub)

    # -- /metrics -----------------------------------------------------------------------------------

    def collect(self) -> Iterator[Any]:
        """``sentinel_admin_live_clients``, ``..._dropped_total{reason}``, ``..._refused_total``."""
        g = GaugeMetricFamily("sentinel_admin_live_clients", "open live-feed (GET /live) clients")
        g.add_metric([], len(self.book.subs))
        yield g
        d = CounterMetricFamily("sentinel_admin_live_dropped", "live-feed clients disconnected by the feed, by "
                                "reason (slow: queue full; deadline: a write pending over "
                                "admin.live_write_timeout; shutdown)", labels=["reason"])
        for reason in CLOSE_REASONS:
            d.add_metric([reason], self.book.dropped[reason])
        yield d
        r = CounterMetricFamily("sentinel_admin_live_refused", "live-feed clients answered 503 "
                                "(admin.live_max_clients open)")
        r.add_metric([], self.book.refused_total)
        yield r


def _sse(kind: str, data: str) -> bytes:
    return f"event: {kind}\ndata: {data}\n\n".encode()


def _libc_malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where there is none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    return None if fn is None else (lambda: fn(0))


_MALLOC_TRIM = _libc_malloc_trim()


def _give_memory_back() -> None:
    """Return the heap pages the last dropped readers' buffers left free to the OS: glibc keeps
    freed memory in its arenas, so without this ~16-21 MB of a wave of 500 stuck readers stayed
    in RSS after they were gone. Cheap (~1 ms) and rare: only when the last live client
    left after a drop."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM()
