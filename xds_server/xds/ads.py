"""Aggregated Discovery Service on grpc.aio: state-of-the-world and delta (incremental), CDS + EDS.

Two layers, after the h2 style (STYLE.md):
- :class:`SotwStream` and :class:`DeltaStream` are the pure per-stream bookkeeping. Each takes
  requests through ``on_request(req) -> RequestVerdict`` and says, from the cache contents,
  which responses are due now with ``responses(cache) -> list[response]``. No I/O, no clock.
- :class:`AdsServicer` is the thin grpc.aio shell, the same for both variants: one reader task
  per stream feeds requests in; the send loop wakes on a request or a cache change, asks the
  stream what is due and writes it. Responses are computed just before they are written, so a
  slow reader holds at most one response in flight and then gets the latest state (coalesced),
  never a backlog; other streams never wait on it.

Protocol rules (notes/xds_protocol.md section 1; checklist 1.9 numbers in brackets):

Both variants
- every response carries a nonce unique per stream, and never reused by a later stream or a
  restarted server (a per-process random prefix) [2, 19]; versions are content hashes with the
  server id as prefix [13];
- CDS is pushed before EDS on one stream [27]; after a CDS push that adds or changes a cluster,
  that cluster's ClusterLoadAssignment is pushed again with a new nonce even if unchanged, or
  Envoy keeps the cluster warming for ``initial_fetch_timeout`` (15 s) [9];
- an EDS name whose cluster exists but whose assignment is not published yet (warm-up gate) is
  held, never reported missing; it is pushed once it exists [8];
- a NACK (``error_detail`` present) is recorded with nonce, version and message, logged and
  counted; the rejected content is not sent again, only newer content is [4, 5, 29];
- the node is taken from the first message [15]; a missing ``type_url`` is INVALID_ARGUMENT [16];
  only requested types are sent [18]; a type we do not serve is answered as an empty type
  (SotW: one empty response; delta: an empty first response and ``removed_resources`` for every
  name asked for), never by dropping the stream.

SotW
- an ACK gets no response unless content changed [3]; a request whose ``response_nonce`` is not
  the last nonce sent for its type is stale and ignored [6];
- CDS is full state and (legacy) wildcard [10]; EDS is named: only requested names are sent [11];
  a name added to ``resource_names`` is sent even if sent before [7, 12];
- on a new stream everything requested is sent in full whatever ``version_info`` says [14].

Delta
- subscription changes are applied whatever the nonce (stale or empty) [20]; every name in
  ``resource_names_subscribe`` is answered, with the resource or in ``removed_resources`` when it
  does not exist, even if the client should already have it [21];
- ``initial_resource_versions`` (first request per type of a reconnected stream) seeds what the
  client holds: matching versions are not resent, changed ones are, gone ones are listed in
  ``removed_resources`` [22]; resources carry name and version [23];
- legacy wildcard for CDS (first request with no names); unsubscribing a name while ``"*"`` is
  held is answered with the resource or its removal [24]; an unsubscribe-only request gets no
  response and the name stops being tracked [25]; removed clusters are listed in
  ``removed_resources`` [23]. EDS ``removed_resources`` does not clear Envoy's endpoints: the
  control plane drains with an empty assignment instead [26] (resources.build_empty_cla).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Union

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from xds_server.xds.cache import CachedResource, SnapshotCache
from xds_server.xds.resources import CLA_TYPE_URL, CLUSTER_TYPE_URL, RESOURCE_TYPES

__all__ = [
    "AdsHooks",
    "AdsServicer",
    "DeltaStream",
    "DeltaTypeState",
    "encode_response",
    "RequestVerdict",
    "ResponsePlan",
    "SERVED_TYPES",
    "SotwStream",
    "TypeState",
]

log = logging.getLogger(__name__)

SERVED_TYPES = tuple(RESOURCE_TYPES)  # CDS before EDS: make-before-break order
_BOOT = secrets.token_hex(3)          # nonce prefix of this process: nonces never repeat after a restart
MAX_TYPES_PER_STREAM = 32             # distinct type_urls one stream may ask for (Envoy uses a handful)


def short_type(type_url: str) -> str:
    """``type.googleapis.com/envoy.config.cluster.v3.Cluster`` -> ``Cluster``."""
    return type_url.rsplit(".", 1)[-1]


def _metric_type(type_url: str) -> str:
    # Metric label: served types by name, everything else "unknown" (labels stay bounded).
    return short_type(type_url) if type_url in RESOURCE_TYPES else "unknown"


def _check_type_count(types: dict) -> None:
    if len(types) >= MAX_TYPES_PER_STREAM:
        raise ValueError(f"more than {MAX_TYPES_PER_STREAM} type_urls on one stream")


@dataclass(frozen=True, slots=True)
class RequestVerdict:
    """What a request was.

    ``kind``: "initial" (first request of a type, or SotW empty nonce), "ack", "nack",
    "stale" (SotW: ignored; delta: unknown nonce, subscription changes still applied),
    "subscribe" (delta: spontaneous subscription change, empty nonce) or "unknown_type"
    (a type we do not serve). ``nonce`` is the request's ``response_nonce``; ``detail`` the NACK
    message or why the request was stale. ``changed`` is False for a request that cannot make
    a response due (a bare ACK or NACK, a stale SotW request): the send loop is not woken.
    """

    kind: str
    type_url: str
    detail: str = ""
    nonce: str = ""
    changed: bool = True  # the request may make a response due (the shell wakes the sender)


@dataclass(frozen=True, slots=True)
class ResponsePlan:
    """One response due on a stream, before encoding: the pure layer's output.

    ``variant`` "sotw" or "delta"; ``version`` is ``version_info`` (SotW) or
    ``system_version_info`` (delta); ``resources`` are cache entries (shared, encoded once);
    ``removed`` is delta's ``removed_resources``. :meth:`message` builds the protobuf response;
    :func:`encode_response` builds its wire bytes sharing the body between streams.
    """

    variant: str
    type_url: str
    version: str
    nonce: str
    resources: tuple[CachedResource, ...] = ()
    removed: tuple[str, ...] = ()

    def message(self, with_nonce: bool = True):
        """The DiscoveryResponse (SotW) or DeltaDiscoveryResponse (delta)."""
        nonce = self.nonce if with_nonce else ""
        if self.variant == "sotw":
            return discovery_pb2.DiscoveryResponse(
                version_info=self.version, type_url=self.type_url, nonce=nonce,
                resources=[r.any for r in self.resources])
        return discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=self.version, type_url=self.type_url, nonce=nonce,
            resources=[discovery_pb2.Resource(name=r.name, version=r.version, resource=r.any)
                       for r in self.resources],
            removed_resources=list(self.removed))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_NONCE_TAG = b"\x2a"  # field 5 (nonce in DiscoveryResponse and DeltaDiscoveryResponse), length-delimited
_MAX_MEMO = 256


def encode_response(plan: ResponsePlan, cache: SnapshotCache) -> bytes:
    """Wire bytes of ``plan``'s response. The body (everything but the nonce) is serialized once
    per distinct content and shared by every stream that sends the same thing (memoized in the
    cache until the type changes); each stream adds only its nonce field, which protobuf allows
    anywhere in a message. A push of one assignment to 1,000 streams serializes it once."""
    nonce = plan.nonce.encode()
    if plan.type_url not in RESOURCE_TYPES:  # an empty answer to a type we do not serve: no memo
        return plan.message().SerializeToString()
    memo = cache.memo(plan.type_url)
    key = (plan.variant, plan.version, tuple(r.name for r in plan.resources), plan.removed)
    body = memo.get(key)
    if body is None:
        if len(memo) >= _MAX_MEMO:
            memo.clear()
        body = memo[key] = plan.message(with_nonce=False).SerializeToString()
    return b"".join((body, _NONCE_TAG, _varint(len(nonce)), nonce))


@dataclass(slots=True)
class _AckState:
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

    def ack_view(self) -> dict:
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


@dataclass(slots=True)
class TypeState(_AckState):
    """SotW: per stream, per type_url bookkeeping."""

    type_url: str = ""
    subscribed: set[str] = field(default_factory=set)
    wildcard: bool = False
    legacy_wildcard: bool = True         # the client has never named a resource of this type
    requested: bool = False              # the client has sent at least one request of this type
    sent: dict[str, str] = field(default_factory=dict)  # name -> resource version the client got
    force: set[str] = field(default_factory=set)        # names to re-push even if unchanged
    unserved: bool = False               # a type we do not serve
    answered_unserved: bool = False
    dirty: bool = True                   # subscription changed since responses() last looked
    seen: tuple[int, int] = (-1, -1)     # cache generations (type, parent type) last looked at


@dataclass(slots=True)
class DeltaTypeState(_AckState):
    """Delta: per stream, per type_url bookkeeping.

    ``sent`` is what the client holds as far as we know (name -> version), seeded from
    ``initial_resource_versions``; ``must_answer`` holds names that must be answered even if
    unchanged (explicit subscribes); ``force`` names re-pushed after a CDS change;
    ``outstanding`` maps nonces not yet ACKed to the ``system_version_info`` they carried.
    """

    type_url: str = ""
    subscribed: set[str] = field(default_factory=set)
    wildcard: bool = False
    legacy_wildcard: bool = True
    requested: bool = False
    unserved: bool = False
    sent: dict[str, str] = field(default_factory=dict)
    must_answer: set[str] = field(default_factory=set)
    force: set[str] = field(default_factory=set)
    answer_empty: bool = False
    outstanding: collections.OrderedDict[str, str] = field(default_factory=collections.OrderedDict)
    removed_sent: int = 0
    dirty: bool = True
    seen: tuple[int, int] = (-1, -1)


class _StreamBase:
    """Node identity, nonces and the CDS -> EDS re-push rule, shared by both variants."""

    variant = ""
    _ids = itertools.count(1)

    def __init__(self, server_id: str) -> None:
        self.stream_id = next(self._ids)
        self.server_id = server_id
        self.node_id = ""
        self.node_cluster = ""
        self.user_agent = ""
        self._nonce = itertools.count(1)
        self._nonce_prefix = f"{_BOOT}.{self.stream_id:x}."
        self.connected_at = time.time()
        # Clusters added or changed by a CDS push whose assignment has not been pushed since.
        self._eds_owed: set[str] = set()

    def _take_node(self, req) -> None:
        if not self.node_id and req.HasField("node"):
            n = req.node
            self.node_id = n.id
            self.node_cluster = n.cluster
            v = n.user_agent_build_version.version
            ver = f"{v.major_number}.{v.minor_number}.{v.patch} " if n.HasField("user_agent_build_version") else ""
            self.user_agent = f"{n.user_agent_name} {ver}".strip()

    def _begin(self, req, state_cls):
        """Common start of on_request: take the node, require a type_url, find or create the
        type's state. Raises ValueError for no type_url or too many types on one stream."""
        self._take_node(req)
        tu = req.type_url
        if not tu:
            raise ValueError("type_url is required for ADS")
        ts = self.types.get(tu)
        if ts is None:
            _check_type_count(self.types)
            ts = self.types[tu] = state_cls(type_url=tu, unserved=tu not in RESOURCE_TYPES)
        return tu, ts

    def _next_nonce(self) -> str:
        return f"{self._nonce_prefix}{next(self._nonce)}"

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

    def _base_view(self) -> dict:
        return {
            "stream_id": self.stream_id,
            "variant": self.variant,
            "node_id": self.node_id,
            "node_cluster": self.node_cluster,
            "user_agent": self.user_agent,
            "connected_at": self.connected_at,
        }


class SotwStream(_StreamBase):
    """Pure bookkeeping of one state-of-the-world ADS stream.

    ``on_request(req)`` updates state and classifies the request (raises ValueError when
    ``type_url`` is missing); ``responses(cache)`` returns the DiscoveryResponses due now (maybe
    none), CDS first, and records them as sent.
    """

    variant = "sotw"

    def __init__(self, server_id: str) -> None:
        super().__init__(server_id)
        self.types: dict[str, TypeState] = {}

    def on_request(self, req: discovery_pb2.DiscoveryRequest) -> RequestVerdict:
        """Apply one DiscoveryRequest. Raises ValueError (the shell answers INVALID_ARGUMENT) for a
        request with no type_url or a stream asking for more than MAX_TYPES_PER_STREAM types."""
        tu, ts = self._begin(req, TypeState)
        nonce = req.response_nonce
        if nonce and nonce != ts.last_nonce:
            return RequestVerdict("stale", tu, f"nonce {nonce} is not the last sent ({ts.last_nonce})", nonce,
                                  changed=False)
        first = not ts.requested
        ts.requested = True
        before = (ts.wildcard, frozenset(ts.subscribed))
        if not nonce and not first:
            ts.sent.clear()  # the client starts over for this type: send it everything again
        rtype = RESOURCE_TYPES.get(tu)
        names = set(req.resource_names)
        if names:
            ts.legacy_wildcard = False
        if rtype is not None and rtype.wildcard and ("*" in names or (not names and ts.legacy_wildcard)):
            ts.wildcard = True
            ts.subscribed = names - {"*"}
        else:
            ts.wildcard = False
            for n in names ^ ts.subscribed:
                ts.sent.pop(n, None)  # a re-added name is sent again even if unchanged
                ts.force.discard(n)
            ts.subscribed = names
        changed = first or not nonce or before != (ts.wildcard, frozenset(ts.subscribed))
        ts.dirty = ts.dirty or changed
        if ts.unserved:
            return RequestVerdict("unknown_type", tu, nonce=nonce, changed=changed)
        if first or not nonce:
            return RequestVerdict("initial", tu)
        if req.HasField("error_detail"):
            ts.nack_version = req.version_info
            ts.nack_message = req.error_detail.message
            ts.nack_nonce = nonce
            ts.nacks += 1
            ts.acked_version = req.version_info  # the client kept its previous content
            return RequestVerdict("nack", tu, req.error_detail.message, nonce, changed=changed)
        ts.acked_version = req.version_info
        ts.acked_nonce = nonce
        ts.acks += 1
        return RequestVerdict("ack", tu, nonce=nonce, changed=changed)

    def responses(self, cache: SnapshotCache) -> list[discovery_pb2.DiscoveryResponse]:
        """DiscoveryResponses due now, CDS before EDS. Records them as sent."""
        return [p.message() for p in self.plans(cache)]

    def plans(self, cache: SnapshotCache) -> list[ResponsePlan]:
        """The responses due now as :class:`ResponsePlan`, CDS before EDS. Records them as sent."""
        out: list[ResponsePlan] = []
        for tu in SERVED_TYPES:
            ts = self.types.get(tu)
            if ts is None or not ts.requested:
                continue
            if tu == CLA_TYPE_URL:
                self._owe_eds(ts.subscribed, ts.force, cache)
            gens = self._generations(cache, tu)
            if not ts.dirty and not ts.force and gens == ts.seen:
                continue  # nothing this type depends on changed since the last look
            ts.dirty, ts.seen = False, gens
            resp = self._response_for(ts, cache)
            if resp is not None:
                out.append(resp)
        for ts in self.types.values():
            if ts.unserved and ts.requested and not ts.answered_unserved:
                ts.answered_unserved = True
                nonce = self._next_nonce()
                ts.last_nonce = nonce
                ts.last_version_sent = f"{self.server_id}-empty"
                ts.responses += 1
                out.append(ResponsePlan("sotw", ts.type_url, ts.last_version_sent, nonce))
        return out

    def _response_for(self, ts: TypeState, cache: SnapshotCache) -> ResponsePlan | None:
        res = cache.resources(ts.type_url)
        if ts.wildcard:
            wanted = dict(res)
        else:
            wanted = {n: res[n] for n in ts.subscribed if n in res}
        full_state = RESOURCE_TYPES[ts.type_url].sotw_full_state
        if full_state:
            state = {n: r.version for n, r in wanted.items()}
            if ts.last_nonce and state == ts.sent:
                return None
            send = list(wanted.values())
            if ts.type_url == CLUSTER_TYPE_URL:
                self._eds_owed |= {n for n, v in state.items() if ts.sent.get(n) != v}
        else:
            send = [r for n, r in wanted.items() if ts.sent.get(n) != r.version or n in ts.force]
            if not send:
                return None
        if ts.wildcard:
            version = cache.type_version(ts.type_url)
        else:
            version = cache.subset_version(ts.type_url, frozenset(ts.subscribed))
        nonce = self._next_nonce()
        resp = ResponsePlan("sotw", ts.type_url, version, nonce, tuple(sorted(send, key=lambda r: r.name)))
        ts.last_nonce = nonce
        ts.last_version_sent = version
        ts.responses += 1
        if full_state:
            ts.sent = {n: r.version for n, r in wanted.items()}
        else:
            for r in send:
                ts.sent[r.name] = r.version
                ts.force.discard(r.name)
        return resp

    def describe(self) -> dict:
        """JSON-able summary for the admin endpoint (``/xds/clients``)."""
        view = self._base_view()
        view["types"] = {
            short_type(tu): {
                "subscribed": (["*"] if ts.wildcard else []) + sorted(ts.subscribed),
                **ts.ack_view(),
            }
            for tu, ts in self.types.items()
        }
        return view


class DeltaStream(_StreamBase):
    """Pure bookkeeping of one delta (incremental) ADS stream.

    ``on_request(req)`` applies a DeltaDiscoveryRequest (subscription changes always, whatever
    the nonce) and classifies it (raises ValueError when ``type_url`` is missing);
    ``responses(cache)`` returns the DeltaDiscoveryResponses due now (maybe none), CDS first,
    and records what the client now holds.
    """

    variant = "delta"

    def __init__(self, server_id: str, max_tracked_nonces: int = 16) -> None:
        super().__init__(server_id)
        self.types: dict[str, DeltaTypeState] = {}
        self.max_tracked_nonces = max_tracked_nonces

    def on_request(self, req: discovery_pb2.DeltaDiscoveryRequest) -> RequestVerdict:
        """Apply one DeltaDiscoveryRequest. Raises ValueError (INVALID_ARGUMENT) for a request with
        no type_url or a stream asking for more than MAX_TYPES_PER_STREAM types."""
        tu, ts = self._begin(req, DeltaTypeState)
        rtype = RESOURCE_TYPES.get(tu)
        # A type we do not know: let a first empty request be legacy wildcard, so it gets an
        # (empty) answer, and every name asked for gets removed_resources.
        wildcard_ok = rtype.wildcard if rtype is not None else True
        first = not ts.requested
        ts.requested = True
        subscribe = list(req.resource_names_subscribe)
        changed = first or bool(subscribe) or bool(req.resource_names_unsubscribe)
        ts.dirty = ts.dirty or changed
        initial = dict(req.initial_resource_versions) if first else {}
        if first:
            ts.sent.update(initial)
            if not subscribe and wildcard_ok:
                ts.wildcard = True  # legacy wildcard
                ts.answer_empty = not initial
        if subscribe:
            ts.legacy_wildcard = False  # a wildcard already held stays held
        for n in subscribe:
            if n == "*":
                if wildcard_ok:
                    if first and not initial:
                        ts.answer_empty = True
                    ts.wildcard = True
                continue
            ts.subscribed.add(n)
            if n not in initial:
                ts.must_answer.add(n)  # answered even if the client should already have it
        for n in req.resource_names_unsubscribe:
            if n == "*":
                ts.wildcard = False
                continue
            ts.subscribed.discard(n)
            ts.force.discard(n)
            ts.sent.pop(n, None)
            if ts.wildcard:
                ts.must_answer.add(n)  # still covered by "*": tell the client it exists or not
            else:
                ts.must_answer.discard(n)
        if not ts.wildcard:
            for n in [n for n in ts.sent if n not in ts.subscribed]:
                del ts.sent[n]
            ts.must_answer &= ts.subscribed
        nonce = req.response_nonce
        if not nonce:
            if ts.unserved:
                return RequestVerdict("unknown_type", tu)
            return RequestVerdict("initial" if first else "subscribe", tu)
        version = ts.outstanding.pop(nonce, None)
        known = version is not None or nonce == ts.last_nonce
        if version is None:
            version = ts.last_version_sent if nonce == ts.last_nonce else ""
        if req.HasField("error_detail"):
            # What was sent stays recorded as held: the same content is never sent again.
            ts.nack_version = version
            ts.nack_message = req.error_detail.message
            ts.nack_nonce = nonce
            ts.nacks += 1
            return RequestVerdict("nack", tu, req.error_detail.message, nonce, changed=changed)
        if not known:
            return RequestVerdict("stale", tu, f"unknown or superseded nonce {nonce}", nonce, changed=changed)
        ts.acked_version = version
        ts.acked_nonce = nonce
        ts.acks += 1
        return RequestVerdict("unknown_type" if ts.unserved else "ack", tu, nonce=nonce, changed=changed)

    def responses(self, cache: SnapshotCache) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        """DeltaDiscoveryResponses due now, CDS before EDS, then types we do not serve."""
        return [p.message() for p in self.plans(cache)]

    def plans(self, cache: SnapshotCache) -> list[ResponsePlan]:
        """The responses due now as :class:`ResponsePlan`, CDS before EDS, then types we do not
        serve. Records what the client now holds."""
        out: list[ResponsePlan] = []
        order = list(SERVED_TYPES) + [tu for tu in self.types if tu not in RESOURCE_TYPES]
        for tu in order:
            ts = self.types.get(tu)
            if ts is None or not ts.requested:
                continue
            if tu == CLA_TYPE_URL:
                self._owe_eds(ts.subscribed, ts.force, cache)
            gens = self._generations(cache, tu)
            if not ts.dirty and not ts.force and not ts.answer_empty and gens == ts.seen:
                continue  # nothing this type depends on changed since the last look
            ts.dirty, ts.seen = False, gens
            resp = self._response_for(ts, cache)
            if resp is not None:
                out.append(resp)
        return out

    def _response_for(self, ts: DeltaTypeState, cache: SnapshotCache) -> ResponsePlan | None:
        res = cache.resources(ts.type_url)
        rtype = RESOURCE_TYPES.get(ts.type_url)
        parent = cache.resources(rtype.parent_type_url) if rtype and rtype.parent_type_url else {}
        candidates = ts.subscribed | ts.sent.keys() | ts.must_answer
        if ts.wildcard:
            candidates |= res.keys()
        send: list[CachedResource] = []
        removed: list[str] = []
        for n in sorted(candidates):
            if not (ts.wildcard or n in ts.subscribed):
                ts.sent.pop(n, None)
                ts.must_answer.discard(n)
                continue
            r = res.get(n)
            if r is None:
                if (n in ts.sent or n in ts.must_answer) and n not in parent:
                    removed.append(n)  # gone, or never existed (a pending EDS name is held)
                continue
            if ts.sent.get(n) != r.version or n in ts.must_answer or n in ts.force:
                send.append(r)
        if not send and not removed and not ts.answer_empty:
            return None
        nonce = self._next_nonce()
        version = cache.type_version(ts.type_url) or f"{self.server_id}-empty"
        resp = ResponsePlan("delta", ts.type_url, version, nonce, tuple(send), tuple(removed))
        for r in send:
            ts.sent[r.name] = r.version
            ts.must_answer.discard(r.name)
            ts.force.discard(r.name)
        for n in removed:
            ts.sent.pop(n, None)
            ts.must_answer.discard(n)
            ts.force.discard(n)
        if ts.type_url == CLUSTER_TYPE_URL:
            self._eds_owed |= {r.name for r in send}
        ts.answer_empty = False
        ts.last_nonce = nonce
        ts.last_version_sent = version
        ts.responses += 1
        ts.removed_sent += len(removed)
        ts.outstanding[nonce] = version
        while len(ts.outstanding) > self.max_tracked_nonces:
            ts.outstanding.popitem(last=False)
        return resp

    def describe(self) -> dict:
        """JSON-able summary for the admin endpoint (``/xds/clients``)."""
        view = self._base_view()
        view["types"] = {
            short_type(tu): {
                "subscribed": (["*"] if ts.wildcard else []) + sorted(ts.subscribed),
                "resources_held": len(ts.sent),
                "removed_sent": ts.removed_sent,
                **ts.ack_view(),
            }
            for tu, ts in self.types.items()
        }
        return view


AdsStream = Union[SotwStream, DeltaStream]


@dataclass
class AdsHooks:
    """Optional callbacks (plain values, not subclassing) for metrics and logs.

    ``on_request(stream, verdict)``, ``on_response(stream, plan)`` (a :class:`ResponsePlan`:
    ``type_url``, ``version``, ``nonce``, ``resources``, ``removed``), ``on_stream_open(stream)``,
    ``on_stream_close(stream)``.
    """

    on_request: Callable[[AdsStream, RequestVerdict], None] | None = None
    on_response: Callable[[AdsStream, ResponsePlan], None] | None = None
    on_stream_open: Callable[[AdsStream], None] | None = None
    on_stream_close: Callable[[AdsStream], None] | None = None


class AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """grpc.aio servicer for SotW and delta ADS over one :class:`SnapshotCache`.

    ``streams`` maps stream id -> live :class:`SotwStream` / :class:`DeltaStream`. Counters
    (read by the admin endpoint): ``nacks`` by (node id, type), ``requests`` by (variant, type,
    kind), ``responses`` by (variant, type), ``streams_opened``.
    """

    def __init__(self, cache: SnapshotCache, hooks: AdsHooks | None = None, *,
                 max_tracked_nonces: int = 16) -> None:
        self.cache = cache
        self.hooks = hooks or AdsHooks()
        self.max_tracked_nonces = max_tracked_nonces
        self.streams: dict[int, AdsStream] = {}
        self.nacks: collections.Counter[tuple[str, str]] = collections.Counter()
        self.requests: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.responses: collections.Counter[tuple[str, str]] = collections.Counter()
        self.streams_opened = 0
        self._raw = False

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register both ADS methods on ``server``, writing responses as pre-encoded bytes
        (:func:`encode_response`: the body is serialized once and shared by every stream).

        Use this instead of the generated ``add_AggregatedDiscoveryServiceServicer_to_server``
        (which also works, serializing each response per stream).
        """
        handlers = {
            "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
                self.StreamAggregatedResources,
                request_deserializer=discovery_pb2.DiscoveryRequest.FromString, response_serializer=None),
            "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(
                self.DeltaAggregatedResources,
                request_deserializer=discovery_pb2.DeltaDiscoveryRequest.FromString, response_serializer=None),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "envoy.service.discovery.v3.AggregatedDiscoveryService", handlers),))
        self._raw = True

    async def StreamAggregatedResources(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """State-of-the-world ADS: one stream per Envoy, all types multiplexed (responses are
        written with ``context.write``)."""
        await self._serve(SotwStream(self.cache.server_id), request_iterator, context)

    async def DeltaAggregatedResources(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """Delta (incremental) ADS: one stream per Envoy, all types multiplexed."""
        await self._serve(DeltaStream(self.cache.server_id, self.max_tracked_nonces), request_iterator, context)

    def subscription_count(self) -> int:
        """Subscriptions held by all open streams (named resources + wildcards)."""
        return sum(s.subscription_count() for s in self.streams.values())

    def stream_count(self) -> int:
        """Open ADS streams."""
        return len(self.streams)

    def streams_by_variant(self) -> dict[str, int]:
        """Open streams per variant: ``{"sotw": n, "delta": m}`` (both keys always present)."""
        counts = {"sotw": 0, "delta": 0}
        for st in self.streams.values():
            counts[st.variant] = counts.get(st.variant, 0) + 1
        return counts

    def client_views(self) -> list[dict]:
        """``describe()`` of every open stream (JSON-able, for ``/xds/clients``)."""
        return [s.describe() for s in self.streams.values()]

    def nack_counts(self) -> dict[tuple[str, str], int]:
        """NACKs received by (Envoy node id, type label) since start (a copy)."""
        return dict(self.nacks)

    async def _serve(self, stream: AdsStream, request_iterator: AsyncIterator, context: grpc.aio.ServicerContext) -> None:
        # Ordering vs back-pressure: one writer per stream computes what is due right before
        # writing it. While a write waits on HTTP/2 flow control (a client that stopped reading),
        # changes only set `wake`; the next write then carries the latest state. Nothing queues
        # per stream, and no other stream waits on this one.
        self.streams[stream.stream_id] = stream
        self.streams_opened += 1
        if self.hooks.on_stream_open:
            self.hooks.on_stream_open(stream)
        wake = asyncio.Event()
        failure: list[BaseException] = []
        unwatch = self.cache.watch(wake.set)

        async def reader() -> None:
            try:
                async for req in request_iterator:
                    try:
                        verdict = stream.on_request(req)
                    except ValueError as e:
                        failure.append(e)
                        return
                    self.requests[(stream.variant, _metric_type(verdict.type_url), verdict.kind)] += 1
                    if verdict.kind == "nack":
                        self.nacks[(stream.node_id, _metric_type(verdict.type_url))] += 1
                        log.warning("NACK from %s (%s stream %d) for %s nonce %s: %s", stream.node_id or "?",
                                    stream.variant, stream.stream_id, short_type(verdict.type_url),
                                    verdict.nonce, verdict.detail[:500])
                    if self.hooks.on_request:
                        self.hooks.on_request(stream, verdict)
                    if verdict.changed:
                        wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the client went away; the send loop ends too
                log.debug("ADS stream %d: read side ended: %r", stream.stream_id, e)
            finally:
                failure.append(EOFError())
                wake.set()

        reader_task = asyncio.create_task(reader(), name=f"ads-reader-{stream.stream_id}")
        try:
            while True:
                wake.clear()
                for plan in stream.plans(self.cache):
                    self.responses[(stream.variant, _metric_type(plan.type_url))] += 1
                    if self.hooks.on_response:
                        self.hooks.on_response(stream, plan)
                    await context.write(encode_response(plan, self.cache) if self._raw else plan.message())
                if failure:
                    err = failure[0]
                    if isinstance(err, ValueError):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
                    return
                await wake.wait()
        finally:
            unwatch()
            reader_task.cancel()
            self.streams.pop(stream.stream_id, None)
            if self.hooks.on_stream_close:
                self.hooks.on_stream_close(stream)
