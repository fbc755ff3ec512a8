"""State-of-the-world ADS server on grpc.aio (CDS + EDS).

Two layers, after the h2 style (STYLE.md):
- :class:`SotwStream` is the pure per-stream bookkeeping: it takes DiscoveryRequests and the
  cache contents and says which DiscoveryResponses to send. No I/O.
- :class:`AdsServicer` is the thin grpc.aio shell: one reader task per stream feeding requests
  in, one send loop waking on requests or cache changes.

Protocol rules implemented (notes/xds_protocol.md section 1; checklist numbers in brackets):
- every response has a fresh per-stream nonce [2]; versions are content hashes with the server
  id as prefix [13];
- an ACK gets no response unless content changed [3]; a NACK (``error_detail`` present) is
  recorded with its message and never answered with the same content [4, 5];
- a request whose ``response_nonce`` is not the last nonce sent for its type is stale and gets
  no response [6];
- CDS is full state and wildcard [10]; EDS is named: only requested names are sent [11], a name
  added to ``resource_names`` is sent even if sent before [7, 12], a name that does not exist
  yet is held and pushed once it exists [8];
- after a CDS push that adds or changes a cluster, that cluster's ClusterLoadAssignment is
  pushed again with a new nonce even if unchanged, or Envoy keeps it warming for 15 s [9];
- on a new stream everything requested is sent in full whatever ``version_info`` says [14];
- the node is taken from the first message [15]; a missing ``type_url`` is INVALID_ARGUMENT [16];
- a type we do not serve gets an empty response (so the client's subscription resolves).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from xds_server.xds.cache import SnapshotCache, version_of
from xds_server.xds.resources import CLA_TYPE_URL, CLUSTER_TYPE_URL

__all__ = ["AdsHooks", "AdsServicer", "SotwStream", "TypeState"]

log = logging.getLogger(__name__)

SERVED_TYPES = (CLUSTER_TYPE_URL, CLA_TYPE_URL)
_FULL_STATE = {CLUSTER_TYPE_URL}  # SotW types whose responses must carry every resource
_WILDCARD_TYPES = {CLUSTER_TYPE_URL}


@dataclass(slots=True)
class TypeState:
    """Per stream, per type_url bookkeeping."""

    type_url: str
    subscribed: set[str] = field(default_factory=set)
    wildcard: bool = False
    requested: bool = False              # the client has sent at least one request of this type
    last_nonce: str = ""                 # last nonce we sent for this type
    last_version_sent: str = ""
    sent: dict[str, str] = field(default_factory=dict)  # name -> resource version the client got
    force: set[str] = field(default_factory=set)        # names to re-push even if unchanged
    acked_version: str = ""
    nack_version: str = ""
    nack_message: str = ""
    nack_nonce: str = ""
    nacks: int = 0
    responses: int = 0
    unserved: bool = False               # a type we do not serve
    answered_unserved: bool = False


@dataclass(frozen=True, slots=True)
class RequestVerdict:
    """What a request was: ``kind`` in {"initial", "ack", "nack", "stale", "subscribe", "invalid"}."""

    kind: str
    type_url: str
    detail: str = ""


class SotwStream:
    """Pure bookkeeping of one SotW ADS stream.

    ``on_request(req)`` updates state and classifies the request; ``responses(cache)`` returns
    the DiscoveryResponses due now (possibly none) and records them as sent.
    """

    _ids = itertools.count(1)

    def __init__(self, server_id: str) -> None:
        self.stream_id = next(self._ids)
        self.server_id = server_id
        self.node_id = ""
        self.node_cluster = ""
        self.user_agent = ""
        self.types: dict[str, TypeState] = {}
        self._nonce = itertools.count(1)
        self.connected_at = time.time()
        self._cds_changed: list[str] = []  # clusters added or changed by the last CDS push

    def on_request(self, req: discovery_pb2.DiscoveryRequest) -> RequestVerdict:
        """Apply one DiscoveryRequest. Raises ValueError for a request with no type_url."""
        if not self.node_id and req.HasField("node"):
            self.node_id = req.node.id
            self.node_cluster = req.node.cluster
            self.user_agent = f"{req.node.user_agent_name} {req.node.user_agent_build_version.version.major_number}.{req.node.user_agent_build_version.version.minor_number}".strip()
        tu = req.type_url
        if not tu:
            raise ValueError("type_url is required for ADS")
        ts = self.types.get(tu)
        if ts is None:
            ts = self.types[tu] = TypeState(tu, unserved=tu not in SERVED_TYPES)
        names = set(req.resource_names)
        if req.response_nonce and req.response_nonce != ts.last_nonce:
            return RequestVerdict("stale", tu, f"nonce {req.response_nonce} != {ts.last_nonce}")
        first = not ts.requested
        ts.requested = True
        # Subscription (legacy wildcard: a client that never named a resource means "*").
        if tu in _WILDCARD_TYPES and (not names or "*" in names):
            ts.wildcard = True
            ts.subscribed = set()
        else:
            ts.wildcard = False
            added = names - ts.subscribed
            removed = ts.subscribed - names
            for n in added | removed:
                ts.sent.pop(n, None)  # a re-added name is sent again even if unchanged
            ts.subscribed = names
        if first or not req.response_nonce:
            return RequestVerdict("initial", tu)
        if req.HasField("error_detail"):
            ts.nack_version = req.version_info
            ts.nack_message = req.error_detail.message
            ts.nack_nonce = req.response_nonce
            ts.nacks += 1
            # The client kept its previous content: what we sent with this nonce is not held.
            ts.acked_version = req.version_info
            return RequestVerdict("nack", tu, req.error_detail.message)
        ts.acked_version = req.version_info
        return RequestVerdict("ack", tu)

    def _next_nonce(self) -> str:
        return str(next(self._nonce))

    def responses(self, cache: SnapshotCache) -> list[discovery_pb2.DiscoveryResponse]:
        """DiscoveryResponses due now, CDS before EDS. Records them as sent."""
        out: list[discovery_pb2.DiscoveryResponse] = []
        for tu in (CLUSTER_TYPE_URL, CLA_TYPE_URL):
            ts = self.types.get(tu)
            if ts is None or not ts.requested:
                continue
            resp = self._response_for(ts, cache)
            if resp is not None:
                out.append(resp)
                if tu == CLUSTER_TYPE_URL:
                    self._after_cds_push(resp, cache)
        for ts in self.types.values():
            if ts.unserved and ts.requested and not ts.answered_unserved:
                ts.answered_unserved = True
                nonce = self._next_nonce()
                ts.last_nonce = nonce
                out.append(discovery_pb2.DiscoveryResponse(
                    version_info=f"{self.server_id}-empty", type_url=ts.type_url, nonce=nonce))
        return out

    def _after_cds_push(self, resp: discovery_pb2.DiscoveryResponse, cache: SnapshotCache) -> None:
        # Envoy warms an added or changed cluster until it receives a CLA for it; push it again.
        eds = self.types.get(CLA_TYPE_URL)
        if eds is None:
            return
        for name in self._cds_changed:
            if name in eds.subscribed:
                eds.force.add(name)

    def _response_for(self, ts: TypeState, cache: SnapshotCache) -> discovery_pb2.DiscoveryResponse | None:
        res = cache.resources(ts.type_url)
        if ts.wildcard:
            wanted = res
        else:
            wanted = {n: res[n] for n in ts.subscribed if n in res}
        if ts.type_url in _FULL_STATE:
            state = {n: r.version for n, r in wanted.items()}
            if ts.last_nonce and state == ts.sent:
                return None
            changed = [n for n, v in state.items() if ts.sent.get(n) != v]
            self._cds_changed = changed
            send = list(wanted.values())
        else:
            send = [r for n, r in wanted.items() if ts.sent.get(n) != r.version or n in ts.force]
            if not send:
                return None
        version = version_of(((n, r.version) for n, r in wanted.items()), self.server_id)
        nonce = self._next_nonce()
        resp = discovery_pb2.DiscoveryResponse(
            version_info=version, type_url=ts.type_url, nonce=nonce,
            resources=[r.any for r in sorted(send, key=lambda r: r.name)],
        )
        ts.last_nonce = nonce
        ts.last_version_sent = version
        ts.responses += 1
        if ts.type_url in _FULL_STATE:
            ts.sent = {n: r.version for n, r in wanted.items()}
        else:
            for r in send:
                ts.sent[r.name] = r.version
        ts.force.clear()
        return resp

    def describe(self) -> dict:
        """JSON-able summary for the admin endpoint."""
        return {
            "stream_id": self.stream_id,
            "node_id": self.node_id,
            "node_cluster": self.node_cluster,
            "user_agent": self.user_agent,
            "connected_at": self.connected_at,
            "types": {
                tu.rsplit(".", 1)[-1]: {
                    "subscribed": sorted(ts.subscribed) if not ts.wildcard else ["*"],
                    "last_version_sent": ts.last_version_sent,
                    "last_nonce": ts.last_nonce,
                    "acked_version": ts.acked_version,
                    "responses": ts.responses,
                    "nacks": ts.nacks,
                    "last_nack": (
                        {"version": ts.nack_version, "nonce": ts.nack_nonce, "message": ts.nack_message}
                        if ts.nacks else None
                    ),
                }
                for tu, ts in self.types.items()
            },
        }


@dataclass
class AdsHooks:
    """Optional callbacks (plain values, not subclassing) for metrics and logs."""

    on_request: Callable[[SotwStream, RequestVerdict], None] | None = None
    on_response: Callable[[SotwStream, discovery_pb2.DiscoveryResponse], None] | None = None
    on_stream_open: Callable[[SotwStream], None] | None = None
    on_stream_close: Callable[[SotwStream], None] | None = None


class AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """grpc.aio servicer for SotW ADS over a :class:`SnapshotCache`.

    Delta ADS is not served yet (UNIMPLEMENTED, grpc's default).
    """

    def __init__(self, cache: SnapshotCache, hooks: AdsHooks | None = None) -> None:
        self.cache = cache
        self.hooks = hooks or AdsHooks()
        self.streams: dict[int, SotwStream] = {}

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        stream = SotwStream(self.cache.server_id)
        self.streams[stream.stream_id] = stream
        if self.hooks.on_stream_open:
            self.hooks.on_stream_open(stream)
        wake = asyncio.Event()
        failure: list[BaseException] = []

        async def reader() -> None:
            try:
                async for req in request_iterator:
                    try:
                        verdict = stream.on_request(req)
                    except ValueError as e:
                        failure.append(e)
                        wake.set()
                        return
                    if verdict.kind == "nack":
                        log.warning("NACK from %s for %s: %s", stream.node_id, req.type_url,
                                    req.error_detail.message[:500])
                    if self.hooks.on_request:
                        self.hooks.on_request(stream, verdict)
                    wake.set()
            except (asyncio.CancelledError, grpc.aio.AioRpcError):
                pass
            finally:
                failure.append(EOFError())
                wake.set()

        reader_task = asyncio.create_task(reader(), name=f"ads-reader-{stream.stream_id}")
        try:
            while True:
                changed = self.cache.changed_event()
                for resp in stream.responses(self.cache):
                    if self.hooks.on_response:
                        self.hooks.on_response(stream, resp)
                    yield resp
                if failure:
                    err = failure[0]
                    if isinstance(err, ValueError):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
                    return
                if changed.is_set():
                    continue
                waiter = asyncio.ensure_future(changed.wait())
                woke = asyncio.ensure_future(wake.wait())
                try:
                    await asyncio.wait({waiter, woke}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                    woke.cancel()
                wake.clear()
        finally:
            reader_task.cancel()
            self.streams.pop(stream.stream_id, None)
            if self.hooks.on_stream_close:
                self.hooks.on_stream_close(stream)
