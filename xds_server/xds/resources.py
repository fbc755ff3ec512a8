"""Build Envoy resources (xds-protos messages) from config and per-node routing decisions.

- :func:`build_cluster`: one EDS-over-ADS ``Cluster`` per configured cluster.
- :func:`build_cla`: one ``ClusterLoadAssignment`` per cluster, nodes grouped by
  (priority, locality) into ``LocalityLbEndpoints``.

Envoy rules encoded here (notes/xds_protocol.md, checked on Envoy 1.40):
- ``load_balancing_weight`` must be >= 1 (0 makes Envoy NACK the whole assignment) and the sum
  of weights in one locality must not exceed 2^32-1 (:func:`clamp_weights`).
- ``healthy_panic_threshold`` defaults to 50 % in Envoy, which spreads traffic over dead hosts;
  ``update_merge_window`` defaults to 1 s, which delays ejection. Both come from config.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, config_source_pb2, health_check_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2, duration_pb2, wrappers_pb2

from xds_server.config import ClusterConfig, NodeConfig, parse_hostport
from xds_server.health.model import Routing

__all__ = [
    "CLUSTER_TYPE_URL",
    "CLA_TYPE_URL",
    "MAX_LOCALITY_WEIGHT_SUM",
    "build_cla",
    "build_cluster",
    "clamp_weights",
]

CLUSTER_TYPE_URL = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
CLA_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
MAX_LOCALITY_WEIGHT_SUM = 2**32 - 1

_HEALTH = {
    "HEALTHY": health_check_pb2.HEALTHY,
    "UNHEALTHY": health_check_pb2.UNHEALTHY,
    "DRAINING": health_check_pb2.DRAINING,
    "DEGRADED": health_check_pb2.DEGRADED,
}


def _ms(ms: int | float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromMilliseconds(int(ms))
    return d


def build_cluster(c: ClusterConfig) -> cluster_pb2.Cluster:
    """The CDS resource for one configured cluster (EDS over ADS, LB policy and limits from config)."""
    cluster = cluster_pb2.Cluster(
        name=c.name,
        type=cluster_pb2.Cluster.EDS,
        connect_timeout=_ms(c.connect_timeout_ms),
        lb_policy=getattr(cluster_pb2.Cluster, c.lb_policy),
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=config_source_pb2.ConfigSource(
                ads=config_source_pb2.AggregatedConfigSource(),
                resource_api_version=config_source_pb2.V3,
            )
        ),
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(
            healthy_panic_threshold=percent_pb2.Percent(value=c.healthy_panic_threshold_percent),
            update_merge_window=_ms(c.update_merge_window_ms),
        ),
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                circuit_breaker_pb2.CircuitBreakers.Thresholds(
                    priority=base_pb2.DEFAULT,
                    max_requests=wrappers_pb2.UInt32Value(value=c.max_requests),
                    max_pending_requests=wrappers_pb2.UInt32Value(value=c.max_requests),
                    max_connections=wrappers_pb2.UInt32Value(value=c.max_requests),
                )
            ]
        ),
    )
    od = c.outlier_detection
    if od.enabled:
        cluster.outlier_detection.CopyFrom(
            outlier_detection_pb2.OutlierDetection(
                consecutive_5xx=wrappers_pb2.UInt32Value(value=od.consecutive_5xx),
                interval=_ms(od.interval_ms),
                base_ejection_time=_ms(od.base_ejection_time_ms),
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


def build_cla(
    c: ClusterConfig, routing: Mapping[str, Routing]
) -> endpoint_pb2.ClusterLoadAssignment:
    """The EDS resource for one cluster.

    ``routing`` maps node id -> :class:`Routing`; a node missing from it is published UNHEALTHY
    (never UNKNOWN, which Envoy treats as healthy). Localities are ordered by (priority, region,
    zone, sub_zone) and endpoints by node id, so the same input always encodes to the same bytes.
    """
    groups: dict[tuple[int, str, str, str], list[NodeConfig]] = {}
    for n in c.nodes:
        key = (n.priority, n.locality.region, n.locality.zone, n.locality.sub_zone)
        groups.setdefault(key, []).append(n)
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=c.name)
    for key in sorted(groups):
        prio, region, zone, sub_zone = key
        nodes = sorted(groups[key], key=lambda n: n.id)
        rs = [routing.get(n.id) or Routing(n.capacity * 100, "UNHEALTHY") for n in nodes]
        weights = clamp_weights([r.weight for r in rs])
        lle = cla.endpoints.add(priority=prio)
        if region or zone or sub_zone:
            lle.locality.region = region
            lle.locality.zone = zone
            lle.locality.sub_zone = sub_zone
        for n, r, w in zip(nodes, rs, weights):
            host, port = parse_hostport(n.address)
            lle.lb_endpoints.append(
                endpoint_components_pb2.LbEndpoint(
                    endpoint=endpoint_components_pb2.Endpoint(
                        address=address_pb2.Address(
                            socket_address=address_pb2.SocketAddress(address=host, port_value=port)
                        ),
                        hostname=n.id,
                    ),
                    health_status=_HEALTH[r.health_status],
                    load_balancing_weight=wrappers_pb2.UInt32Value(value=w),
                )
            )
    return cla
