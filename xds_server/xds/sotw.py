"""Pure bookkeeping of one state-of-the-world ADS stream (no I/O; see :mod:`xds_server.xds.protocol`).

Protocol rules (docs/xds_protocol.md section 1; checklist 1.9 numbers in brackets):
- an ACK gets no response unless content changed [3]; a request whose ``response_nonce`` is not
  the last nonce sent for its type is stale and ignored [6];
- CDS is full state and (legacy) wildcard [10]; EDS is named: only requested names are sent [11];
  a name added to ``resource_names`` is sent even if sent before [7, 12]; a requested EDS name
  that exists nowhere (no assignment, no cluster) is answered with an empty assignment, since
  SotW has no "does not exist" answer and Envoy would wait on it;
- on a new stream everything requested is sent in full whatever ``version_info`` says [14];
- a NACK is recorded with nonce, version and message; the rejected content is not sent again,
  only newer content is [4, 5, 29]; a type we do not serve gets one empty response [18].
"""
from __future__ import annotations

from collections.abc import Mapping
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

__all__ = ["SERVED_TYPES", "SotwStream", "TypeState"]

SERVED_TYPES = tuple(RESOURCE_TYPES)  # CDS before EDS: make-before-break order


@dataclass(slots=True)
class TypeState(AckState):
    """SotW: per stream, per type_url bookkeeping."""

    type_url: str = ""
    subscribed: set[str] = field(default_factory=set)
    wildcard: bool = False
    legacy_wildcard: bool = True         # the client has never named a resource of this type
    requested: bool = False              # the client has sent at least one request of this type
    sent: dict[str, str] = field(default_factory=dict)  # name -> resource version the client got
    force: set[str] = field(default_factory=set)        # names to re-push even if unchanged
    absent: set[str] = field(default_factory=set)       # names answered with a stand-in (bounded)
    unserved: bool = False               # a type we do not serve
    answered_unserved: bool = False
    dirty: bool = True                   # subscription changed since plans() last looked
    seen: tuple[int, int] = (-1, -1)     # cache generations (type, parent type) last looked at


class SotwStream(StreamBase[TypeState]):
    """Pure bookkeeping of one state-of-the-world ADS stream.

    ``on_request(req)`` updates state and classifies the request (raises ValueError, answered
    INVALID_ARGUMENT, for a missing or too long ``type_url``, too many types or names);
    ``plans(cache)`` returns the responses due now (maybe none), CDS first, and records them as sent.
    """

    variant = "sotw"

    def __init__(self, ident: StreamIdentity, limits: StreamLimits | None = None) -> None:
        super().__init__(ident, limits)
        self.types: dict[str, TypeState] = {}

    def on_request(self, req: discovery_pb2.DiscoveryRequest) -> RequestVerdict:
        """Apply one DiscoveryRequest (see the class docstring for errors)."""
        tu, ts = self._begin(req, TypeState)
        nonce = req.response_nonce
        if nonce and nonce != ts.last_nonce:
            return RequestVerdict(Verdict.STALE, tu, f"nonce {clip(nonce, 64)} is not the last sent ({ts.last_nonce})",
                                  nonce, changed=False)
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
                ts.absent.discard(n)
            ts.subscribed = names
        self._check_names()
        changed = first or not nonce or before != (ts.wildcard, frozenset(ts.subscribed))
        ts.dirty = ts.dirty or changed
        if ts.unserved:
            return RequestVerdict(Verdict.UNKNOWN_TYPE, tu, nonce=nonce, changed=changed)
        if first or not nonce:
            return RequestVerdict(Verdict.INITIAL, tu)
        version = self._text(req.version_info)
        if req.HasField("error_detail"):
            message = clip(req.error_detail.message, self.limits.nack_message_max_chars)
            ts.nack_version = version
            ts.nack_message = message
            ts.nack_nonce = nonce
            ts.nacks += 1
            ts.acked_version = version  # the client kept its previous content
            return RequestVerdict(Verdict.NACK, tu, message, nonce, changed=changed)
        ts.acked_version = version
        ts.acked_nonce = nonce
        ts.acks += 1
        return RequestVerdict(Verdict.ACK, tu, nonce=nonce, changed=changed)

    def plans(self, cache: SnapshotCache) -> list[ResponsePlan]:
        """The responses due now, CDS before EDS, then types we do not serve. Records them as sent."""
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
                ts.last_version_sent = EMPTY_VERSION
                ts.responses += 1
                out.append(ResponsePlan("sotw", ts.type_url, ts.last_version_sent, nonce))
        return out

    def _response_for(self, ts: TypeState, cache: SnapshotCache) -> ResponsePlan | None:
        res = cache.resources(ts.type_url)
        if ts.wildcard:
            wanted: dict[str, CachedResource] = dict(res)
        else:
            small, large = small_first(ts.subscribed, res)
            wanted = {n: res[n] for n in small if n in large}
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
            if not ts.wildcard and len(wanted) < len(ts.subscribed):
                send.extend(self._absent(ts, cache, res, self.limits.max_absent_names))
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
                if r.name in res:
                    ts.absent.discard(r.name)
        return resp

    @staticmethod
    def _absent(ts: TypeState, cache: SnapshotCache, res: Mapping[str, CachedResource],
                limit: int) -> list[CachedResource]:
        """Stand-ins for subscribed names that exist nowhere and were not answered yet
        (EDS: an empty assignment, so Envoy does not wait on the name), at most
        ``limit`` names per type held at once (the rest get no answer, as before)."""
        out: list[CachedResource] = []
        if len(ts.absent) >= limit:
            return out
        for n in sorted(ts.subscribed.difference(res)):
            if n in ts.sent and n not in ts.force:
                continue
            r = cache.absent(ts.type_url, n)
            if r is not None and ts.sent.get(n) != r.version:
                out.append(r)
                ts.absent.add(n)
                if len(ts.absent) >= limit:
                    break
        return out

    def describe(self) -> dict[str, object]:
        """JSON-able summary for the admin endpoint (``/xds/clients``)."""
        view = self._base_view()
        view["types"] = {
            self._view_key(tu): {
                **self._subscribed_view(ts),
                **self._held_view(ts),
                **ts.ack_view(),
            }
            for tu, ts in self.types.items()
        }
        return view
