"""Wire encoding of ADS responses: the one path from a :class:`ResponsePlan` to bytes.

The body (everything but the nonce) is serialized once per distinct content and shared by every
stream that sends the same thing (memoized in the cache's bounded memo until the type changes);
each stream adds only its nonce field, which protobuf allows anywhere in a message. A push of one
assignment to 1,000 streams serializes it once.

Shape::

    wire = encode_response(plan, cache)        # bytes of a DiscoveryResponse / DeltaDiscoveryResponse
    msg = response_message(plan)               # the same response as a protobuf message (tests, tools)
"""
from __future__ import annotations

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import Message

from xds_server.xds.cache import SnapshotCache
from xds_server.xds.memo import size_of_names
from xds_server.xds.protocol import ResponsePlan
from xds_server.xds.resources import RESOURCE_TYPES

__all__ = ["encode_response", "response_message"]

_NONCE_TAG = b"\x2a"  # field 5 (nonce in DiscoveryResponse and DeltaDiscoveryResponse), length-delimited


def response_message(plan: ResponsePlan, with_nonce: bool = True) -> Message:
    """The DiscoveryResponse (SotW) or DeltaDiscoveryResponse (delta) of ``plan``."""
    nonce = plan.nonce if with_nonce else ""
    # xds-protos is untyped (its classes are Any to mypy); both responses are protobuf Messages.
    msg: Message
    if plan.variant == "sotw":
        msg = discovery_pb2.DiscoveryResponse(
            version_info=plan.version, type_url=plan.type_url, nonce=nonce,
            resources=[r.any for r in plan.resources])
    else:
        msg = discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=plan.version, type_url=plan.type_url, nonce=nonce,
            resources=[discovery_pb2.Resource(name=r.name, version=r.version, resource=r.any)
                       for r in plan.resources],
            removed_resources=list(plan.removed))
    return msg


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


def encode_response(plan: ResponsePlan, cache: SnapshotCache) -> bytes:
    """Wire bytes of ``plan``'s response: the shared body plus this stream's nonce field.

    Bodies of served types are memoized in ``cache.memo(type_url)`` (bounded by count and bytes;
    a body too large for the memo is serialized per stream); an answer to a type we do not serve
    is never memoized.
    """
    nonce = plan.nonce.encode()
    tail = b"".join((_NONCE_TAG, _varint(len(nonce)), nonce))
    if plan.type_url not in RESOURCE_TYPES:
        return response_message(plan, with_nonce=False).SerializeToString() + tail
    memo = cache.memo(plan.type_url)
    names = tuple(r.name for r in plan.resources)
    key = (plan.variant, plan.version, names, plan.removed)
    body = memo.get(key)
    if body is None:
        body = response_message(plan, with_nonce=False).SerializeToString()
        memo.put(key, body, len(body) + size_of_names(names) + size_of_names(plan.removed))
    return body + tail
