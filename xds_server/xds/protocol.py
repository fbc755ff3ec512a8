"""Per-stream ADS bookkeeping shared by SotW and delta: verdicts, response plans, ACK/NACK state,
node identity, nonces and the CDS -> EDS re-push rule. Pure: no I/O, no clock, no randomness.

Everything a stream needs from outside is injected when it is made (:class:`StreamIdentity`:
stream id, nonce prefix, connection time, the connection's :class:`ClientCertificate`;
:class:`StreamLimits`: bounds from config), so a test
builds a stream in memory and drives it with protobuf requests and a
:class:`~xds_server.xds.cache.SnapshotCache`.

Shape::

    ident = StreamIdentity(stream_id=1, nonce_prefix="a1b2c3.1.", connected_at_s=0.0)
    stream = SotwStream(ident)                  # or DeltaStream
    verdict = stream.on_request(req)                        # RequestVerdict (kind: Verdict)
    plans = stream.plans(cache)                             # list[ResponsePlan], recorded as sent

Protocol rules: see :mod:`xds_server.xds.sotw` and :mod:`xds_server.xds.delta`.
"""
from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from envoy.service.discovery.v3 import discovery_pb2

from xds_server.config import XdsConfig
from xds_server.process.untrusted import clip
from xds_server.xds.cache import CachedResource, SnapshotCache
from xds_server.xds.resources import CLUSTER_TYPE_URL, RESOURCE_TYPES, type_label

__all__ = [
    "AckState",
    "ClientCertificate",
    "RequestVerdict",
    "ResponsePlan",
    "StreamIdentity",
    "StreamLimits",
    "Verdict",
]


class Verdict(enum.Enum):
    """What one request was (the value is the metric label ``kind``)."""

    INITIAL = "initial"            # first request of a type (SotW: also an empty nonce = start over)
    ACK = "ack"
    NACK = "nack"
    STALE = "stale"                # SotW: ignored; delta: unknown nonce, subscription changes applied
    SUBSCRIBE = "subscribe"        # delta: a spontaneous subscription change (empty nonce)
    UNKNOWN_TYPE = "unknown_type"  # a type we do not serve


@dataclass(frozen=True, slots=True)
class RequestVerdict:
    """What a request was: ``kind``, its ``type_url``, ``detail`` (the NACK message or why it was
    stale; client text, clipped), ``nonce`` (the request's ``response_nonce``, client text: escape
    it before logging). ``changed`` is False for a request that cannot make a response due (a bare
    ACK or NACK, a stale SotW request): the send loop is not woken."""

    kind: Verdict
    type_url: str
    detail: str = ""
    nonce: str = ""
    changed: bool = True


@dataclass(frozen=True, slots=True)
class ResponsePlan:
    """One response due on a stream, before encoding: the pure layer's output.

    ``variant`` "sotw" or "delta"; ``version`` is ``version_info`` (SotW) or
    ``system_version_info`` (delta); ``resources`` are cache entries (shared, encoded once);
    ``removed`` is delta's ``removed_resources``. :mod:`xds_server.xds.encoding` turns it into
    wire bytes.
    """

    variant: str
    type_url: str
    version: str
    nonce: str
    resources: tuple[CachedResource, ...] = ()
    removed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StreamIdentity:
    """What the shell hands a new stream: ``stream_id`` (unique per servicer), ``nonce_prefix``
    (unique per stream and process start: nonces are ``<prefix><n>``), ``connected_at_s`` (unix s),
    ``client_certificate`` (the certificate the client's TLS connection presented; None without
    one)."""

    stream_id: int
    nonce_prefix: str
    connected_at_s: float
    client_certificate: ClientCertificate | None = None


@dataclass(frozen=True, slots=True)
class ClientCertificate:
    """A client's verified TLS certificate: ``names`` (URI SANs such as SPIFFE ids, DNS SANs, the
    common name) and ``sha256`` (hex SHA-256 of its DER encoding: ``openssl x509 -noout
    -fingerprint -sha256`` without the colons), which tells a rotated certificate from the old one
    when the names stay."""

    names: tuple[str, ...]
    sha256: str

    def view(self) -> dict[str, object]:
        return {"names": list(self.names), "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """Bounds on what one client can make a stream hold (defaults: :class:`~xds_server.config.XdsConfig`).

    ``max_types``: distinct type_urls per stream; ``max_tracked_nonces``: delta un-ACKed nonces
    per type; ``max_names``: subscribed names per stream, all types; ``text_max_chars``: node id,
    node cluster, user agent, versions kept from a client; ``nack_message_max_chars``: a NACK's
    ``error_detail.message`` as kept; ``view_max_names``: subscribed names listed per type by
    ``describe()`` (the count is always given); ``max_absent_names``: SotW names that exist
    nowhere answered with a stand-in, per type (``xds.limits.absent_names_max_per_stream``).
    """

    max_types: int = 32
    max_tracked_nonces: int = 16
    max_names: int = 200_000
    text_max_chars: int = 256
    nack_message_max_chars: int = 1024
    view_max_names: int = 100
    max_absent_names: int = 1000

    @classmethod
    def from_config(cls, xds: XdsConfig) -> StreamLimits:
        """From an :class:`~xds_server.config.XdsConfig`."""
        return cls(max_types=xds.limits.max_types_per_stream, max_tracked_nonces=xds.limits.max_tracked_nonces,
                   max_names=xds.limits.max_names_per_stream, text_max_chars=xds.limits.client_text_max_chars,
                   nack_message_max_chars=xds.limits.nack_message_max_chars,
                   view_max_names=xds.limits.clients_view_max_names,
                   max_absent_names=xds.limits.absent_names_max_per_stream)


@dataclass(slots=True)
class AckState:
    """ACK/NACK bookkeeping shared by both variants (per stream, per type)."""

    last_nonce: str = ""                 # last nonce we sent for this type
    last_version_sent: str = ""
    acked_version: str = ""
    acked_nonce: str = ""
    nack_version: str = ""
    nack_message: str = ""
    nack_nonce: str = ""
    nacks: int = 0
    acks: int = 0
    responses: int = 0

    def ack_view(self) -> dict[str, object]:
        return {
            "last_version_sent": self.last_version_sent,
            "last_nonce": self.last_nonce,
            "acked_version": self.acked_version,
            "acked_nonce": self.acked_nonce,
            "responses": self.responses,
            "acks": self.acks,
            "nacks": self.nacks,
            "last_nack": (
                {"version": self.nack_version, "nonce": self.nack_nonce, "message": self.nack_message}
                if self.nacks else None
            ),
        }


class TypeStateLike(Protocol):
    """What :class:`StreamBase` reads of a variant's per-type state (both are :class:`AckState` s)."""

    subscribed: set[str]
    wildcard: bool
    sent: dict[str, str]
    last_nonce: str
    acked_nonce: str


_S = TypeVar("_S", bound=TypeStateLike)
_S_co = TypeVar("_S_co", bound=TypeStateLike, covariant=True)
_T = TypeVar("_T")


class TypeStateFactory(Protocol[_S_co]):
    """A variant's per-type state class, called as in :meth:`StreamBase._begin`."""

    def __call__(self, *, type_url: str, unserved: bool) -> _S_co: ...


class StreamBase(Generic[_S]):
    """Node identity, nonces and the CDS -> EDS re-push rule, shared by both variants.

    Subclasses set ``variant`` and ``types`` (type_url -> per-type state ``_S`` with ``subscribed``
    and ``wildcard``).
    """

    variant = ""

    def __init__(self, ident: StreamIdentity, limits: StreamLimits | None = None) -> None:
        self.stream_id = ident.stream_id
        self.limits = limits or StreamLimits()
        self.node_id = ""
        self.node_cluster = ""
        self.user_agent = ""
        self.connected_at = ident.connected_at_s
        self.client_certificate = ident.client_certificate
        self.types: dict[str, _S] = {}
        self._nonce = itertools.count(1)
        self._nonce_prefix = ident.nonce_prefix
        # Clusters added or changed by a CDS push whose assignment has not been pushed since.
        self._eds_owed: set[str] = set()

    def _take_node(self, req: discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest) -> None:
        if not self.node_id and req.HasField("node"):
            n = req.node
            cap = self.limits.text_max_chars
            self.node_id = clip(n.id, cap)
            self.node_cluster = clip(n.cluster, cap)
            v = n.user_agent_build_version.version
            ver = f"{v.major_number}.{v.minor_number}.{v.patch} " if n.HasField("user_agent_build_version") else ""
            self.user_agent = clip(f"{n.user_agent_name} {ver}".strip(), cap)

    def _begin(self, req: discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest,
               state_cls: TypeStateFactory[_S]) -> tuple[str, _S]:
        """Common start of on_request: take the node, require a type_url, find or create the
        type's state. Raises ValueError for no type_url, one longer than ``text_max_chars`` or
        more than ``max_types`` types on one stream."""
        self._take_node(req)
        tu = req.type_url
        if not tu:
            raise ValueError("type_url is required for ADS")
        ts = self.types.get(tu)
        if ts is None:
            if len(tu) > self.limits.text_max_chars:
                raise ValueError(f"type_url longer than {self.limits.text_max_chars} characters")
            if len(self.types) >= self.limits.max_types:
                raise ValueError(f"more than {self.limits.max_types} type_urls on one stream")
            ts = self.types[tu] = state_cls(type_url=tu, unserved=tu not in RESOURCE_TYPES)
        return tu, ts

    def _check_names(self) -> None:
        """Raises ValueError when the stream holds more than ``max_names`` subscribed names."""
        if self.subscription_count() > self.limits.max_names:
            raise ValueError(f"more than {self.limits.max_names} subscribed names on one stream")

    def _next_nonce(self) -> str:
        return f"{self._nonce_prefix}{next(self._nonce)}"

    def _text(self, s: str) -> str:
        return clip(s, self.limits.text_max_chars) if s else s

    def _owe_eds(self, eds_subscribed: set[str], force: set[str], cache: SnapshotCache) -> None:
        """Move owed re-pushes of subscribed clusters into the EDS ``force`` set (checklist 9)."""
        if not self._eds_owed:
            return
        clusters = cache.resources(CLUSTER_TYPE_URL)
        self._eds_owed &= clusters.keys()
        due = self._eds_owed & eds_subscribed
        force |= due
        self._eds_owed -= due

    @staticmethod
    def _generations(cache: SnapshotCache, type_url: str) -> tuple[int, int]:
        rtype = RESOURCE_TYPES.get(type_url)
        parent = rtype.parent_type_url if rtype is not None else None
        return cache.type_generation(type_url), cache.type_generation(parent) if parent else 0

    def subscription_count(self) -> int:
        """Subscriptions held: named resources plus one per wildcard type."""
        return sum(len(ts.subscribed) + (1 if ts.wildcard else 0) for ts in self.types.values())

    def _base_view(self) -> dict[str, object]:
        return {
            "stream_id": self.stream_id,
            "variant": self.variant,
            "node_id": self.node_id,
            "node_cluster": self.node_cluster,
            "user_agent": self.user_agent,
            "connected_at": self.connected_at,
            "client_certificate": self.client_certificate.view() if self.client_certificate else None,
        }

    def _subscribed_view(self, ts: _S) -> dict[str, object]:
        star = ["*"] if ts.wildcard else []
        shown = (star + heapq.nsmallest(self.limits.view_max_names, ts.subscribed))[: self.limits.view_max_names]
        return {"subscribed": shown, "subscribed_count": len(star) + len(ts.subscribed)}

    def _held_view(self, ts: _S) -> dict[str, object]:
        """What the client holds per resource: ``resource_versions`` (name -> the resource version
        sent, the same format as ``/clusters``' ``xds_version``; the first ``view_max_names``
        names) and ``resources_acked`` (the client ACKed the last response of this type)."""
        names = heapq.nsmallest(self.limits.view_max_names, ts.sent)
        return {"resource_versions": {n: ts.sent[n] for n in names},
                "resources_acked": bool(ts.last_nonce) and ts.acked_nonce == ts.last_nonce}

    @staticmethod
    def _view_key(type_url: str) -> str:
        # /xds/clients keys served types by their label, others by their (bounded) type_url.
        label = type_label(type_url)
        return label if label != "unknown" else type_url


def small_first(a: Collection[_T], b: Collection[_T]) -> tuple[Collection[_T], Collection[_T]]:
    """``(smaller, larger)`` of two sized containers: iterate the smaller, look up in the larger."""
    return (a, b) if len(a) <= len(b) else (b, a)
