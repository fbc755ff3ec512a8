"""The dashboard's live feed: Server-Sent Events from the admin endpoint.

:class:`LiveFeed` samples the :class:`~xds_server.admin.views.ControlPlaneView` every
``admin.live_interval_ms`` while at least one client listens, and hands each client, through its
own bounded queue (``admin.live_queue_max`` messages), a ``state`` message (every node and
cluster, fail-static) and one ``event`` message per new health event. A client whose queue is
full (it reads slower than the feed writes) is dropped: its stream ends and the browser's
EventSource reconnects, starting again from a fresh snapshot. Nothing here writes to the view.

Wire format (``GET /live``, ``text/event-stream``): ``event: state`` / ``event: event`` with one
JSON ``data:`` line each; a ``: ping`` comment every ``admin.live_ping_s`` keeps proxies from
closing an idle stream.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from xds_server.admin.views import ControlPlaneView
from xds_server.control.events import EventRecord

__all__ = ["LiveClient", "LiveFeed"]

log = logging.getLogger(__name__)

#: Events sent to a client when it connects (the newest, oldest first).
BACKLOG_EVENTS = 50


class LiveClient:
    """One connected browser: a bounded queue of ``(kind, json_text)`` messages; ``None`` in
    the queue ends the stream. ``dropped`` is set once the feed gave up on it."""

    __slots__ = ("dropped", "queue")

    def __init__(self, maxsize: int) -> None:
        self.queue: asyncio.Queue[tuple[str, str] | None] = asyncio.Queue(maxsize)
        self.dropped = False

    def offer(self, item: tuple[str, str]) -> bool:
        """Queue ``item``; False (and the client is ended) when its queue is full."""
        if self.dropped:
            return False
        try:
            self.queue.put_nowait(item)
            return True
        except asyncio.QueueFull:
            self.end()
            return False

    def end(self) -> None:
        """Drop whatever is queued and end the stream."""
        self.dropped = True
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


class LiveFeed:
    """Fan-out of view snapshots and new events to SSE clients (see module docstring).

    ``dumps`` turns a JSON-able object into strict JSON text (the admin's ``json_dumps``).
    """

    def __init__(self, view: ControlPlaneView, dumps: Callable[[Any], str]) -> None:
        self.view = view
        self.dumps = dumps
        self.clients: set[LiveClient] = set()
        self.dropped_total = 0
        self._last_event: EventRecord | None = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    # -- what is sent ----------------------------------------------------------------------------

    def snapshot(self) -> str:
        """The ``state`` message: wall time (unix s), fail-static, clusters and nodes (as the
        ``/clusters`` and ``/nodes`` views)."""
        v = self.view
        return self.dumps({"time": time.time(), "fail_static": v.fail_static_active,
                           "clusters": v.cluster_summaries(), "nodes": v.nodes()})

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

    def subscribe(self) -> LiveClient:
        client = LiveClient(self.view.config.admin.live_queue_max)
        if not self.clients:
            # The feed was idle (no tick ran): the backlog covers the past, only later events are
            # new. With clients connected the marker stays, so none of theirs is skipped (the new
            # client may see an event of the last interval twice: in its backlog and as new).
            self._new_events()
        self.clients.add(client)
        self._wake.set()
        return client

    def unsubscribe(self, client: LiveClient) -> None:
        self.clients.discard(client)

    def tick(self) -> None:
        """Send one snapshot and the new events to every client; drop the full ones."""
        if not self.clients:
            self._new_events()
            return
        msgs = [("event", self.dumps(r.to_json())) for r in self._new_events()]
        msgs.append(("state", self.snapshot()))
        for client in list(self.clients):
            if not all(client.offer(m) for m in msgs):
                self.clients.discard(client)
                self.dropped_total += 1
                log.warning("admin: live client dropped (read slower than the feed; queue of %d full)",
                            client.queue.maxsize)

    async def run(self) -> None:
        """Tick every ``admin.live_interval_ms`` while clients listen; idle otherwise."""
        while True:
            if not self.clients:
                self._wake.clear()
                await self._wake.wait()
            try:
                self.tick()
            except Exception:  # a view error must not end the feed for every later client
                log.exception("admin: live feed tick failed")
            await asyncio.sleep(self.view.config.admin.live_interval_ms / 1000.0)

    async def start(self, _app: web.Application | None = None) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def close(self, _app: web.Application | None = None) -> None:
        """End every client's stream and stop the ticker."""
        for client in list(self.clients):
            client.end()
        self.clients.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- the HTTP handler --------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """``GET /live``: the SSE stream for one client."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        client = self.subscribe()
        ping_s = self.view.config.admin.live_ping_s
        try:
            first = [("event", e) for e in self.backlog()] + [("state", self.snapshot())]
            await resp.write("".join(_sse(k, d) for k, d in first).encode())
            while True:
                try:
                    item = await asyncio.wait_for(client.queue.get(), timeout=ping_s)
                except TimeoutError:
                    await resp.write(b": ping\n\n")
                    continue
                if item is None:
                    break
                await resp.write(_sse(*item).encode())
        except ConnectionResetError:  # the browser went away
            pass
        finally:
            self.unsubscribe(client)
        return resp


def _sse(kind: str, data: str) -> str:
    return f"event: {kind}\ndata: {data}\n\n"
