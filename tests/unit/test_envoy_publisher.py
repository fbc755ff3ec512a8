"""The one publisher: every Cluster and ClusterLoadAssignment Envoy gets, with class copies, the
shift placement and each Envoy cluster's own drop, written into a real snapshot cache."""
from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from hypothesis import given
from hypothesis import strategies as st

from xds_server.config import ClusterConfig, NodeConfig, SentinelConfig
from xds_server.health.model import Routing, RoutingStatus
from xds_server.policy.shift_layout import Layout, NodeSpot, layout
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.publisher import EnvoyPublisher
from xds_server.xds.resources import CLA_TYPE_URL, CLUSTER_TYPE_URL, RESOURCE_TYPES, AdmissionArgs, DropArgs


def _config(classes: bool = False, clusters: tuple[str, ...] = ("llm",)) -> SentinelConfig:
    return SentinelConfig(
        clusters=[ClusterConfig(name=name, nodes=[
            NodeConfig(id=f"{name}-a", address="127.0.0.1:9001", probe_address="127.0.0.1:9101", priority=0,
                       locality={"region": "east"}),
            NodeConfig(id=f"{name}-b", address="127.0.0.1:9002", probe_address="127.0.0.1:9102", priority=1,
                       locality={"region": "west"})]) for name in clusters],
        lrs={"shed": {"enabled": classes, "classes": {"enabled": classes}}})


class _Decisions:
    """What the shift service and the shedder would say, set by the test."""

    def __init__(self) -> None:
        self.lay: dict[str, Layout] = {}
        self.close: set[str] = set()
        self.drops: dict[str, DropArgs] = {}
        self.limits: dict[str, AdmissionArgs] = {}

    def layout(self, c: ClusterConfig) -> Layout | None:
        return self.lay.get(c.name)

    def closing(self, c: ClusterConfig) -> set[str]:
        return self.close

    def drop(self, name: str) -> DropArgs:
        return self.drops.get(name, {})

    def admission(self, name: str) -> AdmissionArgs | None:
        return self.limits.get(name)


def _rig(cfg: SentinelConfig) -> tuple[EnvoyPublisher, SnapshotCache, _Decisions]:
    cache = SnapshotCache(validators={tu: t.validate for tu, t in RESOURCE_TYPES.items()})
    d = _Decisions()
    holder = {"cfg": cfg}
    return EnvoyPublisher(cache, lambda: holder["cfg"], layout=d.layout, closing=d.closing, drop=d.drop,
                          admission=d.admission), cache, d


def _get(cache: SnapshotCache, type_url: str, name: str, cls: type) -> object:
    msg = cls()
    cache.resources(type_url)[name].any.Unpack(msg)
    return msg


def _routing(c: ClusterConfig) -> dict[str, Routing]:
    return {n.id: Routing(100, RoutingStatus.HEALTHY) for n in c.nodes}


def test_clusters_and_assignments_include_each_request_class_copy_with_its_own_drop() -> None:
    cfg = _config(classes=True)
    pub, cache, d = _rig(cfg)
    assert pub.clusters(cfg) == {"llm", "llm~sheddable", "llm~critical"}
    for name in ("llm~sheddable", "llm~critical"):
        m = _get(cache, CLUSTER_TYPE_URL, name, cluster_pb2.Cluster)
        assert m.name == name and m.eds_cluster_config.service_name in ("", name)
    d.drops["llm~sheddable"] = {"shed_percent": 20.0, "shed_flip": False}
    assert pub.assignment(cfg.clusters[0], _routing(cfg.clusters[0]))
    assert set(cache.resources(CLA_TYPE_URL)) == {"llm", "llm~sheddable", "llm~critical"}
    sheddable = _get(cache, CLA_TYPE_URL, "llm~sheddable", endpoint_pb2.ClusterLoadAssignment)
    parent = _get(cache, CLA_TYPE_URL, "llm", endpoint_pb2.ClusterLoadAssignment)
    assert sheddable.cluster_name == "llm~sheddable"
    assert [(o.drop_percentage.numerator, o.drop_percentage.denominator) for o in sheddable.policy.drop_overloads] \
        == [(200_000, 2)]  # 20 % in millionths (FractionalPercent.MILLION)
    assert list(parent.policy.drop_overloads) == []  # the parent's drop is its own (none here)


def test_classes_off_publish_only_the_configured_clusters() -> None:
    cfg = _config()
    pub, cache, _ = _rig(cfg)
    assert pub.clusters(cfg) == {"llm"}
    assert pub.assignment(cfg.clusters[0], _routing(cfg.clusters[0]))
    assert list(cache.resources(CLA_TYPE_URL)) == ["llm"]


def test_a_cluster_removed_from_the_config_loses_its_assignment() -> None:
    both = _config(clusters=("llm", "chat"))
    pub, cache, _ = _rig(both)
    pub.clusters(both)
    for c in both.clusters:
        pub.assignment(c, _routing(c))
    assert set(cache.resources(CLA_TYPE_URL)) == {"llm", "chat"}
    pub.clusters(_config(clusters=("llm",)))
    assert set(cache.resources(CLA_TYPE_URL)) == {"llm"}
    assert set(cache.resources(CLUSTER_TYPE_URL)) == {"llm"}


def _spots(c: ClusterConfig) -> list[NodeSpot]:
    return [NodeSpot(n.id, n.priority, (n.locality.region, n.locality.zone, n.locality.sub_zone), n.capacity)
            for n in c.nodes]


@given(st.floats(min_value=0.0, max_value=100.0), st.booleans())
def test_the_cluster_carries_locality_weighting_exactly_while_the_layout_weights_localities(
        share: float, classes: bool) -> None:
    cfg = _config(classes=classes)
    c = cfg.clusters[0]
    pub, cache, d = _rig(cfg)
    names = pub.clusters(cfg)
    d.lay["llm"] = lay = layout(_spots(c), {"llm-b"}, share)
    assert pub.assignment(c, _routing(c))
    weighted = lay.locality_weights is not None
    for name in names:  # the parent and every class copy, republished in the same turn
        m = _get(cache, CLUSTER_TYPE_URL, name, cluster_pb2.Cluster)
        assert m.common_lb_config.HasField("locality_weighted_lb_config") is weighted
        cla = _get(cache, CLA_TYPE_URL, name, endpoint_pb2.ClusterLoadAssignment)
        prio = {e.endpoint.hostname: lle.priority for lle in cla.endpoints for e in lle.lb_endpoints}
        assert prio == dict(lay.priority)
        assert all(lle.HasField("load_balancing_weight") is weighted for lle in cla.endpoints)
    d.lay.clear()  # the shift ends: weighting off again on the next assignment
    assert pub.assignment(c, _routing(c))
    m = _get(cache, CLUSTER_TYPE_URL, "llm", cluster_pb2.Cluster)
    assert not m.common_lb_config.HasField("locality_weighted_lb_config")


def test_closing_nodes_are_marked_only_under_a_layout() -> None:
    cfg = _config()
    c = cfg.clusters[0]
    pub, cache, d = _rig(cfg)
    pub.clusters(cfg)
    d.close = {"llm-a"}
    pub.assignment(c, _routing(c))  # no layout: nothing is closing
    cla = _get(cache, CLA_TYPE_URL, "llm", endpoint_pb2.ClusterLoadAssignment)
    assert not any(e.metadata.filter_metadata for lle in cla.endpoints for e in lle.lb_endpoints)
    d.lay["llm"] = layout(_spots(c), {"llm-b"}, 100.0)
    pub.assignment(c, _routing(c))
    cla = _get(cache, CLA_TYPE_URL, "llm", endpoint_pb2.ClusterLoadAssignment)
    marked = {e.endpoint.hostname for lle in cla.endpoints for e in lle.lb_endpoints if e.metadata.filter_metadata}
    assert marked == {"llm-a"}


def test_an_assignment_envoy_would_nack_is_held_back_and_the_last_good_one_kept() -> None:
    cfg = _config()
    c = cfg.clusters[0]
    pub, cache, d = _rig(cfg)
    pub.clusters(cfg)
    assert pub.assignment(c, _routing(c))
    before = cache.resources(CLA_TYPE_URL)["llm"].version
    d.lay["llm"] = Layout({"llm-a": 0, "llm-b": 1000}, {"llm-a": ("east", "", ""), "llm-b": ("west", "", "")},
                          None)  # a priority Envoy refuses (over MAX_PRIORITY)
    assert pub.assignment(c, _routing(c)) is False
    assert cache.resources(CLA_TYPE_URL)["llm"].version == before


def test_admission_by_slots_caps_only_requests_in_flight_and_republishes_the_cluster_when_it_changes() -> None:
    cfg = _config()
    pub, cache, d = _rig(cfg)
    c = cfg.clusters[0]
    pub.clusters(cfg)

    def breaker() -> cluster_pb2.CircuitBreakers.Thresholds:
        m = _get(cache, CLUSTER_TYPE_URL, "llm", cluster_pb2.Cluster)
        assert isinstance(m, cluster_pb2.Cluster)
        return m.circuit_breakers.thresholds[0]

    configured = breaker().max_requests.value
    assert configured == c.max_requests
    d.limits["llm"] = AdmissionArgs(32, 10, {"llm-b": 77})
    version = cache.type_generation(CLUSTER_TYPE_URL)
    assert pub.assignment(c, _routing(c))
    t = breaker()
    assert t.max_requests.value == 32 and t.max_pending_requests.value == c.max_requests
    lb = _get(cache, CLUSTER_TYPE_URL, "llm", cluster_pb2.Cluster)
    assert isinstance(lb, cluster_pb2.Cluster) and lb.least_request_lb_config.choice_count.value == 10
    weights = {e.endpoint.hostname or e.endpoint.address.socket_address.port_value: e.load_balancing_weight.value
               for loc in _get(cache, CLA_TYPE_URL, "llm", endpoint_pb2.ClusterLoadAssignment).endpoints
               for e in loc.lb_endpoints}
    assert sorted(weights.values()) == [77, 100]  # the busy node's weight given back, the other as decided
    assert t.max_connections.value == c.max_requests and cache.type_generation(CLUSTER_TYPE_URL) != version
    version = cache.type_generation(CLUSTER_TYPE_URL)
    assert pub.assignment(c, _routing(c))
    assert cache.type_generation(CLUSTER_TYPE_URL) == version  # unchanged: not sent again
    del d.limits["llm"]
    assert pub.assignment(c, _routing(c)) and breaker().max_requests.value == configured
    lb = _get(cache, CLUSTER_TYPE_URL, "llm", cluster_pb2.Cluster)
    assert isinstance(lb, cluster_pb2.Cluster) and not lb.HasField("least_request_lb_config")
