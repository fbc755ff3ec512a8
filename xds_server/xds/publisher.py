"""Everything Envoy gets, built in one place: the Clusters (CDS) and ClusterLoadAssignments (EDS)
of every configured cluster and of its request-class copies (``lrs.shed.classes``), with a running
shift's placement and each Envoy cluster's overload drop.

The publisher decides nothing. It receives in its constructor the cache it writes and three
sources of decisions made elsewhere:

- ``layout(c)``: the cluster's shift placement (:class:`~xds_server.policy.shift_layout.Layout`,
  None: the config's own), from :class:`~xds_server.load.gated_shifts.ShiftService`;
- ``closing(c)``: node ids whose responses close the client's connection (a finished hard switch);
- ``drop(name)``: the overload drop of an Envoy cluster (:class:`~xds_server.xds.resources.DropArgs`),
  from :class:`~xds_server.load.shedder.Shedder`;
- ``admission(name)``: :class:`~xds_server.xds.resources.AdmissionArgs` of a cluster that admits
  by free slots: its circuit breaker's limit, how many hosts least-request compares and the
  weights that replace decided ones (None: its configured ones), from the same shedder.

Shape::

    pub = EnvoyPublisher(cache, config_getter, layout=..., closing=..., drop=..., admission=...)
    pub.clusters(config)          # CDS: every Cluster; assignments of clusters gone are removed
    pub.assignment(c, routing)    # EDS: the cluster's and its class copies'; False when held back

A change of locality weighting (a shift between 0 and 100 %) or of the admission limit
republishes the Cluster before its assignment, in the same turn: Envoy warms the updated Cluster
on that assignment.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from xds_server.config import ClusterConfig, SentinelConfig, class_clusters
from xds_server.health.model import Routing
from xds_server.policy.shift_layout import Layout
from xds_server.xds.cache import InvalidResource, SnapshotCache, set_cla
from xds_server.xds.resources import (
    CLA_TYPE_URL,
    CLUSTER_TYPE_URL,
    AdmissionArgs,
    DropArgs,
    build_cla,
    build_cluster,
)
from xds_server.xds.shift_cla import shift_cla, shift_cluster

__all__ = ["EnvoyPublisher"]

log = logging.getLogger(__name__)


class EnvoyPublisher:
    """Writes CDS and EDS into ``cache`` (see module docstring)."""

    def __init__(self, cache: SnapshotCache, config: Callable[[], SentinelConfig], *,
                 layout: Callable[[ClusterConfig], Layout | None],
                 closing: Callable[[ClusterConfig], set[str]],
                 drop: Callable[[str], DropArgs],
                 admission: Callable[[str], AdmissionArgs | None] = lambda _name: None) -> None:
        self._cache, self._config = cache, config
        self._layout, self._closing, self._drop, self._admission = layout, closing, drop, admission
        self._weighted: dict[str, bool] = {}  # cluster -> locality weighting published in its Cluster
        self._limits: dict[str, tuple[int, int] | None] = {}  # cluster -> (limit, choices) in its Cluster

    @staticmethod
    def _cap(adm: AdmissionArgs | None) -> tuple[int, int] | None:
        """What of an admission the Cluster carries: (max_requests, choice_count)."""
        return None if adm is None else (adm.max_requests, adm.choice_count)

    def _cluster(self, c: ClusterConfig, lay: Layout | None, adm: AdmissionArgs | None) -> cluster_pb2.Cluster:
        on = lay is not None and lay.locality_weights is not None
        self._weighted[c.name] = on
        cap = self._limits[c.name] = self._cap(adm)
        msg = build_cluster(c)
        if cap is not None:  # admission by slots: only the requests in flight are capped
            msg.circuit_breakers.thresholds[0].max_requests.value = cap[0]
            if msg.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST:
                msg.least_request_lb_config.choice_count.value = cap[1]
        return shift_cluster(msg, on)

    def _copies(self, c: ClusterConfig, msg: cluster_pb2.Cluster) -> dict[str, cluster_pb2.Cluster]:
        """Envoy cluster name -> Cluster: ``msg`` and, per request class of ``c``, a renamed copy."""
        out = {c.name: msg}
        for name in class_clusters([c], self._config().lrs.shed.classes):
            if name != c.name:
                out[name] = copy = cluster_pb2.Cluster()
                copy.CopyFrom(msg)
                copy.name = name
        return out

    def clusters(self, config: SentinelConfig) -> set[str]:
        """Publish every Cluster of ``config`` (CDS, one set) and remove the assignments of Envoy
        clusters it no longer has. Returns the Envoy cluster names published."""
        cds: dict[str, cluster_pb2.Cluster] = {}
        for c in config.clusters:
            cds.update(self._copies(c, self._cluster(c, self._layout(c), self._admission(c.name))))
        self._cache.set_resources(CLUSTER_TYPE_URL, cds)
        for name in [n for n in self._cache.resources(CLA_TYPE_URL) if n not in cds]:
            self._cache.remove_resource(CLA_TYPE_URL, name)
        return set(cds)

    def assignment(self, c: ClusterConfig, routing: Mapping[str, Routing]) -> bool:
        """Publish ``c``'s ClusterLoadAssignment and its class copies' from ``routing`` (node id
        -> Routing), placed by the shift layout, each with its own drop. False when one was held
        back because Envoy would NACK it (:class:`~xds_server.xds.cache.InvalidResource`, logged)."""
        lay = self._layout(c)
        adm = self._admission(c.name)
        if adm is not None and adm.weights:
            routing = {i: Routing(adm.weights[i], r.health_status) if i in adm.weights else r
                       for i, r in routing.items()}
        if self._weighted.get(c.name, False) != (lay is not None and lay.locality_weights is not None) or \
                self._limits.get(c.name) != self._cap(adm):
            for name, msg in self._copies(c, self._cluster(c, lay, adm)).items():
                self._cache.set_resource(CLUSTER_TYPE_URL, name, msg)
        close = self._closing(c) if lay is not None else set()
        try:
            for name, cc in class_clusters([c], self._config().lrs.shed.classes).items():
                set_cla(self._cache, name, self._placed(build_cla(cc, routing, **self._drop(name)), lay, close))
        except InvalidResource as e:
            log.error("not publishing %s: %s", c.name, e)
            return False
        return True

    @staticmethod
    def _placed(cla: endpoint_pb2.ClusterLoadAssignment, lay: Layout | None,
                close: set[str]) -> endpoint_pb2.ClusterLoadAssignment:
        return cla if lay is None else shift_cla(cla, lay, close)
