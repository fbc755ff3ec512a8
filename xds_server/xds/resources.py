"""Build Envoy resources (xds-protos messages) from config and per-node routing decisions.

- :func:`build_cluster`: one EDS-over-ADS ``Cluster`` per configured cluster.
- :func:`build_cla`: one ``ClusterLoadAssignment`` per cluster, nodes grouped by
  (priority, locality) into ``LocalityLbEndpoints``.

Envoy rules encoded here (docs/xds_protocol.md, checked on Envoy 1.40):
- ``load_balancing_weight`` must be >= 1 (0 makes Envoy NACK the whole assignment) and the sum
  of weights in one locality must not exceed 2^32-1 (:func:`clamp_weights`).
- ``healthy_panic_threshold`` defaults to 50 % in Envoy, which spreads traffic over dead hosts;
  ``update_merge_window`` defaults to 1 s, which delays ejection. Both come from config.
- priorities are contiguous from 0 and at most 128; a locality appears once per priority;
  ``policy.overprovisioning_factor`` comes from config; ``drop_overloads`` has at most one
  category (Envoy NACKs two). :mod:`~xds_server.xds.validation` checks all of it before
  anything is cached, so a bad assignment is held back instead of being NACKed by every Envoy.
- the control plane never takes an assignment away: a configured cluster always has one, with
  every node listed (a delta ``removed_resources`` does not clear endpoints in Envoy).

:data:`RESOURCE_TYPES` is the registry of the types served over ADS (grpc-go style: a type is a
value with its properties and validator, not a subclass).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypedDict

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, config_source_pb2, health_check_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2, duration_pb2, wrappers_pb2
from google.protobuf.message import Message

from xds_server.config import ClusterConfig, NodeConfig, parse_hostport
from xds_server.health.model import Routing, RoutingStatus
from xds_server.xds.validation import MAX_LOCALITY_WEIGHT_SUM, validate_cla, validate_cluster

__all__ = [
    "CLA_TYPE_URL",
    "CLUSTER_TYPE_URL",
    "RESOURCE_TYPES",
    "AdmissionArgs",
    "DropArgs",
    "ResourceType",
    "build_cla",
    "build_cluster",
    "carry_drop_change",
    "clamp_weights",
    "routable_capacity_ratio",
    "type_label",
]

CLUSTER_TYPE_URL = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
CLA_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"

_HEALTH = {
    "HEALTHY": health_check_pb2.HEALTHY,
    "UNHEALTHY": health_check_pb2.UNHEALTHY,
    "DRAINING": health_check_pb2.DRAINING,
    "DEGRADED": health_check_pb2.DEGRADED,
}


def _ms(ms: int | float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromMilliseconds(round(ms))
    return d


def build_cluster(c: ClusterConfig) -> cluster_pb2.Cluster:
    """The CDS resource for one configured cluster (EDS over ADS, LB policy and limits from config)."""
    cluster = cluster_pb2.Cluster(
        name=c.name,
        type=cluster_pb2.Cluster.EDS,
        connect_timeout=_ms(c.connect_timeout.ms),
        lb_policy=getattr(cluster_pb2.Cluster, c.lb_policy),
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=config_source_pb2.ConfigSource(
                ads=config_source_pb2.AggregatedConfigSource(),
                resource_api_version=config_source_pb2.V3,
            )
        ),
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(
            healthy_panic_threshold=percent_pb2.Percent(value=c.healthy_panic_threshold_percent),
            update_merge_window=_ms(c.update_merge_window.ms),
        ),
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                circuit_breaker_pb2.CircuitBreakers.Thresholds(
                    priority=base_pb2.DEFAULT,
                    max_requests=wrappers_pb2.UInt32Value(value=c.max_requests),
                    max_pending_requests=wrappers_pb2.UInt32Value(value=c.max_requests),
                    max_connections=wrappers_pb2.UInt32Value(value=c.max_requests),
                    max_retries=wrappers_pb2.UInt32Value(value=c.max_retries),
                )
            ]
        ),
    )
    od = c.outlier_detection
    if od.enabled:
        cluster.outlier_detection.CopyFrom(
            outlier_detection_pb2.OutlierDetection(
                consecutive_5xx=wrappers_pb2.UInt32Value(value=od.consecutive_5xx),
                enforcing_consecutive_5xx=wrappers_pb2.UInt32Value(value=od.enforcing_consecutive_5xx),
                consecutive_gateway_failure=wrappers_pb2.UInt32Value(value=od.consecutive_gateway_failure),
                enforcing_consecutive_gateway_failure=wrappers_pb2.UInt32Value(
                    value=od.enforcing_consecutive_gateway_failure),
                enforcing_success_rate=wrappers_pb2.UInt32Value(value=od.enforcing_success_rate),
                interval=_ms(od.interval.ms),
                base_ejection_time=_ms(od.base_ejection_time.ms),
                max_ejection_percent=wrappers_pb2.UInt32Value(value=od.max_ejection_percent),
            )
        )
    if c.upstream_protocol == "http2":
        opts = http_protocol_options_pb2.HttpProtocolOptions(
            explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
                http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
            )
        )
        packed = any_pb2.Any()
        packed.Pack(opts)
        cluster.typed_extension_protocol_options[
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        ].CopyFrom(packed)
    return cluster


def clamp_weights(weights: Sequence[int]) -> list[int]:
    """Make weights valid for one locality: each >= 1 and the sum <= 2^32-1.

    When the sum overflows, every weight is scaled down by the same factor (ratios kept up to
    integer rounding), then floored at 1. Field case fc01.
    """
    ws = [max(1, int(w)) for w in weights]
    total = sum(ws)
    if total <= MAX_LOCALITY_WEIGHT_SUM:
        return ws
    # Reserve room for the floor-at-1 of tiny weights.
    budget = MAX_LOCALITY_WEIGHT_SUM - len(ws)
    scaled = [max(1, (w * budget) // total) for w in ws]
    assert sum(scaled) <= MAX_LOCALITY_WEIGHT_SUM
    return scaled


@functools.lru_cache(maxsize=65536)
def _endpoint(address: str, hostname: str) -> endpoint_components_pb2.Endpoint:
    # The static part of an LbEndpoint, built once per node. Never mutate.
    host, port = parse_hostport(address)
    return endpoint_components_pb2.Endpoint(
        address=address_pb2.Address(socket_address=address_pb2.SocketAddress(address=host, port_value=port)),
        hostname=hostname,
    )


@functools.lru_cache(maxsize=65536)
def _lb_endpoint(address: str, hostname: str, health_status: health_check_pb2.HealthStatus.ValueType,
                 weight: int) -> endpoint_components_pb2.LbEndpoint:
    # One node's LbEndpoint as published, built once per (status, weight) it is published with and
    # copied into each assignment by a C-level extend: at 2,000 endpoints ~1 ms against ~2.4 ms
    # building each one (most nodes keep their weight from one publish to the next). Never mutate.
    e = endpoint_components_pb2.LbEndpoint(health_status=health_status)
    e.endpoint.CopyFrom(_endpoint(address, hostname))
    e.load_balancing_weight.value = weight
    return e


_Locality = tuple[int, str, str, str]  # (priority, region, zone, sub_zone)
_LAYOUTS: dict[int, tuple[ClusterConfig, tuple[tuple[_Locality, tuple[NodeConfig, ...]], ...]]] = {}


def _layout(c: ClusterConfig) -> tuple[tuple[_Locality, tuple[NodeConfig, ...]], ...]:
    """The cluster's localities in publish order, each with its nodes by id: computed once per
    config object (configs are immutable; the last 256 are kept)."""
    hit = _LAYOUTS.get(id(c))
    if hit is not None and hit[0] is c:
        return hit[1]
    groups: dict[_Locality, list[NodeConfig]] = {}
    for n in c.nodes:
        groups.setdefault((n.priority, n.locality.region, n.locality.zone, n.locality.sub_zone), []).append(n)
    out = tuple((key, tuple(sorted(groups[key], key=lambda n: n.id))) for key in sorted(groups))
    if len(_LAYOUTS) >= 256:
        _LAYOUTS.clear()
    _LAYOUTS[id(c)] = (c, out)
    return out


def routable_capacity_ratio(c: ClusterConfig, routing: Mapping[str, Routing]) -> float:
    """Share (0..1) of the cluster's full weight (sum of capacity x 100) that is routable now:
    the weights of nodes published HEALTHY, over the full weights of all nodes."""
    full = sum(n.capacity * 100 for n in c.nodes)
    routable = sum(
        r.weight for n in c.nodes if (r := routing.get(n.id)) is not None and r.health_status == "HEALTHY"
    )
    return min(1.0, routable / full) if full else 0.0


class DropArgs(TypedDict, total=False):
    """:func:`build_cla` keyword arguments of an Envoy cluster's overload drop (empty: none)."""

    shed_percent: float
    shed_flip: bool


class AdmissionArgs(NamedTuple):
    """An Envoy cluster that admits by free slots (:mod:`xds_server.policy.slot_admission`): its
    circuit breaker's ``max_requests``, least-request's ``choice_count``, and ``weights``: node
    id -> the weight published instead of the decided one (the fully routed nodes by their slots:
    the cap already holds every node at its slots)."""

    max_requests: int
    choice_count: int
    weights: Mapping[str, int]


def build_cla(
    c: ClusterConfig, routing: Mapping[str, Routing], shed_percent: float = 0.0, shed_flip: bool = False
) -> endpoint_pb2.ClusterLoadAssignment:
    """The EDS resource for one cluster.

    ``routing`` maps node id -> :class:`Routing`; a node missing from it is published UNHEALTHY
    (never UNKNOWN, which Envoy treats as healthy). Localities are ordered by (priority, region,
    zone, sub_zone) and endpoints by node id, so the same input always encodes to the same bytes.
    ``policy.overprovisioning_factor`` comes from ``c.overprovisioning_factor``; the configured
    drop (at most one category) is added while :func:`routable_capacity_ratio` is below its
    threshold. ``shed_percent`` (0..100, overload shedding: :mod:`xds_server.policy.overload_drop`) is
    published as the one ``overload`` category when it exceeds the configured drop; ``shed_flip``
    adds 1 to ``overprovisioning_factor`` so Envoy 1.40 applies a changed drop (docs/xds_protocol.md 2.5).
    """
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=c.name)
    for (prio, region, zone, sub_zone), nodes in _layout(c):
        rs = [routing.get(n.id) or Routing(n.capacity * 100, RoutingStatus.UNHEALTHY) for n in nodes]
        weights = clamp_weights([r.weight for r in rs])
        lle = cla.endpoints.add(priority=prio)
        if region or zone or sub_zone:
            lle.locality.region = region
            lle.locality.zone = zone
            lle.locality.sub_zone = sub_zone
        lle.lb_endpoints.extend([_lb_endpoint(n.address, n.id, _HEALTH[r.health_status], w)
                                 for n, r, w in zip(nodes, rs, weights, strict=True)])  # clamp keeps the length
    cla.policy.overprovisioning_factor.value = c.overprovisioning_factor + (1 if shed_flip else 0)
    drop: tuple[str, float] | None = None
    if c.drop_overloads:
        ratio = routable_capacity_ratio(c, routing)
        for d in c.drop_overloads[:1]:
            if ratio < d.below_routable_capacity_ratio:
                drop = (d.category, d.drop_percent)
    if shed_percent > 0 and (drop is None or shed_percent > drop[1]):
        drop = ("overload", min(100.0, shed_percent))
    if drop is not None:
        cla.policy.drop_overloads.add(
            category=drop[0],
            drop_percentage=percent_pb2.FractionalPercent(
                numerator=round(drop[1] * 10_000), denominator=percent_pb2.FractionalPercent.MILLION))
    return cla


def carry_drop_change(
    prev: Message | None, new: endpoint_pb2.ClusterLoadAssignment
) -> endpoint_pb2.ClusterLoadAssignment:
    """``new``, made to apply its drop on Envoy 1.40: when its ``policy.drop_overloads`` differs
    from ``prev``'s (the assignment published before, or its packed ``Any`` as the cache holds
    it; None: first) while its ``overprovisioning_factor`` does not, the factor moves by one
    (140 -> 141, 141 -> 140). Envoy applies a drop change only with a host-set rebuild
    (docs/xds_protocol.md 2.5), and a configured drop (``clusters[].drop_overloads``) can change
    with nothing else: a config reload of the drop or of a capacity (measured: a reload from 50 %
    to 10 % or none kept dropping 47 %). Pure: ``new`` is copied when changed, never modified."""
    if isinstance(prev, any_pb2.Any):
        unpacked = endpoint_pb2.ClusterLoadAssignment()
        prev = unpacked if prev.Unpack(unpacked) else None
    if not isinstance(prev, endpoint_pb2.ClusterLoadAssignment):
        return new
    if list(prev.policy.drop_overloads) == list(new.policy.drop_overloads):
        return new
    v = new.policy.overprovisioning_factor.value
    if prev.policy.overprovisioning_factor.value != v:
        return new
    out = endpoint_pb2.ClusterLoadAssignment()
    out.CopyFrom(new)
    out.policy.overprovisioning_factor.value = v - 1 if v % 2 and v > 1 else v + 1
    return out


# ---- the registry of served types -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResourceType:
    """A resource type served over ADS, as data.

    - ``type_url``: the ``type.googleapis.com/...`` URL; ``short_name`` for logs and metrics.
    - ``wildcard``: the type supports (legacy) wildcard subscriptions (CDS, LDS).
    - ``sotw_full_state``: SotW responses must carry every resource (a missing one is deleted).
    - ``parent_type_url``: a name that exists in the parent type but not (yet) in this one is
      *pending* (EDS of a known cluster whose assignment the warm-up gate still holds): it is
      held, never reported as removed.
    - ``validate(name, message) -> problems``: empty list when the resource is valid.
    - ``references(encoded) -> names``: the names of resources of *other* types this resource
      (serialized) refers to, as ``(type_url, name)`` pairs (a Cluster of type EDS -> its
      ClusterLoadAssignment); used by :meth:`~xds_server.xds.cache.SnapshotCache.consistent`.
    - ``absent(name) -> message``: what a SotW request for a name that exists nowhere (not in
      this type nor in its parent) is answered with, or None to answer without it. SotW has no
      "does not exist" answer (xds_protocol.md 1.4), so without it Envoy waits out its
      initial_fetch_timeout on the name; EDS answers an empty assignment.
    """

    type_url: str
    short_name: str
    wildcard: bool
    sotw_full_state: bool
    parent_type_url: str | None
    validate: Callable[[str, Message], list[str]]
    references: Callable[[bytes], list[tuple[str, str]]] | None = None
    absent: Callable[[str], Message] | None = None


def cluster_references(encoded: bytes) -> list[tuple[str, str]]:
    """The ClusterLoadAssignment an EDS Cluster (serialized) needs: ``[(CLA_TYPE_URL, name)]``
    with ``eds_cluster_config.service_name`` or else the cluster name; [] for other cluster types."""
    c = cluster_pb2.Cluster.FromString(encoded)
    if c.type != cluster_pb2.Cluster.EDS:
        return []
    return [(CLA_TYPE_URL, c.eds_cluster_config.service_name or c.name)]


def empty_cla(name: str) -> endpoint_pb2.ClusterLoadAssignment:
    """An assignment with no endpoints for ``name``: the answer to an EDS name nobody knows."""
    return endpoint_pb2.ClusterLoadAssignment(cluster_name=name)


RESOURCE_TYPES: dict[str, ResourceType] = {
    CLUSTER_TYPE_URL: ResourceType(CLUSTER_TYPE_URL, "Cluster", True, True, None, validate_cluster,
                                   cluster_references),
    CLA_TYPE_URL: ResourceType(CLA_TYPE_URL, "ClusterLoadAssignment", False, False, CLUSTER_TYPE_URL,
                               validate_cla, absent=empty_cla),
}
"""Served types in make-before-break order: CDS before EDS (checklist 1.9 item 27)."""


def type_label(type_url: str) -> str:
    """The one label of a type_url for metrics, logs and views: the served type's ``short_name``
    ("Cluster", "ClusterLoadAssignment"), "unknown" for anything else (labels stay bounded)."""
    rtype = RESOURCE_TYPES.get(type_url)
    return rtype.short_name if rtype is not None else "unknown"
