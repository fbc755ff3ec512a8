"""Load reports shared between control-plane replicas (``lrs.peers``), so that every replica sums
every Envoy's reports exactly once whichever replica the Envoy's LRS stream landed on.

Each Envoy holds one LRS stream to one replica (the bootstrap's ``xds_cluster`` lists them all).
The replica that receives a report applies it and hands it to one :class:`PeerLink` per peer;
each link holds a bounded queue and one long-lived ``StreamLoadStats`` stream to the peer's xDS
port (the LRS service itself, so the peer's TLS, ``tls.node_allow``, request budget and report
limits apply as to an Envoy). The wire form, a plain ``LoadStatsRequest``:

- the stream's first request: ``node.id`` = this replica's ``xds.replica_id`` (the id a peer's
  ``tls.node_allow`` must allow for this replica's client certificate), ``node.metadata``
  ``{"sentinel_forwarded_by": replica_id}``; the peer answers its usual ``LoadStatsResponse``;
- one request per forwarded report: ``node.id`` = the reporting Envoy's node id, the same
  metadata marker, and the Envoy's ``cluster_stats`` unchanged.

No double counting: a report received on a forwarded stream is applied and never forwarded
again (:func:`forwarded_by` tells the two kinds apart), and an Envoy reports each interval once,
to the one replica its stream is on, so an Envoy that moves to another replica is still counted
once per report on every replica. Delivery is at most once: a report in flight when a peer stream
breaks, or offered while the queue is full, is dropped and counted (``queue_full``,
``send_failed``), never resent (a resend could count twice); one that waited longer than
``lrs.peer_max_delay`` (a peer down a while) is dropped too (``stale``: applied now it would
land in the wrong window). Offering never blocks the Envoy's stream. The redial backoff doubles
from 0.1 s to ``lrs.peer_backoff_max`` with jitter.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence, Set

import grpc
from envoy.service.load_stats.v3 import lrs_pb2
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from xds_server.config import LrsConfig, SentinelConfig, parse_hostport
from xds_server.process.cancellation import raise_if_cancelled
from xds_server.process.identity import PeerIdentity, refusal_reason
from xds_server.process.tls import ClientTls, dial
from xds_server.process.untrusted import clip

__all__ = ["MARKER", "PeerLink", "PeerSet", "forwarded_by", "host_addresses", "peer_refused", "source_ip"]

log = logging.getLogger(__name__)

MARKER = "sentinel_forwarded_by"
"""``node.metadata`` key of every request on a replica-to-replica stream (value: the sender's replica id)."""
_METHOD = "/envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats"
_BACKOFF_MIN_S = 0.1


def forwarded_by(req: lrs_pb2.LoadStatsRequest) -> str | None:
    """The replica id a request's node metadata names as its forwarder (clipped to 64
    characters), or None for a request from an Envoy (no marker, or a marker that is not a
    non-empty string)."""
    if not req.HasField("node") or MARKER not in req.node.metadata.fields:
        return None
    v = req.node.metadata.fields[MARKER]
    if v.WhichOneof("kind") != "string_value" or not v.string_value:
        return None
    return clip(v.string_value, 64)


def peer_refused(lrs: LrsConfig, own_id: str, mtls: bool, marker: str, *, names: Sequence[str],
                 source_ip: str | None, peer_ips: Set[str]) -> str | None:
    """Why a stream whose first request carries the forwarded marker ``marker`` is refused, or
    None when it is the listed peer it claims to be. ``lrs``: this replica's ``lrs`` section;
    ``own_id``: its ``xds.replica_id``; ``mtls``: ``tls.mode`` is mtls. ``names``: the typed identities of the
    client's verified certificate (:func:`~xds_server.process.tls.peer_identities`; empty
    without one); ``source_ip``: the connection's remote address; ``peer_ips``: the addresses the
    claimed peer's ``address`` host resolves to (empty when it is not listed or does not resolve).

    The rule (docs/replicas.md): this replica has ``lrs.peers``; the marker is not this replica's
    own id; it names a peer listed with that ``replica_id``; under ``tls.mode: mtls`` the
    certificate matches that peer's ``identity``, otherwise the connection comes from one of its
    host's addresses. A marker alone proves nothing: any client can write it."""
    if not lrs.peers:
        return "this replica has no lrs.peers: forwarded load reports are refused"
    if marker == own_id:
        return (f"forwarded by this replica's own id {marker!r}: lrs.peers lists this replica's own "
                "address, or two replicas share one xds.replica_id")
    peer = next((p for p in lrs.peers if p.replica_id == marker), None)
    if peer is None:
        listed = ", ".join(p.replica_id for p in lrs.peers if p.replica_id) or "none"
        return f"forwarded by {marker!r}, which no lrs.peers entry names as its replica_id (listed: {listed})"
    if mtls:
        if peer.identity is None:  # config: required under mtls
            return f"forwarded as {marker!r}: lrs.peers lists no identity for it"
        why = refusal_reason([peer.identity], PeerIdentity.from_names(names), f"lrs.peers ({marker}'s identity)")
        return None if why is None else f"forwarded as {marker!r}: {why}"
    if source_ip is None or source_ip not in peer_ips:
        return (f"forwarded as {marker!r} from {source_ip or 'an unknown address'}, not from its host "
                f"{parse_hostport(peer.address)[0]} ({', '.join(sorted(peer_ips)) or 'does not resolve'})")
    return None


def source_ip(peer: str) -> str | None:
    """The remote IP of a gRPC ``context.peer()`` string (``ipv4:10.0.0.2:5555``,
    ``ipv6:[::1]:5555``), None for any other form."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or None
    if kind == "ipv6" and rest.startswith("["):
        return rest[1:rest.find("]")] or None
    return None


async def host_addresses(address: str) -> frozenset[str]:
    """The IP addresses ``address``'s host (``HOST:PORT``) stands for: itself when it is one,
    else what the resolver answers (empty when it does not resolve)."""
    host = parse_hostport(address)[0].strip("[]")
    try:
        return frozenset({str(ipaddress.ip_address(host))})
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return frozenset()
    return frozenset(str(info[4][0]) for info in infos)


def _marked(replica_id: str, node_id: str) -> lrs_pb2.LoadStatsRequest:
    req = lrs_pb2.LoadStatsRequest()
    req.node.id = node_id
    req.node.metadata.fields[MARKER].string_value = replica_id
    return req


class PeerLink:
    """One peer replica at ``target`` (``HOST:PORT``): a bounded queue of encoded requests and the
    task that streams them (:meth:`run`). ``forwarded``: reports written to the stream;
    ``dropped``: reports lost by reason (``queue_full``, ``send_failed``, ``stale``); ``up``: the
    stream is open and the peer answered its first request; ``connects``: streams opened;
    ``last_error``. ``max_delay_s``: a report queued longer is dropped (s); ``monotonic``: clock (s)."""

    def __init__(self, target: str, replica_id: str, *, queue_max: int, tls: ClientTls | None = None,
                 backoff_max_s: float = 2.0, keepalive_s: float = 1.0, max_delay_s: float = 3.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.replica_id = replica_id
        self.tls = tls
        self.backoff_max_s = backoff_max_s
        self.max_delay_s = max_delay_s
        self.monotonic = monotonic
        self.options = [("grpc.keepalive_time_ms", round(keepalive_s * 1000)),
                        ("grpc.keepalive_timeout_ms", round(keepalive_s * 1000)),
                        ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(queue_max)
        self.forwarded = 0
        self.dropped: Counter[str] = Counter()
        self.up = False
        self.connects = 0
        self.last_error = ""

    def offer(self, raw: bytes) -> bool:
        """Queue one encoded request for the peer; False (counted ``queue_full``) when full."""
        try:
            self.queue.put_nowait((self.monotonic(), raw))
        except asyncio.QueueFull:
            self.dropped["queue_full"] += 1
            return False
        return True

    async def run(self) -> None:
        """Stream to the peer until cancelled, redialling with backoff after each failure."""
        backoff, logged = _BACKOFF_MIN_S, ""
        while True:
            try:
                try:
                    await self._stream()
                    self.last_error = "stream ended"
                except Exception as e:  # any failure of one stream: redial
                    self.last_error = _describe(e)
                raise_if_cancelled()  # a stop's cancel that a failed call swallowed ends the loop too
            except asyncio.CancelledError:
                self.up = False
                raise
            if self.up or self.last_error != logged:  # once per change, not at every redial
                log.warning("load reports to peer %s: stream %s (%s)", self.target,
                            "down" if self.up else "not up", self.last_error)
                logged = self.last_error
            if self.up:
                backoff = _BACKOFF_MIN_S
            self.up = False
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(self.backoff_max_s, backoff * 2)

    async def _stream(self) -> None:
        async with dial(self.target, options=self.options, tls=self.tls) as ch:
            call = ch.stream_stream(_METHOD, None, None)(None)  # bytes in, bytes out
            await call.write(_marked(self.replica_id, self.replica_id).SerializeToString())
            if await call.read() is grpc.aio.EOF:  # type: ignore[attr-defined]  # grpc-stubs 1.53 lacks it
                raise ConnectionError("the peer closed the stream before answering")
            # its LoadStatsResponse: it accepted us (a refusal raises AioRpcError above)
            self.up, self.connects = True, self.connects + 1
            log.info("load reports to peer %s: stream up", self.target)
            ended = asyncio.ensure_future(_drain(call))
            try:
                while True:
                    get = asyncio.ensure_future(self.queue.get())
                    await asyncio.wait({get, ended}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():  # not awaited: a stop's cancel arriving there would be swallowed
                        get.cancel()
                    if ended.done():
                        if get.done() and not get.cancelled():
                            self.dropped["send_failed"] += 1
                        exc = None if ended.cancelled() else ended.exception()
                        if exc is not None:
                            raise exc
                        return
                    queued_at, raw = get.result()
                    if self.monotonic() - queued_at > self.max_delay_s:
                        self.dropped["stale"] += 1
                        continue
                    try:
                        await call.write(raw)
                    except BaseException:
                        self.dropped["send_failed"] += 1
                        raise
                    self.forwarded += 1
            finally:
                ended.cancel()
                call.cancel()


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"[:300]
    return f"{type(e).__name__}: {e}"[:300]


async def _drain(call: grpc.aio.StreamStreamCall) -> None:
    """Read (and discard) the peer's responses until the stream ends."""
    while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]  # grpc-stubs 1.53 lacks it
        pass


class PeerSet:
    """The links to every ``lrs.peers`` entry of ``config`` (none: :meth:`forward` does nothing).
    ``received``: reports applied per forwarding replica id (at most 64 ids, more as ``other``)."""

    def __init__(self, config: SentinelConfig) -> None:
        lrs, self.replica_id = config.lrs, config.xds.replica_id
        self.links = [PeerLink(p, self.replica_id, queue_max=lrs.peer_queue,
                               tls=lrs.peer_tls.client(parse_hostport(p)[0]), backoff_max_s=lrs.peer_backoff_max.s,
                               keepalive_s=lrs.peer_keepalive.s, max_delay_s=lrs.peer_max_delay.s)
                      for p in lrs.peer_addresses()]
        self.received: Counter[str] = Counter()

    def start(self) -> list[asyncio.Task[None]]:
        """One task per peer (the caller cancels them at stop)."""
        return [asyncio.create_task(link.run(), name=f"lrs-peer-{link.target}") for link in self.links]

    def forward(self, reporter: str, req: lrs_pb2.LoadStatsRequest) -> None:
        """Offer the report ``req`` of Envoy ``reporter`` to every peer, marked as forwarded by us."""
        if not self.links:
            return
        fwd = _marked(self.replica_id, reporter)
        fwd.cluster_stats.extend(req.cluster_stats)
        raw = fwd.SerializeToString()
        for link in self.links:
            link.offer(raw)

    def count_received(self, replica: str) -> None:
        self.received[replica if replica in self.received or len(self.received) < 64 else "other"] += 1

    def metric_families(self) -> Iterator[Metric]:
        """Per peer: forwarded, dropped by reason, stream up, queue length; received per replica."""
        fwd = CounterMetricFamily("sentinel_lrs_peer_forwarded", "load reports forwarded to a peer replica "
                                  "(lrs.peers)", labels=["peer"])
        dropped = CounterMetricFamily("sentinel_lrs_peer_dropped", "load reports not forwarded to a peer, by "
                                      "reason (queue_full: lrs.peer_queue full; send_failed: in flight when the "
                                      "stream broke; stale: queued past lrs.peer_max_delay)",
                                      labels=["peer", "reason"])
        up = GaugeMetricFamily("sentinel_lrs_peer_up", "1 while the stream to the peer is open and accepted",
                               labels=["peer"])
        queued = GaugeMetricFamily("sentinel_lrs_peer_queue", "load reports waiting for the peer", labels=["peer"])
        for link in self.links:
            fwd.add_metric([link.target], link.forwarded)
            for reason in ("queue_full", "send_failed", "stale"):
                dropped.add_metric([link.target, reason], link.dropped[reason])
            up.add_metric([link.target], 1.0 if link.up else 0.0)
            queued.add_metric([link.target], link.queue.qsize())
        received = CounterMetricFamily("sentinel_lrs_peer_received", "load reports received from a peer "
                                       "replica and applied, by its replica id", labels=["replica"])
        for replica, n in sorted(self.received.items()):
            received.add_metric([replica], n)
        yield from (fwd, dropped, up, queued, received)

    def status(self) -> list[dict[str, object]]:
        """JSON per peer (target, up, forwarded, dropped, queued, connects, last_error)."""
        return [{"peer": link.target, "up": link.up, "forwarded": link.forwarded, "dropped": dict(link.dropped),
                 "queued": link.queue.qsize(), "connects": link.connects, "last_error": link.last_error or None}
                for link in self.links]
