"""The Load Reporting Service (``envoy.service.load_stats.v3.LoadReportingService.StreamLoadStats``)
on the control plane's xDS port: every Envoy rendered by ``xds-server envoy-bootstrap`` opens one
stream (``cluster_manager.load_stats_config``) and reports its real traffic per cluster, locality
and endpoint every ``lrs.interval``; :class:`~xds_server.load.aggregate.LoadAggregator` sums it
across Envoys.

Protocol (docs/xds_protocol.md section 6): Envoy's first request carries only its node; it
reports nothing until it gets a ``LoadStatsResponse``. We answer it once, with
``send_all_clusters``, ``report_endpoint_granularity`` and ``load_reporting_interval``; Envoy then
sends one report per interval on its own timer, without waiting for another response.

Who may report: the same rule as ADS (``tls.node_allow`` over the client certificate's names and
the node id of the first request); with ``tls.mode: plaintext`` off loopback, nobody unless
``lrs.plaintext`` says so. A refusal ends the stream PERMISSION_DENIED (after reading what the
client already sent, :mod:`xds_server.process.stream_refusal`), counted
(``sentinel_lrs_problems_total{reason}`` and ``sentinel_access_refused_total{port="xds",reason}``)
and logged per identity. Bad input never applies: an undecodable request ends the stream
INVALID_ARGUMENT; a report too large, a flood, unknown clusters, absurd counts are counted and
skipped with the stream kept (Envoy has no NACK for load reports). Streams beyond
``lrs.max_streams`` get RESOURCE_EXHAUSTED; each stream's reading is paced by the xDS request
budget (``xds.limits.request_bytes_per_s``), as ADS is.

Replicas (``lrs.peers``, :mod:`xds_server.load.peers`): each report from an Envoy is applied and
forwarded to every peer. A stream whose first request carries the forwarded marker claims to be a
peer, and a marker proves nothing: it is accepted only as the listed peer it names
(:func:`~xds_server.load.peers.peer_refused`: its ``replica_id``, and its certificate identity
under mTLS or its host otherwise). Its reports, each naming an Envoy the peer holds a stream
from, are applied under the same per-Envoy flood limit as a direct stream's, at most
``lrs.peer_max_envoys`` Envoys per peer stream, and never forwarded again.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from envoy.service.load_stats.v3 import lrs_pb2
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from xds_server.config import SentinelConfig, TrafficEjectionConfig, parse_hostport
from xds_server.config.load import lrs_plaintext_refusal
from xds_server.control.core import ControlCore
from xds_server.control.traffic import TrafficEjector
from xds_server.load.aggregate import LoadAggregator, Traffic
from xds_server.load.peers import PeerSet, forwarded_by, host_addresses, peer_refused, source_ip
from xds_server.load.report import ReportRefused, decode_report, decode_request
from xds_server.load.shedder import Shedder, class_aliases
from xds_server.policy.traffic_ejection import Evidence, failure_p_value
from xds_server.process.refusals import Refusals
from xds_server.process.stream_refusal import refuse
from xds_server.process.tls import peer_identities
from xds_server.process.untrusted import clip, for_log
from xds_server.xds.budget import RequestBudget
from xds_server.xds.resources import AdmissionArgs, DropArgs

__all__ = ["LoadReportingService", "node_map"]

log = logging.getLogger(__name__)

_SERVICE = "envoy.service.load_stats.v3.LoadReportingService"
#: Refusal reason (``sentinel_access_refused_total``) -> its ``sentinel_lrs_problems_total`` reason.
_PROBLEM = {"node_allow": "not_allowed", "lrs_peer": "peer_refused", "lrs_plaintext": "plaintext_refused"}


def _succeeds(t: Traffic, te: TrafficEjectionConfig) -> bool:
    """The node's real traffic over the last two report intervals succeeds: requests completed
    and their failures not significant above ``tolerance`` (a frozen host completes none)."""
    return t.succeeded > 0 and failure_p_value(t.errored, t.completed, te.tolerance) > te.confidence_p


def node_map(config: SentinelConfig) -> dict[str, dict[tuple[str, int], str]]:
    """cluster -> {(host, port) of each node's EDS address: node id}."""
    return {c.name: {parse_hostport(n.address): n.id for n in c.nodes} for c in config.clusters}


class LoadReportingService:
    """grpc.aio handler of ``StreamLoadStats`` feeding one :class:`LoadAggregator`.

    ``config()``: the running config (node map, limits; re-read when it changes); ``authorize``:
    the ADS authorizer (``names, node_id -> None | reason``); ``monotonic``: the clock (s);
    ``on_report``: called after each applied report (the control plane evaluates traffic
    ejection there); ``refusals``: where refused identities are counted and logged; ``core``:
    the control core whose nodes are judged on their real traffic after each report
    (fleet-wide passive ejection, :class:`~xds_server.control.traffic.TrafficEjector`).
    ``streams``: open stream id -> Envoy node id.
    """

    def __init__(self, config: Callable[[], SentinelConfig], *,
                 authorize: Callable[[Sequence[str], str], str | None] | None = None,
                 monotonic: Callable[[], float] = time.monotonic,
                 on_report: Callable[[], None] | None = None, refusals: Refusals | None = None,
                 core: ControlCore | None = None) -> None:
        self._config = config
        self.core = core
        self.ejector = TrafficEjector(core) if core is not None else None
        self._judged: dict[str, float] = {}  # cluster -> when it was last judged (monotonic s)
        self.shedder = Shedder()  # overload shedding (lrs.shed), per request class with lrs.shed.classes
        self.shed = self.shedder.shed  # cluster -> its drop
        self.authorize = authorize
        self.refusals = refusals
        self.monotonic = monotonic
        self.on_report = on_report
        cfg = config()
        self._seen = cfg
        lrs = cfg.lrs
        self.aggregator = LoadAggregator(node_map(cfg), interval_s=lrs.interval.s, retain_s=lrs.retain.s,
                                         stale_after_s=lrs.stale_after.s, max_count=lrs.max_requests_per_interval,
                                         min_gap_s=lrs.interval.s * lrs.min_report_gap_ratio,
                                         max_localities=lrs.max_localities_per_cluster)
        self.aggregator.set_nodes(node_map(cfg), class_aliases(cfg))
        self.streams: dict[int, str] = {}
        self.peer_streams: dict[int, str] = {}  # stream id -> the forwarding replica's id
        self.peers = PeerSet(cfg)  # lrs.peers; started by the control plane (peers.start())
        self.streams_opened = 0
        self._ids = itertools.count(1)

    def add_to_server(self, server: grpc.aio.Server) -> LoadReportingService:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {
            "StreamLoadStats": grpc.stream_stream_rpc_method_handler(
                self.StreamLoadStats, request_deserializer=None, response_serializer=None)}),))
        return self

    def _refresh(self) -> SentinelConfig:
        cfg = self._config()
        if cfg is not self._seen:
            self._seen = cfg
            self.aggregator.set_nodes(node_map(cfg), class_aliases(cfg))
        return cfg

    def _problem(self, reason: str) -> None:
        self.aggregator.problems[reason] += 1

    async def StreamLoadStats(  # gRPC method name
        self, request_iterator: Any, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> None:
        cfg = self._refresh()
        if not cfg.lrs.enabled:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "load reporting is off (lrs.enabled)")
        if len(self.streams) + len(self.peer_streams) >= cfg.lrs.max_streams:
            self._problem("too_many_streams")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{len(self.streams)} load-report streams open (lrs.max_streams)")
        sid = next(self._ids)
        reporter = ""
        peer: str | None = None  # on a replica-to-replica stream: the forwarding replica's id
        peer_reporters: set[str] = set()
        xc = cfg.xds
        lim = xc.limits
        budget = RequestBudget(lim.request_bytes_per_s, lim.request_burst_bytes, lim.request_cost_min_bytes,
                               self.monotonic())
        try:
            async for raw in request_iterator:
                wait_s = budget.wait_s(self.monotonic())
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                budget.charge(len(raw), self.monotonic())
                try:
                    req = decode_request(raw)
                except ReportRefused as e:
                    self._problem(e.reason)
                    await refuse(context, request_iterator, grpc.StatusCode.INVALID_ARGUMENT, str(e))
                if sid not in self.streams and sid not in self.peer_streams:  # the first request: who is this?
                    reporter = clip(req.node.id, xc.limits.client_text_max_chars) if req.HasField("node") else ""
                    peer = forwarded_by(req)
                    refused = await self._admit(cfg, context, reporter, peer)
                    if refused is not None:
                        await refuse(context, request_iterator, grpc.StatusCode.PERMISSION_DENIED, refused)
                    if peer is not None:
                        self.peer_streams[sid] = peer
                    else:
                        self.streams[sid] = reporter
                        self.streams_opened += 1
                    log.info("%s %s opened a load-report stream (%d)", "Envoy" if peer is None else "replica",
                             for_log(reporter or "?"), sid)
                    await context.write(self._response(cfg).SerializeToString())
                cfg = self._refresh()
                source = reporter
                if peer is not None:  # a forwarded report names the Envoy that sent it
                    if not req.cluster_stats:
                        continue
                    source = clip(req.node.id, xc.limits.client_text_max_chars)
                    if forwarded_by(req) is None or not source:
                        self._problem("peer_unmarked")
                        continue
                    if source not in peer_reporters and len(peer_reporters) >= cfg.lrs.peer_max_envoys:
                        self._problem("peer_too_many_reporters")  # a peer inventing reporters
                        continue
                    peer_reporters.add(source)
                try:
                    report = decode_report(req, source, sid, max_clusters=cfg.lrs.max_clusters_per_report,
                                           max_endpoints=cfg.lrs.max_endpoints_per_report)
                except ReportRefused as e:
                    self._problem(e.reason)
                    continue
                now = self.monotonic()
                found = self.aggregator.ingest(report, now)  # per (Envoy, stream): forwarded ones too
                if report.clusters:
                    if peer is not None:
                        self.peers.count_received(peer)
                    elif "flood" not in found:
                        self.peers.forward(reporter, req)
                    self._judge(cfg, {self.aggregator.parent_of(c.cluster) for c in report.clusters}, now)
                    if self.on_report is not None:
                        self.on_report()
        finally:
            if self.streams.pop(sid, None) is not None:
                self.aggregator.forget_stream(reporter, sid)
            if self.peer_streams.pop(sid, None) is not None:
                for r in peer_reporters:
                    self.aggregator.forget_stream(r, sid)

    def _judge(self, cfg: SentinelConfig, clusters: set[str], now: float) -> None:
        """Fleet-wide passive ejection: judge each reported cluster on the evidence of every Envoy,
        at most 10 times per reporting interval (after each report of each of 1,000 Envoys would
        be too often; 1/10 of an interval adds at most that to the time to eject)."""
        te = cfg.lrs.traffic_ejection
        if self.ejector is None or self.core is None:
            return
        health = self.core.health
        for c in cfg.clusters:
            if c.name not in clusters or now - self._judged.get(c.name, -1e18) < cfg.lrs.interval.s / 10:
                continue
            self._judged[c.name] = now
            self._shed(cfg, c.name, [n.id for n in c.nodes], now)
            self.ejector.serving(c.name, frozenset(n.id for n in c.nodes if _succeeds(
                self.aggregator.node(c.name, n.id, now, 2 * cfg.lrs.interval.s), te)))
            if not te.enabled:
                continue
            evidence = {}
            for n in c.nodes:
                nh = health.get(n.id)
                w = te.window.s if nh is None else max(0.0, min(te.window.s, now - nh.since_s))
                t = self.aggregator.node(c.name, n.id, now, w)
                evidence[n.id] = Evidence(t.succeeded, t.errored, t.reporters, w, t.failing)
            self.ejector.apply(c.name, evidence, now)

    def _shed(self, cfg: SentinelConfig, cluster: str, node_ids: list[str], now: float) -> None:
        """Overload shedding (:mod:`xds_server.load.shedder`); a changed drop marks the cluster dirty."""
        assert self.core is not None
        self.shedder.step(cfg, self.core, self.aggregator, cluster, node_ids, now)

    def cla_args(self, cluster: str) -> DropArgs:
        """``build_cla`` keyword arguments of an Envoy cluster's overload drop (``shed_percent``, ``shed_flip``)."""
        return self.shedder.cla_args(cluster)

    def admission(self, cluster: str) -> AdmissionArgs | None:
        """The Envoy cluster's admission by free slots (:meth:`Shedder.admission_args`; None:
        not admitting)."""
        return None if self.core is None else self.shedder.admission_args(self._config(), cluster, self.core)

    async def _admit(self, cfg: SentinelConfig, context: grpc.aio.ServicerContext[bytes, bytes], reporter: str,
                     marker: str | None) -> str | None:
        """Why this stream is refused (counted in ``problems`` and by ``refusals``, logged per
        identity), or None. An Envoy's stream: ``tls.node_allow`` over its certificate and node id
        ``reporter``. A stream carrying the forwarded marker ``marker``: the listed peer it claims
        to be (:func:`~xds_server.load.peers.peer_refused`). Either: plaintext off loopback only
        with ``lrs.plaintext``."""
        names = peer_identities(context.auth_context())
        why = lrs_plaintext_refusal(cfg.lrs, cfg.tls.mode, cfg.xds.listen)
        if why is not None:
            return self._refuse(context, names, "lrs_plaintext", why, why)
        if marker is None:
            why = None if self.authorize is None else self.authorize(names, reporter)
            return None if why is None else self._refuse(
                context, names, "node_allow", why, f"load reports from node id {for_log(reporter, 100)!r}: {why}")
        claimed = next((p for p in cfg.lrs.peers if p.replica_id == marker), None)
        ips = await host_addresses(claimed.address) if claimed is not None and cfg.tls.mode != "mtls" else frozenset()
        why = peer_refused(cfg.lrs, cfg.xds.replica_id, cfg.tls.mode == "mtls", marker, names=names,
                           source_ip=source_ip(context.peer() or ""), peer_ips=ips)
        return None if why is None else self._refuse(context, names, "lrs_peer", why,
                                                     f"forwarded load reports: {why}")

    def _refuse(self, context: grpc.aio.ServicerContext[bytes, bytes], names: Sequence[str], reason: str,
                why: str, logged: str) -> str:
        self._problem(_PROBLEM[reason])
        if self.refusals is not None:
            self.refusals.refuse("xds", reason, context.peer() or "?", ", ".join(names[:3]) or "-", logged)
        else:
            log.warning("load-report stream from %s refused: %s", context.peer() or "?", logged)
        return why

    @staticmethod
    def _response(cfg: SentinelConfig) -> lrs_pb2.LoadStatsResponse:
        resp = lrs_pb2.LoadStatsResponse(send_all_clusters=True, report_endpoint_granularity=True)
        resp.load_reporting_interval.FromNanoseconds(round(cfg.lrs.interval.s * 1e9))
        return resp

    # -- views -------------------------------------------------------------------------------

    def window_s(self) -> float:
        return self._config().lrs.traffic_ejection.window.s

    def node_traffic(self, cluster: str, node_id: str) -> Traffic:
        """A node's real traffic over the ejection window (``lrs.traffic_ejection.window``)."""
        return self.aggregator.node(cluster, node_id, self.monotonic(), self.window_s())

    def node_view(self, cluster: str, node_id: str) -> dict[str, object]:
        """JSON for ``/nodes``: the window figures and the counts since this process started."""
        t = self.aggregator.totals.get((cluster, node_id))
        return {**self.node_traffic(cluster, node_id).to_json(),
                "since_start": {"issued": t.issued if t else 0, "succeeded": t.succeeded if t else 0,
                                "errored": t.errored if t else 0},
                "held_back": self.ejector.held.get(node_id) if self.ejector is not None else None}

    def cluster_view(self, cluster: str) -> dict[str, object]:
        """JSON for ``/clusters``: the cluster's window figures, drops per category, localities."""
        now, w, agg = self.monotonic(), self.window_s(), self.aggregator
        return {**agg.cluster(cluster, now, w).to_json(),
                "dropped_by_category": {k or "total": v for k, v in agg.drops(cluster, now, w).items()},
                "measured_interval_s": agg.measured_interval_s(cluster),
                "envoys_reporting_cluster": agg.listing(cluster, now),
                **self.shedder.view(self._config(), cluster),
                "cluster_failure": self.ejector.cluster_view(cluster) if self.ejector is not None else None,
                "localities": [{"locality": {"region": r, "zone": z, "sub_zone": s},
                                **agg.locality(cluster, (r, z, s), now, w).to_json()}
                               for r, z, s in agg.localities(cluster)]}

    def metric_families(self) -> Iterator[Metric]:
        """Prometheus families: streams, reports, problems, and per node the real-traffic counts."""
        agg, now = self.aggregator, self.monotonic()
        streams = GaugeMetricFamily("sentinel_lrs_streams", "open StreamLoadStats streams (one per Envoy)")
        streams.add_metric([], len(self.streams))
        reporting = GaugeMetricFamily("sentinel_lrs_reporting_envoys", "Envoys whose last load report is "
                                      "younger than lrs.stale_after")
        reporting.add_metric([], agg.reporters(now))
        reports = CounterMetricFamily("sentinel_lrs_reports", "load reports applied")
        reports.add_metric([], agg.reports)
        problems = CounterMetricFamily("sentinel_lrs_problems", "load reports or parts of them refused, by "
                                       "reason (not_allowed, undecodable, too_large, flood, unknown_cluster, "
                                       "unknown_endpoint, absurd_count, bad_interval, too_many_streams, "
                                       "peer_refused, peer_unmarked, peer_too_many_reporters, plaintext_refused)",
                                       labels=["reason"])
        for reason, count in sorted(agg.problems.items()):
            problems.add_metric([reason], count)
        slots = GaugeMetricFamily("sentinel_lrs_slots", "per-interval buckets held (memory bound: nodes x "
                                  "lrs.retain / lrs.interval)")
        slots.add_metric([], agg.slot_count())
        total = CounterMetricFamily("sentinel_node_traffic_requests", "real requests Envoys reported per "
                                    "node (LRS), by outcome (issued, succeeded, errored)",
                                    labels=["cluster", "node", "outcome"])
        ratio = GaugeMetricFamily("sentinel_node_traffic_success_ratio", "succeeded / completed real requests "
                                  "over lrs.traffic_ejection.window (0..1; absent without traffic)",
                                  labels=["cluster", "node"])
        rps = GaugeMetricFamily("sentinel_node_traffic_rps", "real requests issued per second over the "
                                "window, all Envoys", labels=["cluster", "node"])
        dropped = GaugeMetricFamily("sentinel_cluster_traffic_dropped", "requests Envoys dropped over the "
                                    "window (drop_overloads, circuit breaking), by category ('total': "
                                    "Envoy's total)", labels=["cluster", "category"])
        w = self.window_s()
        for c in self._config().clusters:
            for n in c.nodes:
                t = agg.totals.get((c.name, n.id))
                if t is not None:
                    for outcome, v in (("issued", t.issued), ("succeeded", t.succeeded), ("errored", t.errored)):
                        total.add_metric([c.name, n.id, outcome], v)
                tr = agg.node(c.name, n.id, now, w)
                if tr.success_ratio is not None:
                    ratio.add_metric([c.name, n.id], tr.success_ratio)
                rps.add_metric([c.name, n.id], tr.rps)
            for cat, v in agg.drops(c.name, now, w).items():
                dropped.add_metric([c.name, cat or "total"], v)
        yield from (streams, reporting, reports, problems, slots, total, ratio, rps, dropped)
        yield from self.shedder.metric_families(self._config())
        yield from self.peers.metric_families()
