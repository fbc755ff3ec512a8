"""Health -> Envoy resources: weights, health_status, Cluster settings (fc01, fc04)."""
from __future__ import annotations

from itertools import pairwise

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import health_check_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import parse_config
from xds_server.health.model import Routing
from xds_server.xds.resources import build_cla, build_cluster, clamp_weights
from xds_server.xds.validation import MAX_LOCALITY_WEIGHT_SUM


def cfg(nodes, **cluster):
    return parse_config({"clusters": [{"name": "llm", "nodes": nodes, **cluster}]})


NODES = [
    {"id": "b", "address": "127.0.0.1:8002", "probe_address": "127.0.0.1:1",
     "locality": {"region": "r1", "zone": "z1"}},
    {"id": "a", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:2",
     "locality": {"region": "r1", "zone": "z1"}},
    {"id": "c", "address": "127.0.0.1:8003", "probe_address": "127.0.0.1:3", "priority": 1, "capacity": 3},
]


def test_cla_groups_by_priority_and_locality_and_maps_health():
    c = cfg(NODES).clusters[0]
    cla = build_cla(c, {"a": Routing(100, "HEALTHY"), "b": Routing(30, "HEALTHY"), "c": Routing(300, "UNHEALTHY")})
    assert cla.cluster_name == "llm"
    assert [(e.priority, e.locality.zone) for e in cla.endpoints] == [(0, "z1"), (1, "")]
    p0 = cla.endpoints[0].lb_endpoints
    assert [(e.endpoint.hostname, e.endpoint.address.socket_address.port_value, e.load_balancing_weight.value,
             e.health_status) for e in p0] == [("a", 8001, 100, health_check_pb2.HEALTHY),
                                               ("b", 8002, 30, health_check_pb2.HEALTHY)]
    p1 = cla.endpoints[1].lb_endpoints[0]
    assert p1.health_status == health_check_pb2.UNHEALTHY and p1.load_balancing_weight.value == 300


def test_node_without_routing_is_published_unhealthy_never_unknown():
    c = cfg(NODES).clusters[0]
    cla = build_cla(c, {})
    statuses = [e.health_status for lle in cla.endpoints for e in lle.lb_endpoints]
    assert statuses == [health_check_pb2.UNHEALTHY] * 3


def test_same_input_same_bytes():
    c = cfg(NODES).clusters[0]
    r = {"a": Routing(100, "HEALTHY"), "b": Routing(100, "DRAINING"), "c": Routing(300, "HEALTHY")}
    assert build_cla(c, r).SerializeToString(deterministic=True) == \
        build_cla(c, dict(reversed(r.items()))).SerializeToString(deterministic=True)


def test_cluster_sets_panic_threshold_0_and_merge_window_0():
    """Field case fc04."""
    cl = build_cluster(cfg(NODES).clusters[0])
    assert cl.type == cluster_pb2.Cluster.EDS and cl.eds_cluster_config.eds_config.HasField("ads")
    assert cl.common_lb_config.HasField("healthy_panic_threshold")
    assert cl.common_lb_config.healthy_panic_threshold.value == 0.0
    assert cl.common_lb_config.update_merge_window.ToMilliseconds() == 0
    assert cl.common_lb_config.HasField("update_merge_window")
    assert cl.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST
    assert cl.circuit_breakers.thresholds[0].max_requests.value == 100_000
    assert cl.circuit_breakers.thresholds[0].max_retries.value == 1024
    od = cl.outlier_detection  # gateway failures eject; 5xx and success rate only count (a query of death)
    assert od.consecutive_5xx.value == 5 and od.enforcing_consecutive_5xx.value == 0
    assert od.consecutive_gateway_failure.value == 5 and od.enforcing_consecutive_gateway_failure.value == 100
    assert od.enforcing_success_rate.value == 0


def test_http2_upstream_option():
    cl = build_cluster(cfg(NODES, upstream_protocol="http2", lb_policy="ROUND_ROBIN").clusters[0])
    assert "envoy.extensions.upstreams.http.v3.HttpProtocolOptions" in cl.typed_extension_protocol_options
    assert cl.lb_policy == cluster_pb2.Cluster.ROUND_ROBIN


def test_weight_never_zero_and_locality_sum_fits_uint32():
    """Field case fc01."""
    assert clamp_weights([0, -5, 7]) == [1, 1, 7]
    big = [2**31 * 100] * 3
    out = clamp_weights(big)
    assert sum(out) <= MAX_LOCALITY_WEIGHT_SUM and len(set(out)) == 1 and min(out) >= 1
    # 150 nodes sharing a budget, one scoring 0
    out = clamp_weights([0] + [10**8] * 149)
    assert out[0] == 1 and sum(out) <= MAX_LOCALITY_WEIGHT_SUM


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-10, 2**40), min_size=1, max_size=200))
def test_prop_clamped_weights_valid_and_order_kept(ws):
    out = clamp_weights(ws)
    assert all(isinstance(w, int) and w >= 1 for w in out)
    assert sum(out) <= MAX_LOCALITY_WEIGHT_SUM
    for (a, b), (x, y) in zip(pairwise(ws), pairwise(out), strict=True):
        if a <= b:
            assert x <= y


def test_type_label_is_the_short_name_of_served_types_and_unknown_otherwise():
    from xds_server.xds.resources import CLA_TYPE_URL, CLUSTER_TYPE_URL, type_label

    assert type_label(CLUSTER_TYPE_URL) == "Cluster"
    assert type_label(CLA_TYPE_URL) == "ClusterLoadAssignment"
    assert type_label("type.googleapis.com/envoy.config.listener.v3.Listener") == "unknown"
    assert type_label("x" * 10_000) == "unknown"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["a", "b", "c"]),
                                st.tuples(st.integers(1, 400), st.sampled_from(["HEALTHY", "UNHEALTHY", "DRAINING"]))),
                min_size=2, max_size=6))
def test_prop_each_assignment_carries_its_own_routing_whatever_was_built_before(routings):
    # endpoints are built once per (node, status, weight) and copied: one build must never leak
    # into another, nor a later build change what an earlier assignment holds
    c = cfg(NODES).clusters[0]
    statuses = {"HEALTHY": health_check_pb2.HEALTHY, "UNHEALTHY": health_check_pb2.UNHEALTHY,
                "DRAINING": health_check_pb2.DRAINING}
    caps = {"a": 1, "b": 1, "c": 3}
    built = []
    for raw in routings:
        r = {nid: Routing(w, s) for nid, (w, s) in raw.items()}
        built.append((build_cla(c, r), r))
    for cla, r in built:
        got = {e.endpoint.hostname: (e.load_balancing_weight.value, e.health_status)
               for lle in cla.endpoints for e in lle.lb_endpoints}
        want = {nid: (r[nid].weight, statuses[r[nid].health_status]) if nid in r
                else (caps[nid] * 100, health_check_pb2.UNHEALTHY) for nid in caps}
        assert got == want
