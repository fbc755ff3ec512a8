"""Client of the control plane's routing feed (``sentinel.routing.v1.RoutingFeed/Watch``).

:class:`FeedClient` keeps one server-streaming call open (grpc.aio) to one of its targets (a
control plane's replicas; each reconnect dials the next, round robin), reconnecting with backoff
(0.1 s doubling to ``reconnect_max_s``; an HTTP/2 PING every ``keepalive_s`` left unanswered for
``keepalive_s`` drops the connection, so a frozen control plane is left too), and calls
``on_node(node, snapshot)`` for every ``NodeRouting`` it receives (each reconnect starts with a
full snapshot). It keeps the latest routing per node in ``nodes`` (node id -> NodeRouting).
``on_node`` must not block. ``tls``: dial over TLS (:class:`~xds_server.process.tls.ClientTls`, files
re-read at each reconnect); None: plaintext. ``target``: the one dialled last. ``channel``: the
connection to it while one is open (None between connections), for unary calls to the same
control plane with the same TLS (the relay's sampled prompts, :mod:`sentinel_relay.prompts`).
Raises ValueError when no target is given.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc

from xds_server.process.cancellation import cancel_and_wait, raise_if_cancelled
from xds_server.process.tls import ClientTls, dial
from xds_server.process.untrusted import for_log
from xds_server.proto import routing_pb2, routing_pb2_grpc

__all__ = ["FeedClient"]

log = logging.getLogger("sentinel_relay.feed")


class FeedClient:
    def __init__(self, target: str | Sequence[str], on_node: Callable[[routing_pb2.NodeRouting, bool], object], *,
                 subscriber_id: str = "sentinel-relay", reconnect_max_s: float = 2.0, keepalive_s: float = 1.0,
                 on_connected: Callable[[bool], None] | None = None, tls: ClientTls | None = None) -> None:
        self.targets = [target] if isinstance(target, str) else list(target)
        if not self.targets:
            raise ValueError("FeedClient needs at least one target")
        self._next = 0  # index of the target the next dial goes to
        self.target = self.targets[0]  # the one dialled last
        ms = max(1, round(keepalive_s * 1000))
        # Pings go on while the stream is idle (gRPC stops after 2 without data by default). The
        # ack deadline is grpc.http2.ping_timeout_ms: with keepalive_timeout_ms alone, gRPC 1.85
        # kept a connection to a SIGSTOPped server open until it woke (measured).
        self.channel_options = [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
                                ("grpc.http2.ping_timeout_ms", ms), ("grpc.http2.max_pings_without_data", 0)]
        self.tls = tls  # None: plaintext; else TLS as xds_server.process.tls.dial makes it
        self.on_node = on_node
        self.subscriber_id = subscriber_id
        self.reconnect_max_s = reconnect_max_s
        self.on_connected = on_connected or (lambda up: None)
        self.nodes: dict[str, routing_pb2.NodeRouting] = {}
        self.updates = 0
        self.channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="routing-feed")

    async def stop(self) -> None:
        if self._task:
            await cancel_and_wait(self._task)

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            self.target = self.targets[self._next]
            self._next = (self._next + 1) % len(self.targets)
            failed = ""  # why the stream failed, for the log ("": it ended)
            try:
                async with dial(self.target, options=self.channel_options, tls=self.tls) as ch:
                    self.channel = ch
                    stub = routing_pb2_grpc.RoutingFeedStub(ch)
                    call = stub.Watch(routing_pb2.WatchRequest(subscriber_id=self.subscriber_id))
                    async for upd in call:
                        if upd.snapshot:
                            self.on_connected(True)
                            backoff = 0.1
                            log.info("routing feed %s: snapshot of %d nodes", self.target, len(upd.nodes))
                        self.updates += 1
                        for n in upd.nodes:
                            self.nodes[n.node_id] = n
                            try:
                                self.on_node(n, upd.snapshot)
                            except Exception:  # a bug in a callback must not end the feed
                                log.exception("routing feed callback failed for %s", n.node_id)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:  # the details say what answered (an HTTP/1 server, nothing)
                failed = (f" (--routing-feed, the control plane's xds.listen): {e.code().name}: "
                          f"{_why(e.details() or '')}")
            except Exception as e:  # any failure: reconnect
                failed = f": {e!r}"
            finally:
                self.channel = None
            raise_if_cancelled()  # a stop's cancel that a failed call swallowed ends the loop too
            if failed:
                log.warning("routing feed %s%s; reconnecting in %.1f s", self.target, failed, backoff)
            self.on_connected(False)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.reconnect_max_s)


def _why(details: str) -> str:
    """gRPC's connect error in a few words: what answered at the feed's address."""
    if "http1" in details.lower():
        return "an HTTP/1 server answers there, not a gRPC port (the admin port?)"
    if "Connection refused" in details:
        return "nothing listens there (connection refused)"
    return for_log(details, 400)
