"""xDS serving: resources (what Envoy gets), the snapshot cache (encoded once, shared), the pure
per-stream protocol bookkeeping (SotW, delta), wire encoding and the grpc.aio ADS shell.

Modules, in the order data flows: ``resources`` -> ``cache`` (+ ``memo``) -> ``protocol``,
``sotw``, ``delta`` (pure) -> ``encoding`` -> ``ads`` (I/O; ``budget`` and ``stats`` beside it).
"""
from xds_server.xds.ads import AdsServicer, AdsStream
from xds_server.xds.budget import RequestBudget
from xds_server.xds.cache import CachedResource, InvalidResource, SnapshotCache
from xds_server.xds.delta import DeltaStream
from xds_server.xds.encoding import encode_response, response_message
from xds_server.xds.protocol import RequestVerdict, ResponsePlan, StreamIdentity, StreamLimits, Verdict
from xds_server.xds.resources import CLA_TYPE_URL, CLUSTER_TYPE_URL, RESOURCE_TYPES, type_label
from xds_server.xds.sotw import SotwStream
from xds_server.xds.stats import XdsStats

__all__ = [
    "CLA_TYPE_URL",
    "CLUSTER_TYPE_URL",
    "RESOURCE_TYPES",
    "AdsServicer",
    "AdsStream",
    "CachedResource",
    "DeltaStream",
    "InvalidResource",
    "RequestBudget",
    "RequestVerdict",
    "ResponsePlan",
    "SnapshotCache",
    "SotwStream",
    "StreamIdentity",
    "StreamLimits",
    "Verdict",
    "XdsStats",
    "encode_response",
    "response_message",
    "type_label",
]
