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
only appends to per-subscriber queues (no I/O on the control plane's path). Bounds (``feed:``
section, :mod:`xds_server.config.feed`; bookkeeping in :class:`~xds_server.process.fanout.FanOut`):
at most ``feed.max_subscribers`` streams (RESOURCE_EXHAUSTED past it); each queue holds at most
``feed.queue_limit`` node changes, and a subscriber that falls that far behind is dropped with
``RESOURCE_EXHAUSTED`` (it reconnects and gets a snapshot) rather than slowing the control plane
or growing memory; an update not taken within ``feed.send_timeout`` (a subscriber that stopped
reading) drops it the same way. Unknown cluster names are ``INVALID_ARGUMENT`` naming the field.

Access: plaintext off loopback must be said (``feed.plaintext``), and with mTLS
``feed.allow_identities`` lists who may subscribe (PERMISSION_DENIED otherwise, one call site:
:meth:`RoutingFeed.refusal`).

``RoutingFeed/SubmitPrompts`` (unary, the same access rule): prompts a relay sampled from live
traffic go into switch-back validation's live pool (:mod:`xds_server.probing.live_prompts`,
``health.validation.live_prompts``). Answered with a ``PromptAck`` (accepted, refused); with
``live_prompts`` off every prompt is refused. At most ``MAX_PROMPTS_PER_CALL`` (64) per call are
looked at, the rest refused. Counted in ``sentinel_live_prompts_submitted_total{outcome}``;
prompt text is never logged.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xds_server.config import SentinelConfig
from xds_server.config.feed import FeedConfig, feed_plaintext_refusal
from xds_server.feed.events import RoutingChange, RoutingListener
from xds_server.health.model import NodeHealth, Routing
from xds_server.probing.live_prompts import MAX_PROMPTS_PER_CALL, REFUSALS, LivePromptPool
from xds_server.process.fanout import CLOSE_REASONS, FanOut, Subscriber
from xds_server.process.tls import peer_identities, refused_client
from xds_server.process.untrusted import RateLimitedLog
from xds_server.proto import routing_pb2, routing_pb2_grpc


class RoutingSource(Protocol):
    """What the feed reads of the control plane (:class:`xds_server.server.ControlPlane`, which
    sits above this layer): its config, the routing as last published and each node's health,
    the CLA version of a cluster, and the listeners called at each published change."""

    @property
    def config(self) -> SentinelConfig: ...
    @property
    def routing(self) -> Mapping[str, Routing]: ...
    @property
    def health(self) -> Mapping[str, NodeHealth]: ...
    @property
    def routing_listeners(self) -> list[RoutingListener]: ...
    def cla_version(self, cluster: str) -> str: ...

__all__ = ["DEFAULT_QUEUE_LIMIT", "RoutingFeed", "to_proto"]

log = logging.getLogger(__name__)

#: Node changes one subscriber may have queued before it is dropped (``feed.queue_limit``'s default).
DEFAULT_QUEUE_LIMIT: int = FeedConfig.model_fields["queue_limit"].default


def to_proto(change: RoutingChange) -> routing_pb2.NodeRouting:
    """One node's routing as the wire message."""
    return routing_pb2.NodeRouting(
        node_id=change.node_id, cluster=change.cluster, address=change.address,
        routable=change.routable, state=change.state, reason=change.reason,
        eds_version=change.eds_version, weight=change.weight,
        eds_health_status=change.eds_health_status, published_unix_s=change.wall_time_s)


class _Watch:
    """One Watch stream besides its bookkeeping: its name, clusters (empty: all), wake-up."""

    __slots__ = ("clusters", "name", "wake")

    def __init__(self, name: str, clusters: frozenset[str]) -> None:
        self.name, self.clusters = name, clusters
        self.wake = asyncio.Event()


class RoutingFeed(routing_pb2_grpc.RoutingFeedServicer):
    """Servicer of ``sentinel.routing.v1.RoutingFeed``; registers itself as a routing listener.

    Counters (for ``/metrics``): ``subscribers`` (open streams), ``subscriptions_total``,
    ``dropped_total`` (subscribers dropped: too far behind or past the send deadline),
    ``updates_sent_total``; :attr:`book` holds the rest (refused, by reason). ``queue_limit``
    overrides ``feed.queue_limit`` (tests). ``live_prompts``: switch-back validation's pool of
    live prompts that ``SubmitPrompts`` fills; None: every submitted prompt is refused as off.
    """

    def __init__(self, cp: RoutingSource, *, queue_limit: int | None = None,
                 live_prompts: LivePromptPool | None = None) -> None:
        if queue_limit is not None and queue_limit < 1:
            raise ValueError("queue_limit must be >= 1")
        self._cp = cp
        self._live = live_prompts
        self._queue_limit = queue_limit
        self._last: dict[str, RoutingChange] = {}  # node id -> as last published
        f = self._cfg()
        self.book: FanOut[RoutingChange] = FanOut(f.max_subscribers, queue_limit or f.queue_limit, f.send_timeout.s)
        self._watches: dict[int, _Watch] = {}
        self.updates_sent_total = 0
        self.permission_denied_total = 0
        self.prompts: dict[str, int] = dict.fromkeys(("accepted", *REFUSALS), 0)  # SubmitPrompts, by outcome
        self._rl = RateLimitedLog(log, 10.0, max_keys=16)
        cp.routing_listeners.append(self._on_change)

    def _cfg(self) -> FeedConfig:
        cfg: FeedConfig = getattr(self._cp.config, "feed", None) or FeedConfig()
        return cfg

    def _limits(self) -> None:
        """Follow a reloaded ``feed:`` section (open streams beyond a lowered cap stay)."""
        f, b = self._cfg(), self.book
        b.max_subscribers, b.queue_max, b.send_timeout_s = (f.max_subscribers, self._queue_limit or f.queue_limit,
                                                            f.send_timeout.s)

    @property
    def subscribers(self) -> int:
        return len(self.book.subs)

    @property
    def subscriptions_total(self) -> int:
        return self.book.joined_total

    @property
    def dropped_total(self) -> int:
        return self.book.dropped["slow"] + self.book.dropped["deadline"]

    def add_to_server(self, server: grpc.aio.Server) -> RoutingFeed:
        """Serve the feed on ``server`` (the control plane's ADS server); returns self."""
        routing_pb2_grpc.add_RoutingFeedServicer_to_server(self, server)
        return self

    def _on_change(self, change: RoutingChange) -> None:
        self._last[change.node_id] = change
        if not self.book.subs:
            return
        wanting = {sid for sid, w in self._watches.items() if not w.clusters or change.cluster in w.clusters}
        self.book.publish([change], only=wanting)
        for sid in wanting:
            w = self._watches.get(sid)
            if w is not None:
                w.wake.set()

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

    def refusal(self, context: grpc.aio.ServicerContext) -> str | None:
        """Why this subscriber may not read the feed (PERMISSION_DENIED details), else None: the
        plaintext rule (``feed.plaintext``) and, with mTLS, ``feed.allow_identities`` matched
        against the client certificate's identities (the one place a subscriber's identity is
        checked)."""
        cfg = self._cp.config
        why = feed_plaintext_refusal(self._cfg(), cfg.tls.mode, cfg.xds.listen)
        if why is not None:  # a setting, the same for every subscriber: one line per 10 s
            self._rl.warning(time.monotonic(), "denied", "%s", why)
        elif cfg.tls.mode == "mtls" and self._cfg().allow_identities:
            why = refused_client(self._cfg().allow_identities, context.auth_context(), "feed.allow_identities")
            if why is not None:
                why = f"routing feed refused: {why}"
                record = getattr(self._cp, "refusals", None)  # counted and logged per identity
                if record is not None:  # the one line: with the peer's address and identity
                    record.refuse("xds", "feed_allow", context.peer() or "?",
                                  ", ".join(peer_identities(context.auth_context())[:3]) or "-", why)
                else:
                    self._rl.warning(time.monotonic(), "denied", "%s", why)
        return why

    async def Watch(self, request: routing_pb2.WatchRequest, context: grpc.aio.ServicerContext) -> None:
        known = {c.name for c in self._cp.config.clusters}
        unknown = sorted(set(request.clusters) - known)
        if unknown:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"clusters: unknown cluster(s) {', '.join(unknown[:10])}")
        why = self.refusal(context)
        if why is not None:
            self.permission_denied_total += 1  # logged once, by refusal()
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        self._limits()
        sub = self.book.join()
        if sub is None:
            n = self.book.max_subscribers
            self._rl.warning(time.monotonic(), "cap", "routing feed: subscriber refused (%d open, "
                             "feed.max_subscribers)", n)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many routing-feed subscribers ({n}, feed.max_subscribers); retry later")
        assert sub is not None
        w = _Watch(request.subscriber_id[:200], frozenset(request.clusters))
        # Registered and snapshotted in one step of the event loop: no change falls between.
        self._watches[sub.sid] = w
        log.info("routing feed: subscriber %r joined (%d open)", w.name, len(self.book.subs))
        try:
            snap = routing_pb2.RoutingUpdate(snapshot=True, nodes=[to_proto(c) for c in self.snapshot(w.clusters)])
            self.book.begin(sub, time.monotonic())
            await self._send(sub, w, context, snap)
            while True:
                await w.wake.wait()
                w.wake.clear()
                if sub.closed == "slow":
                    self._rl.warning(time.monotonic(), "slow", "routing feed: subscriber %r dropped: more than "
                                     "%d changes queued", w.name, self.book.queue_max)
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"subscriber too slow: more than {self.book.queue_max} changes "
                                        "queued; reconnect for a fresh snapshot")
                batch = [to_proto(c) for c in self.book.take(sub, time.monotonic())]
                if batch:
                    await self._send(sub, w, context, routing_pb2.RoutingUpdate(snapshot=False, nodes=batch))
        finally:
            self.book.leave(sub)
            self._watches.pop(sub.sid, None)
            log.info("routing feed: subscriber %r left (%d open)", w.name, len(self.book.subs))

    async def SubmitPrompts(self, request: routing_pb2.PromptSample,
                            context: grpc.aio.ServicerContext) -> routing_pb2.PromptAck:
        """Keep the valid prompts of ``request`` in switch-back validation's live pool (see the
        module docstring); PERMISSION_DENIED as :meth:`Watch`. Never logs prompt text."""
        n = len(request.prompts)
        why = self.refusal(context)
        if why is not None:
            self.permission_denied_total += 1  # logged once, by refusal()
            self.prompts["denied"] += n
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        cfg = self._cp.config.health.validation.live_prompts
        pool = self._live
        if not cfg.enabled or pool is None:
            self.prompts["off"] += n
            return routing_pb2.PromptAck(accepted=0, refused=n)
        known = {c.name for c in self._cp.config.clusters}
        accepted = 0
        for sp in request.prompts[:MAX_PROMPTS_PER_CALL]:
            reason = pool.offer(sp.cluster, sp.prompt, cfg, known)
            self.prompts[reason or "accepted"] += 1
            accepted += reason is None
        self.prompts["over_call_limit"] += max(0, n - MAX_PROMPTS_PER_CALL)
        return routing_pb2.PromptAck(accepted=accepted, refused=n - accepted)

    async def _send(self, sub: Subscriber[RoutingChange], w: _Watch, context: grpc.aio.ServicerContext,
                    update: routing_pb2.RoutingUpdate) -> None:
        """Write ``update``; past ``feed.send_timeout`` drop the subscriber (aborts the call).

        gRPC Python cannot take back a write its transport holds, so the write is left pending
        (it ends with the connection) and keeps the subscriber's place under the cap until then."""
        write = asyncio.ensure_future(context.write(update))
        write.add_done_callback(_retrieved)
        try:
            done, _ = await asyncio.wait({write}, timeout=self.book.send_timeout_s)
        except asyncio.CancelledError:  # the client cancelled the call (gRPC cancels the handler)
            write.cancel()
            raise
        if done:
            write.result()  # raises what the write raised (the client went away)
            self.book.sent(sub)
            self.updates_sent_total += 1
            return
        self.book.close(sub, "deadline", pending=True)
        write.add_done_callback(lambda t: self._released(sub, t))
        self._rl.warning(time.monotonic(), "deadline", "routing feed: subscriber %r dropped: an update "
                         "not taken within %.1f s (feed.send_timeout)", w.name, self.book.send_timeout_s)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"subscriber too slow: an update not taken within {self.book.send_timeout_s:g} s; "
                            "reconnect for a fresh snapshot")

    def _released(self, sub: Subscriber[RoutingChange], _write: asyncio.Future[Any]) -> None:
        self.book.release(sub)

    def metrics(self) -> Iterator[Any]:
        """Prometheus metric families of the feed."""
        g = GaugeMetricFamily("sentinel_routing_feed_subscribers", "open routing-feed streams")
        g.add_metric([], self.subscribers)
        yield g
        closing = GaugeMetricFamily("sentinel_routing_feed_closing", "routing-feed streams dropped past "
                                    "feed.send_timeout whose connection has not ended yet (they still "
                                    "count toward feed.max_subscribers)")
        closing.add_metric([], self.book.closing)
        yield closing
        for name, help_, value in (
                ("sentinel_routing_feed_subscriptions", "routing-feed streams opened since start",
                 self.subscriptions_total),
                ("sentinel_routing_feed_updates_sent", "routing-feed updates sent",
                 self.updates_sent_total),
                ("sentinel_routing_feed_refused", "routing-feed streams refused: feed.max_subscribers open",
                 self.book.refused_total),
                ("sentinel_routing_feed_permission_denied", "routing-feed streams refused: plaintext off "
                 "loopback not said (feed.plaintext) or identity not in feed.allow_identities",
                 self.permission_denied_total)):
            c = CounterMetricFamily(name, help_)
            c.add_metric([], value)
            yield c
        d = CounterMetricFamily("sentinel_routing_feed_dropped", "routing-feed subscribers dropped by reason "
                                "(slow: more than feed.queue_limit changes queued; deadline: an update not "
                                "taken within feed.send_timeout; shutdown)", labels=["reason"])
        for reason in CLOSE_REASONS:
            d.add_metric([reason], self.book.dropped[reason])
        yield d
        p = CounterMetricFamily("sentinel_live_prompts_submitted", "prompts relays submitted for switch-back "
                                "validation (SubmitPrompts) by outcome: accepted, or why refused (off: "
                                "health.validation.live_prompts off; denied; over_call_limit; empty; too_long; "
                                "invalid_utf8; unknown_cluster)", labels=["outcome"])
        for outcome, v in self.prompts.items():
            p.add_metric([outcome], v)
        yield p
        pool = self._live
        if pool is not None:
            g = GaugeMetricFamily("sentinel_live_prompts", "live prompts held for switch-back validation by "
                                  "cluster (\"\": the shared pool of prompts without one)", labels=["cluster"])
            for cluster, v in pool.counts().items():
                g.add_metric([cluster], v)
            yield g


def _retrieved(write: asyncio.Future[Any]) -> None:
    """A write's failure is the client gone: seen by the handler or by no one, never logged as
    "exception never retrieved"."""
    if not write.cancelled():
        write.exception()
