"""A shift's layout (:mod:`xds_server.policy.shift_layout`) applied to the built Envoy resources.

- :func:`shift_cla`: regroups the endpoints of a built ClusterLoadAssignment by the layout's
  priority and locality per node (an endpoint's ``hostname`` is its node id, as
  :func:`~xds_server.xds.resources.build_cla` writes it) and sets each locality's
  ``load_balancing_weight`` when the layout has them. Health, weights, policy and drops are kept.
- endpoints of ``close`` (node ids: the source after a hard switch) get
  ``metadata.filter_metadata["sentinel"]["connection"] = "close"``; the bootstrap's route copies it
  into ``x-sentinel-connection`` (``%UPSTREAM_METADATA(sentinel:connection)%``) and its Lua filter
  then drains the client's connection after that response (``Connection: close`` on HTTP/1.1,
  GOAWAY on HTTP/2). Envoy 1.40 strips a ``connection`` header a route adds (measured), so the
  header alone cannot do it; Envoy updates an existing host's metadata in place, so a response of
  a stream already running on the source when the switch lands carries it.
- :func:`shift_cluster`: turns ``common_lb_config.locality_weighted_lb_config`` on, which Envoy
  needs to honour locality weights (without it they are ignored; with it a locality without a
  weight gets no traffic, so every locality of the assignment gets one).
"""
from __future__ import annotations

from collections.abc import Collection

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2

from xds_server.policy.shift_layout import Layout

__all__ = ["CLOSE_NAMESPACE", "shift_cla", "shift_cluster"]


CLOSE_NAMESPACE = "sentinel"


def shift_cla(cla: endpoint_pb2.ClusterLoadAssignment, lay: Layout,
              close: Collection[str] = ()) -> endpoint_pb2.ClusterLoadAssignment:
    """A new assignment with ``cla``'s endpoints placed by ``lay`` (an endpoint whose node the
    layout does not know keeps its place), those of ``close`` marked (see module docstring).
    Localities are ordered by (priority, locality) and endpoints by node id, so the same input
    encodes to the same bytes."""
    groups: dict[tuple[int, tuple[str, str, str]], list[endpoint_components_pb2.LbEndpoint]] = {}
    for lle in cla.endpoints:
        own = (lle.locality.region, lle.locality.zone, lle.locality.sub_zone)
        for e in lle.lb_endpoints:
            nid = e.endpoint.hostname
            if nid in close:
                e.metadata.filter_metadata[CLOSE_NAMESPACE].update({"connection": "close"})
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
