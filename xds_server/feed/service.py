"""The routing feed: a server-streaming gRPC API that tells subscribers (the relay) each node's
routing the moment the control plane publishes it (``protos/sentinel/routing/v1/routing.proto``).

Shape of a stream (``RoutingFeed/Watch``): the first :class:`RoutingUpdate` has ``snapshot=true``
and one ``NodeRouting`` per node of the requested clusters (all clusters when none are named),
as last published to Envoy (``eds_version``: the cluster's current ClusterLoadAssignment version;
in a later update: the version that carried the change); a node not published yet has ``routable=false``, an empty
``eds_health_status`` and ``eds_version``, and its current health ``state``. Each later update
carries the nodes whose published routing changed (EDS health status or effective state), in
publish order; changes queued while the subscriber was busy go out together in one update. A
reconnecting subscriber simply gets a fresh snapshot.

Built on :data:`ControlPlane.routing_listeners <xds_server.server.ControlPlane>`: the listener
only appends to per-subscriber queues (no I/O on the control plane's path). Each queue is bounded
(``queue_limit`` node changes, default :data:`DEFAULT_QUEUE_LIMIT`); a subscriber that falls that
far behind is dropped with ``RESOURCE_EXHAUSTED`` (it reconnects and gets a snapshot) rather than
slowing the control plane or growing memory. Unknown cluster names are ``INVALID_ARGUMENT``
naming the field.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xds_server.feed.events import RoutingChange
from xds_server.proto import routing_pb2, routing_pb2_grpc

# The control plane is typed structurally (ControlPlane-like: routing_listeners, config,
# routing, health, cla_version) so this module never imports xds_server.server (no cycle).
ControlPlane = Any

__all__ = ["DEFAULT_QUEUE_LIMIT", "RoutingFeed", "to_proto"]

log = logging.getLogger(__name__)

#: Node changes one subscriber may have queued before it is dropped. A full fleet flap of 1,000
#: nodes fits; a subscriber this far behind is better served by a fresh snapshot (ours).
DEFAULT_QUEUE_LIMIT = 1024


def to_proto(change: RoutingChange) -> routing_pb2.NodeRouting:
    """One node's routing as the wire message."""
    return routing_pb2.NodeRouting(
        node_id=change.node_id, cluster=change.cluster, address=change.address,
        routable=change.routable, state=change.state, reason=change.reason,
        eds_version=change.eds_version, weight=change.weight,
        eds_health_status=change.eds_health_status, published_unix_s=change.wall_time_s)


@dataclass(eq=False)
class _Subscriber:
    sid: int
    name: str
    clusters: frozenset[str]  # empty: all
    limit: int
    queue: collections.deque[RoutingChange] = field(default_factory=collections.deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: bool = False

    def offer(self, change: RoutingChange) -> None:
        if self.dropped or (self.clusters and change.cluster not in self.clusters):
            return
        if len(self.queue) >= self.limit:
            self.dropped = True
            self.queue.clear()
        else:
            self.queue.append(change)
        self.wake.set()


class RoutingFeed(routing_pb2_grpc.RoutingFeedServicer):
    """Servicer of ``sentinel.routing.v1.RoutingFeed``; registers itself as a routing listener.

    Counters (for ``/metrics``): ``subscribers`` (open streams), ``subscriptions_total``,
    ``dropped_total`` (slow subscribers dropped), ``updates_sent_total``.
    """

    def __init__(self, cp: ControlPlane, *, queue_limit: int = DEFAULT_QUEUE_LIMIT) -> None:
        if queue_limit < 1:
            raise ValueError("queue_limit must be >= 1")
        self._cp = cp
        self._limit = queue_limit
        self._last: dict[str, RoutingChange] = {}  # node id -> as last published
        self._subs: dict[int, _Subscriber] = {}
        self._ids = itertools.count(1)
        self.subscriptions_total = 0
        self.dropped_total = 0
        self.updates_sent_total = 0
        cp.routing_listeners.append(self._on_change)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def add_to_server(self, server: grpc.aio.Server) -> RoutingFeed:
        """Serve the feed on ``server`` (the control plane's ADS server); returns self."""
        routing_pb2_grpc.add_RoutingFeedServicer_to_server(self, server)
        return self

    def _on_change(self, change: RoutingChange) -> None:
        self._last[change.node_id] = change
        for sub in self._subs.values():
            sub.offer(change)

    def snapshot(self, clusters: frozenset[str]) -> list[RoutingChange]:
        """Every node of ``clusters`` (all when empty) as last published, in config order: the
        status and state of its last change, the current weight and CLA version."""
        out = []
        now = time.time()
        for c in self._cp.config.clusters:
            if clusters and c.name not in clusters:
                continue
            for n in c.nodes:
                last = self._last.get(n.id)
                published = self._cp.routing.get(n.id)
                if last is not None and published is not None:
                    # Weights move without a notification (only status/state changes are
                    # sent): the snapshot carries the current weight and CLA version.
                    last = dataclasses.replace(last, weight=published.weight,
                                               eds_version=self._cp.cla_version(c.name))
                if last is None:
                    nh = self._cp.health.get(n.id)
                    state = nh.effective_state.value if nh is not None else "COLD"
                    reason = nh.reason if nh is not None else ""
                    last = RoutingChange(n.id, c.name, n.address, False, state, "", 0,
                                         reason or "not published yet", "", now)
                out.append(last)
        return out

    async def Watch(self, request: routing_pb2.WatchRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[routing_pb2.RoutingUpdate]:
        known = {c.name for c in self._cp.config.clusters}
        unknown = sorted(set(request.clusters) - known)
        if unknown:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"clusters: unknown cluster(s) {', '.join(unknown[:10])}")
        sub = _Subscriber(next(self._ids), request.subscriber_id[:200],
                          frozenset(request.clusters), self._limit)
        # Registered and snapshotted in one step of the event loop: no change falls between.
        self._subs[sub.sid] = sub
        self.subscriptions_total += 1
        log.info("routing feed: subscriber %r joined (%d open)", sub.name, len(self._subs))
        try:
            yield routing_pb2.RoutingUpdate(snapshot=True,
                                            nodes=[to_proto(c) for c in self.snapshot(sub.clusters)])
            self.updates_sent_total += 1
            while True:
                await sub.wake.wait()
                sub.wake.clear()
                if sub.dropped:
                    self.dropped_total += 1
                    log.warning("routing feed: subscriber %r dropped: more than %d changes queued",
                                sub.name, self._limit)
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"subscriber too slow: more than {self._limit} changes "
                                        "queued; reconnect for a fresh snapshot")
                batch = [to_proto(c) for c in sub.queue]
                sub.queue.clear()
                if batch:
                    yield routing_pb2.RoutingUpdate(snapshot=False, nodes=batch)
                    self.updates_sent_total += 1
        finally:
            self._subs.pop(sub.sid, None)
            log.info("routing feed: subscriber %r left (%d open)", sub.name, len(self._subs))

    def metrics(self) -> Iterator[Any]:
        """Prometheus metric families of the feed."""
        g = GaugeMetricFamily("sentinel_routing_feed_subscribers", "open routing-feed streams")
        g.add_metric([], self.subscribers)
        yield g
        for name, help_, value in (
                ("sentinel_routing_feed_subscriptions", "routing-feed streams opened since start",
                 self.subscriptions_total),
                ("sentinel_routing_feed_dropped", "slow routing-feed subscribers dropped",
                 self.dropped_total),
                ("sentinel_routing_feed_updates_sent", "routing-feed updates sent",
                 self.updates_sent_total)):
            c = CounterMetricFamily(name, help_)
            c.add_metric([], value)
            yield c
