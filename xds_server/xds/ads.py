"""The grpc.aio shell of the Aggregated Discovery Service: state-of-the-world and delta, CDS + EDS.

The protocol lives in the pure per-stream bookkeeping (:mod:`~xds_server.xds.sotw`,
:mod:`~xds_server.xds.delta`, shared parts in :mod:`~xds_server.xds.protocol`); bytes are made by
:mod:`~xds_server.xds.encoding`; counters live in :class:`~xds_server.xds.stats.XdsStats`. This
module does the I/O: one reader task per stream feeds requests in; the send loop wakes on a
request or a cache change, asks the stream what is due and writes it. Responses are computed just
before they are written, so a slow reader holds at most one response in flight and then gets the
latest state (coalesced), never a backlog; other streams never wait on it.

What the shell adds to the protocol (checklist 1.9 numbers in brackets):
- it hands each stream its id, a nonce prefix of ``<random per servicer>.<stream id hex>.`` (nonces
  are never reused by a later stream or a restarted server [2, 19]) and its connection time;
- a request that does not decode ends the stream with INVALID_ARGUMENT, as does one the stream
  rejects (no ``type_url`` [16], too many types or names, a type_url too long);
- each stream has a request budget (``xds.limits.request_bytes_per_s``, ``xds.limits.request_burst_bytes``,
  ``xds.limits.request_cost_min_bytes``): while it is overdrawn the stream is not read, so one client
  flooding requests cannot take the event loop from the others;
- NACKs and rejected streams are logged rate-limited, with every client string escaped
  (:func:`~xds_server.process.untrusted.for_log`); node ids are shown in :meth:`AdsServicer.clients_view`
  only while their stream is open and are never metric labels.

Shape::

    servicer = AdsServicer(cache, config=xds_config)   # clock and nonce prefix injectable for tests
    servicer.add_to_server(grpc_aio_server)
    servicer.clients_view()                             # JSON for /xds/clients
    servicer.metric_families()                          # Prometheus families for /metrics
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import grpc
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import DecodeError
from prometheus_client.core import Metric

from xds_server.config import XdsConfig
from xds_server.process.refusals import Refusals
from xds_server.process.stream_refusal import drain
from xds_server.process.tls import peer_certificate_sha256, peer_identities
from xds_server.process.untrusted import RateLimitedLog, clip, for_log
from xds_server.xds.budget import RequestBudget
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.delta import DeltaStream
from xds_server.xds.encoding import encode_response
from xds_server.xds.protocol import ClientCertificate, RequestVerdict, StreamIdentity, StreamLimits, Verdict
from xds_server.xds.resources import type_label
from xds_server.xds.sotw import SotwStream
from xds_server.xds.stats import XdsStats

__all__ = ["AdsServicer", "AdsStream"]

log = logging.getLogger(__name__)

AdsStream = SotwStream | DeltaStream

_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"
_EDS_SERVICE = "envoy.service.endpoint.v3.EndpointDiscoveryService"
_CDS_SERVICE = "envoy.service.cluster.v3.ClusterDiscoveryService"
_LOG_INTERVAL_S = 10.0  # at most one NACK / rejected-stream line per (kind, variant, type) per 10 s


class _Rejected(Exception):
    """A request ended its stream: ``reason`` is one of stats.REJECT_REASONS."""

    def __init__(self, reason: str, message: str,
                 code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code


Authorizer = Callable[[Sequence[str], str], "str | None"]
"""``authorize(names, node_id) -> None`` to serve the stream, else the reason to refuse it
(``names``: those of the client's verified certificate, :class:`ClientCertificate`; empty without one)."""


class AdsServicer:
    """grpc.aio handlers for SotW and delta ADS over one :class:`SnapshotCache`.

    ``config``: the :class:`~xds_server.config.XdsConfig` (limits and request budget; defaults
    when None). ``clock`` (unix s) stamps connection times; ``monotonic`` (s) drives request
    budgets; ``nonce_prefix`` (default: 6 random hex digits) starts every nonce. ``streams`` maps
    stream id -> live stream; ``stats`` holds the counters. ``authorize`` (optional) is asked once
    per stream, with the node id of its first request, before that request is read: a reason
    ends the stream with PERMISSION_DENIED (counted as reason ``permission_denied``).
    """

    def __init__(self, cache: SnapshotCache, *, config: XdsConfig | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 nonce_prefix: str | None = None, authorize: Authorizer | None = None,
                 refusals: Refusals | None = None) -> None:
        self.cache = cache
        self.authorize = authorize
        self.refusals = refusals  # refused identities on record (None: refusals only logged)
        self.config = config or XdsConfig()
        self.limits = StreamLimits.from_config(self.config)
        self.stats = XdsStats()
        self.streams: dict[int, AdsStream] = {}
        self._clock = clock
        self._monotonic = monotonic
        self._boot = nonce_prefix if nonce_prefix is not None else secrets.token_hex(3)
        self._ids = itertools.count(1)
        self._log = RateLimitedLog(log, per_key_interval_s=_LOG_INTERVAL_S)
        self._client_log = RateLimitedLog(log, per_key_interval_s=_LOG_INTERVAL_S, max_keys=256)
        self._announced: set[int] = set()  # stream ids whose connect line was considered

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register both ADS methods on ``server``, and the per-type CDS and EDS services
        (``ClusterDiscoveryService``, ``EndpointDiscoveryService``) on the same streams: an Envoy
        whose clusters take their EDS from more than one control plane (a cluster's
        ``eds_config.api_config_source``, docs/replicas.md "Running more than one control plane") opens
        ``StreamEndpoints`` / ``DeltaEndpoints`` instead of ADS; the messages are the same.
        Requests arrive as bytes (decoded here, so an undecodable one is answered
        INVALID_ARGUMENT) and responses leave as bytes
        (:func:`~xds_server.xds.encoding.encode_response`: bodies shared by every stream)."""
        def handlers(sotw: str, delta: str) -> dict[str, grpc.RpcMethodHandler[bytes, bytes]]:
            return {
                sotw: grpc.stream_stream_rpc_method_handler(
                    self.StreamAggregatedResources, request_deserializer=None, response_serializer=None),
                delta: grpc.stream_stream_rpc_method_handler(
                    self.DeltaAggregatedResources, request_deserializer=None, response_serializer=None),
            }

        server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler(
                _SERVICE, handlers("StreamAggregatedResources", "DeltaAggregatedResources")),
            grpc.method_handlers_generic_handler(
                _EDS_SERVICE, handlers("StreamEndpoints", "DeltaEndpoints")),
            grpc.method_handlers_generic_handler(
                _CDS_SERVICE, handlers("StreamClusters", "DeltaClusters")),
        ))

    def _identity(self, context: grpc.aio.ServicerContext[bytes, bytes]) -> StreamIdentity:
        sid = next(self._ids)
        cert = None
        auth = context.auth_context()
        digest = peer_certificate_sha256(auth)
        if digest is not None:
            cert = ClientCertificate(tuple(peer_identities(auth)), digest)
        return StreamIdentity(sid, f"{self._boot}.{sid:x}.", self._clock(), cert)

    async def StreamAggregatedResources(  # gRPC method name
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> None:
        """State-of-the-world ADS: one stream per Envoy, all types multiplexed."""
        stream = SotwStream(self._identity(context), self.limits)
        await self._serve(stream, discovery_pb2.DiscoveryRequest, request_iterator, context)

    async def DeltaAggregatedResources(  # gRPC method name
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> None:
        """Delta (incremental) ADS: one stream per Envoy, all types multiplexed."""
        stream = DeltaStream(self._identity(context), self.limits)
        await self._serve(stream, discovery_pb2.DeltaDiscoveryRequest, request_iterator, context)

    # -- views -------------------------------------------------------------------------------

    def subscription_count(self) -> int:
        """Subscriptions held by all open streams (named resources + wildcards)."""
        return sum(s.subscription_count() for s in self.streams.values())

    def clients_view(self) -> dict[str, object]:
        """JSON-able ``/xds/clients``: every open stream (node, ACKed versions, last NACK), counts,
        and NACKs by node of the open streams (closed streams' node ids are not kept)."""
        streams = list(self.streams.values())
        return {
            "clients": [s.describe() for s in streams],
            "streams": len(streams),
            "subscriptions": self.subscription_count(),
            "nacks_by_node": [{"node": s.node_id, "variant": s.variant, "type": type_label(tu), "nacks": ts.nacks}
                              for s in streams for tu, ts in s.types.items() if ts.nacks],
        }

    def metric_families(self) -> Iterator[Metric]:
        """Prometheus metric families of the xDS server (see :class:`XdsStats`)."""
        return self.stats.families(self.streams.values(), self.subscription_count(), self.cache)

    # -- the stream loop ---------------------------------------------------------------------

    def _on_verdict(self, stream: AdsStream, verdict: RequestVerdict) -> None:
        label = type_label(verdict.type_url)
        self.stats.requests[(stream.variant, label, verdict.kind.value)] += 1
        # Per-Envoy lines (client text escaped): connect once per stream, ACK at most once per
        # stream and type per _LOG_INTERVAL_S; a client reconnecting in a loop is rate-limited too.
        client = for_log(stream.node_id or "?")
        if stream.stream_id not in self._announced:
            self._announced.add(stream.stream_id)
            self._client_log.log(logging.INFO, self._monotonic(), f"connect:{client[:64]}",
                                 "Envoy %s connected (%s stream %d)", client, stream.variant, stream.stream_id,
                                 extra={"client": stream.node_id or "?", "stream": stream.stream_id})
        if verdict.kind is Verdict.ACK:
            ts = stream.types.get(verdict.type_url)
            version = ts.acked_version if ts is not None else ""
            self._client_log.log(logging.INFO, self._monotonic(), f"ack:{stream.stream_id}:{label}",
                                 "Envoy %s ACKed %s version %s", client, label, for_log(version),
                                 extra={"client": stream.node_id or "?", "type": label, "version": version})
        if verdict.kind is Verdict.NACK:
            self.stats.nacks[(stream.variant, label)] += 1
            self._log.warning(self._monotonic(), f"nack:{stream.variant}:{label}",
                              "NACK from %s (%s stream %d) for %s nonce %s: %s", for_log(stream.node_id or "?"),
                              stream.variant, stream.stream_id, label, for_log(verdict.nonce),
                              for_log(verdict.detail, 500),
                              extra={"client": stream.node_id or "?", "type": label, "nonce": verdict.nonce,
                                     "reason": verdict.detail})

    def _reject(self, stream: AdsStream, err: _Rejected) -> None:
        self.stats.rejected[(stream.variant, err.reason)] += 1
        if err.reason == "permission_denied" and self.refusals is not None:
            return  # logged per identity by self.refusals
        self._log.log(logging.INFO, self._monotonic(), f"rejected:{stream.variant}:{err.reason}",
                      "ADS %s stream %d from %s ended (%s): %s", stream.variant, stream.stream_id,
                      for_log(stream.node_id or "?"), err.code.name, for_log(str(err), 300))

    async def _serve(self, stream: AdsStream,
                     request_cls: type[discovery_pb2.DiscoveryRequest] | type[discovery_pb2.DeltaDiscoveryRequest],
                     request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        # Ordering vs back-pressure: one writer per stream computes what is due right before
        # writing it. While a write waits on HTTP/2 flow control (a client that stopped reading),
        # changes only set `wake`; the next write then carries the latest state. Nothing queues
        # per stream, and no other stream waits on this one.
        self.streams[stream.stream_id] = stream
        self.stats.streams_opened += 1
        lim = self.config.limits
        budget = RequestBudget(lim.request_bytes_per_s, lim.request_burst_bytes, lim.request_cost_min_bytes,
                               self._monotonic())
        wake = asyncio.Event()
        failure: list[BaseException] = []
        unwatch = self.cache.watch(wake.set)

        async def reader() -> None:
            authorized = False
            try:
                async for raw in request_iterator:
                    wait_s = budget.wait_s(self._monotonic())
                    if wait_s > 0:
                        self.stats.throttled_s += wait_s
                        await asyncio.sleep(wait_s)
                    budget.charge(len(raw), self._monotonic())
                    try:
                        req = request_cls.FromString(raw)
                    except DecodeError as e:
                        await drain(request_iterator)  # the client reads our status, not INTERNAL
                        failure.append(_Rejected("undecodable", f"undecodable {request_cls.__name__}: {e}"))
                        return
                    if not authorized and self.authorize is not None:
                        node_id = clip(req.node.id, lim.client_text_max_chars) if req.HasField("node") else ""
                        cert = stream.client_certificate
                        refused = self.authorize(cert.names if cert is not None else (), node_id)
                        if refused is not None:
                            if self.refusals is not None:  # counted and logged per identity
                                self.refusals.refuse("xds", "node_allow", context.peer() or "?",
                                                     ", ".join(cert.names[:3]) if cert else "-",
                                                     f"node id {for_log(node_id, 100)!r}: {refused}")
                            await drain(request_iterator)
                            failure.append(_Rejected("permission_denied", refused, grpc.StatusCode.PERMISSION_DENIED))
                            return
                    authorized = True
                    try:
                        verdict = stream.on_request(req)
                    except ValueError as e:
                        await drain(request_iterator)
                        failure.append(_Rejected("invalid", str(e)))
                        return
                    self._on_verdict(stream, verdict)
                    if verdict.changed:
                        wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the client went away; the send loop ends too
                log.debug("ADS stream %d: read side ended: %r", stream.stream_id, e)
            finally:
                failure.append(EOFError())
                wake.set()

        reader_task = asyncio.create_task(reader(), name=f"ads-reader-{stream.stream_id}")
        try:
            while True:
                wake.clear()
                for plan in stream.plans(self.cache):
                    self.stats.responses[(stream.variant, type_label(plan.type_url))] += 1
                    await context.write(encode_response(plan, self.cache))
                if failure:
                    err = failure[0]
                    if isinstance(err, _Rejected):
                        self._reject(stream, err)
                        await context.abort(err.code, str(err))
                    return
                await wake.wait()
        finally:
            unwatch()
            reader_task.cancel()
            self.streams.pop(stream.stream_id, None)
            if stream.stream_id in self._announced:
                self._announced.discard(stream.stream_id)
                log.info("Envoy %s disconnected (%s stream %d)", for_log(stream.node_id or "?"), stream.variant,
                         stream.stream_id, extra={"client": stream.node_id or "?", "stream": stream.stream_id})
