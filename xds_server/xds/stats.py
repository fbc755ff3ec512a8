"""The one set of xDS server counters, and their Prometheus form.

:class:`XdsStats` is updated by the ADS shell only; the admin endpoint reads it through
:meth:`~xds_server.xds.ads.AdsServicer.metric_families`. Every label comes from a bounded set:
``variant`` (sotw, delta), ``type`` (:func:`~xds_server.xds.resources.type_label`: served types by
name, else "unknown"), ``kind`` (:class:`~xds_server.xds.protocol.Verdict` values), ``reason``
(:data:`REJECT_REASONS`). Nothing a client chooses (node id, nonce, type_url) becomes a label.
"""
from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from xds_server.xds.cache import SnapshotCache

__all__ = ["REJECT_REASONS", "XdsStats"]

REJECT_REASONS = ("undecodable", "invalid", "permission_denied")
"""Why a stream was ended by the server: a request that is not a Discovery(Delta)Request
(undecodable), one that breaks a protocol rule or a limit (invalid: INVALID_ARGUMENT), or a node
id the client's certificate may not use (permission_denied: PERMISSION_DENIED, ``tls.node_allow``)."""


class _Stream(Protocol):
    """What :meth:`XdsStats.families` reads of an open stream."""

    @property
    def variant(self) -> str: ...


@dataclass
class XdsStats:
    """Counters since start: ``requests[(variant, type, kind)]``, ``responses[(variant, type)]``,
    ``nacks[(variant, type)]``, ``rejected[(variant, reason)]``, ``streams_opened``,
    ``throttled_s`` (seconds streams' reads were held back by the request budget, summed)."""

    requests: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    responses: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    nacks: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    rejected: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    streams_opened: int = 0
    throttled_s: float = 0.0

    def families(self, streams: Iterable[_Stream], subscriptions: int, cache: SnapshotCache) -> Iterator[Metric]:
        """Prometheus metric families: these counters plus gauges of the open ``streams`` (objects
        with ``variant``), ``subscriptions`` held and the ``cache`` (a SnapshotCache)."""
        streams = list(streams)
        connected = GaugeMetricFamily("sentinel_xds_connected_streams", "open ADS streams by variant "
                                      "(sum over variant for all)", labels=["variant"])
        counts = collections.Counter({"sotw": 0, "delta": 0})
        counts.update(s.variant for s in streams)
        for v, n in sorted(counts.items()):
            connected.add_metric([v], n)
        yield connected
        req = CounterMetricFamily("sentinel_xds_requests", "Discovery(Delta)Requests by variant, type and kind",
                                  labels=["variant", "type", "kind"])
        for (v, t, k), n in sorted(self.requests.items()):
            req.add_metric([v, t, k], n)
        yield req
        resp = CounterMetricFamily("sentinel_xds_responses", "responses sent by variant and type",
                                   labels=["variant", "type"])
        for (v, t), n in sorted(self.responses.items()):
            resp.add_metric([v, t], n)
        yield resp
        nack = CounterMetricFamily("sentinel_xds_nacks", "NACKs received by variant and type (the "
                                   "node of each is in /xds/clients while it is connected)",
                                   labels=["variant", "type"])
        for (v, t), n in sorted(self.nacks.items()):
            nack.add_metric([v, t], n)
        yield nack
        rej = CounterMetricFamily("sentinel_xds_streams_rejected", "streams ended by the server for a bad "
                                  "request (undecodable, invalid) or a node id its client certificate "
                                  "may not use (permission_denied)", labels=["variant", "reason"])
        for (v, r), n in sorted(self.rejected.items()):
            rej.add_metric([v, r], n)
        yield rej
        thr = CounterMetricFamily("sentinel_xds_request_throttle_seconds",
                                  "seconds ADS streams' reads were held back by the per-stream request budget")
        thr.add_metric([], self.throttled_s)
        yield thr
        subs = GaugeMetricFamily("sentinel_xds_subscriptions",
                                 "subscriptions held by open streams (named resources + wildcards)")
        subs.add_metric([], subscriptions)
        yield subs
        opened = CounterMetricFamily("sentinel_xds_streams_opened", "ADS streams opened since start")
        opened.add_metric([], self.streams_opened)
        yield opened
        watchers = GaugeMetricFamily("sentinel_xds_cache_watchers", "streams waiting on cache changes")
        watchers.add_metric([], cache.watcher_count)
        yield watchers
        memo = GaugeMetricFamily("sentinel_xds_cache_memo_bytes",
                                 "bytes (estimated) held by the cache's memos of shared responses")
        memo.add_metric([], cache.memo_bytes())
        yield memo
        enc = CounterMetricFamily("sentinel_xds_resources_encoded", "resources validated and encoded into the cache")
        enc.add_metric([], cache.encode_count)
        yield enc
        enc_s = CounterMetricFamily("sentinel_xds_encode_seconds", "time spent validating, serializing, hashing")
        enc_s.add_metric([], cache.encode_s)
        yield enc_s
        rejr = CounterMetricFamily("sentinel_xds_resources_rejected",
                                   "resources held back because Envoy would NACK them")
        rejr.add_metric([], cache.rejected_count)
        yield rejr
