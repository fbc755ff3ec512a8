"""Pure bookkeeping of one delta (incremental) ADS stream (no I/O; see :mod:`xds_server.xds.protocol`).

Protocol rules (docs/xds_protocol.md section 1; checklist 1.9 numbers in brackets):
- subscription changes are applied whatever the nonce (stale or empty) [20]; every name in
  ``resource_names_subscribe`` is answered, with the resource or in ``removed_resources`` when it
  does not exist, even if the client should already have it [21];
- ``initial_resource_versions`` (first request per type of a reconnected stream) seeds what the
  client holds: matching versions are not resent, changed ones are, gone ones are listed in
  ``removed_resources`` [22]; resources carry name and version [23];
- legacy wildcard for CDS (first request with no names); unsubscribing a name while ``"*"`` is
  held is answered with the resource or its removal [24]; an unsubscribe-only request gets no
  response and the name stops being tracked [25]; removed clusters are listed in
  ``removed_resources`` [23]. The control plane never removes the assignment of a configured
  cluster (``removed_resources`` does not clear Envoy's endpoints [26]);
- an ACK or NACK is matched to the nonce it names among the last ``max_tracked_nonces`` sent;
  a NACK of an unknown nonce is stale, not counted as a NACK.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from envoy.service.discovery.v3 import discovery_pb2

from xds_server.process.untrusted import clip
from xds_server.xds.cache import EMPTY_VERSION, CachedResource, SnapshotCache
from xds_server.xds.protocol import (
    AckState,
    RequestVerdict,
    ResponsePlan,
    StreamBase,
    StreamIdentity,
    StreamLimits,
    Verdict,
    small_first,
)
from xds_server.xds.resources import CLA_TYPE_URL, CLUSTER_TYPE_URL, RESOURCE_TYPES
from xds_server.xds.sotw import SERVED_TYPES

__all__ = ["DeltaStream", "DeltaTypeState"]


@dataclass(slots=True)
class DeltaTypeState(AckState):
    """Delta: per stream, per type_url bookkeeping.

    ``sent`` is what the client holds as far as we know (name -> version), seeded from
    ``initial_resource_versions``; ``must_answer`` holds names that must be answered even if
    unchanged (explicit subscribes); ``force`` names re-pushed after a CDS change;
    ``outstanding`` maps nonces not yet ACKed to the ``system_version_info`` they carried.
    """

    type_url: str = ""
    subscribed: set[str] = field(default_factory=set)
    wildcard: bool = False
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


class DeltaStream(StreamBase[DeltaTypeState]):
    """Pure bookkeeping of one delta (incremental) ADS stream.

    ``on_request(req)`` applies a DeltaDiscoveryRequest (subscription changes always, whatever
    the nonce) and classifies it (raises ValueError, answered INVALID_ARGUMENT, for a missing or
    too long ``type_url``, too many types or names); ``plans(cache)`` returns the responses due
    now (maybe none), CDS first, and records what the client now holds.
    """

    variant = "delta"

    def __init__(self, ident: StreamIdentity, limits: StreamLimits | None = None) -> None:
        super().__init__(ident, limits)
        self.types: dict[str, DeltaTypeState] = {}

    def on_request(self, req: discovery_pb2.DeltaDiscoveryRequest) -> RequestVerdict:
        """Apply one DeltaDiscoveryRequest (see the class docstring for errors)."""
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
        self._check_names()
        nonce = req.response_nonce
        if not nonce:
            if ts.unserved:
                return RequestVerdict(Verdict.UNKNOWN_TYPE, tu)
            return RequestVerdict(Verdict.INITIAL if first else Verdict.SUBSCRIBE, tu)
        version = ts.outstanding.pop(nonce, None)
        known = version is not None or nonce == ts.last_nonce
        if not known:  # checked before anything is counted: an unknown nonce is never a NACK
            return RequestVerdict(Verdict.STALE, tu, f"unknown or superseded nonce {clip(nonce, 64)}", nonce,
                                  changed=changed)
        if version is None:
            version = ts.last_version_sent
        if req.HasField("error_detail"):
            # What was sent stays recorded as held: the same content is never sent again.
            message = clip(req.error_detail.message, self.limits.nack_message_max_chars)
            ts.nack_version = version
            ts.nack_message = message
            ts.nack_nonce = nonce
            ts.nacks += 1
            return RequestVerdict(Verdict.NACK, tu, message, nonce, changed=changed)
        ts.acked_version = version
        ts.acked_nonce = nonce
        ts.acks += 1
        return RequestVerdict(Verdict.UNKNOWN_TYPE if ts.unserved else Verdict.ACK, tu, nonce=nonce,
                              changed=changed)

    def plans(self, cache: SnapshotCache) -> list[ResponsePlan]:
        """The responses due now, CDS before EDS, then types we do not serve. Records what the
        client now holds."""
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
        # Names that can need an answer: subscribed ones that exist, what the client holds, what
        # must be answered. A subscribed name that exists nowhere and was answered before needs
        # nothing, so it is not looked at (a stream of 20,000 unknown names costs O(resources)).
        if ts.wildcard:
            candidates = set(res.keys())
        else:
            small, large = small_first(ts.subscribed, res)
            candidates = {n for n in small if n in large}
        candidates |= ts.sent.keys()
        candidates |= ts.must_answer
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
        version = cache.type_version(ts.type_url) or EMPTY_VERSION
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
        while len(ts.outstanding) > self.limits.max_tracked_nonces:
            ts.outstanding.popitem(last=False)
        return resp

    def describe(self) -> dict[str, object]:
        """JSON-able summary for the admin endpoint (``/xds/clients``)."""
        view = self._base_view()
        view["types"] = {
            self._view_key(tu): {
                **self._subscribed_view(ts),
                **self._held_view(ts),
                "resources_held": len(ts.sent),
                "removed_sent": ts.removed_sent,
                **ts.ack_view(),
            }
            for tu, ts in self.types.items()
        }
        return view
