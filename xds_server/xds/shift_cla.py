"""A shift's layout (:mod:`xds_server.health.shift_layout`) applied to the built Envoy resources.

- :func:`shift_cla`: regroups the endpoints of a built ClusterLoadAssignment by the layout's
  priority and locality per node (an endpoint's ``hostname`` is its node id, as
  :func:`~xds_server.xds.resources.build_cla` writes it) and sets each locality's
  ``load_balancing_weight`` when the layout has them. Health, weights, policy and drops are kept.
- :func:`shift_cluster`: turns ``common_lb_config.locality_weighted_lb_config`` on, which Envoy
  needs to honour locality weights (without it they are ignored; with it a locality without a
  weight gets no traffic, so every locality of the assignment gets one).
"""
from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2

from xds_server.health.shift_layout import Layout

__all__ = ["shift_cla", "shift_cluster"]


def shift_cla(cla: endpoint_pb2.ClusterLoadAssignment, lay: Layout) -> endpoint_pb2.ClusterLoadAssignment:
    """A new assignment with ``cla``'s endpoints placed by ``lay`` (an endpoint whose node the
    layout does not know keeps its place). Localities are ordered by (priority, locality) and
    endpoints by node id, so the same input encodes to the same bytes."""
    groups: dict[tuple[int, tuple[str, str, str]], list[endpoint_components_pb2.LbEndpoint]] = {}
    for lle in cla.endpoints:
        own = (lle.locality.region, lle.locality.zone, lle.locality.sub_zone)
        for e in lle.lb_endpoints:
            nid = e.endpoint.hostname
            key = (lay.priority.get(nid, lle.priority), lay.locality.get(nid, own))
            groups.setdefault(key, []).append(e)
    out = endpoint_pb2.ClusterLoadAssignment(cluster_name=cla.cluster_name)
    out.policy.CopyFrom(cla.policy)
    for key in sorted(groups):
        prio, (region, zone, sub_zone) = key
        lle = out.endpoints.add(priority=prio)
        if region or zone or sub_zone:
            lle.locality.region, lle.locality.zone, lle.locality.sub_zone = region, zone, sub_zone
        if lay.locality_weights is not None:
            lle.load_balancing_weight.value = max(1, lay.locality_weights.get(key, 1))
        lle.lb_endpoints.extend(sorted(groups[key], key=lambda e: e.endpoint.hostname))
    return out


def shift_cluster(cluster: cluster_pb2.Cluster, locality_weighted: bool) -> cluster_pb2.Cluster:
    """``cluster`` with locality-weighted load balancing on (a copy) when ``locality_weighted``;
    ``cluster`` itself otherwise."""
    if not locality_weighted:
        return cluster
    c = cluster_pb2.Cluster()
    c.CopyFrom(cluster)
    c.common_lb_config.locality_weighted_lb_config.SetInParent()
    return c
