"""Cluster policy reads no heartbeat record, so a publish may read the health table's records with
steady heartbeats still folded (``HealthTable.unsettled``) and leave the runs open."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_health_table import records

from xds_server.config import HealthConfig
from xds_server.health.phi import ArrivalStats
from xds_server.health.records import Heartbeats, NodeHealth, NodeState
from xds_server.health.routing import node_routing
from xds_server.policy.cluster_routing import cluster_routing

CFG = HealthConfig()

heartbeats = st.builds(Heartbeats, st.one_of(st.none(), st.floats(0, 1000)), st.integers(0, 10), st.booleans(),
                       st.one_of(st.none(), st.builds(ArrivalStats, st.floats(1, 1000), st.floats(0, 1e4),
                                                      st.integers(0, 50))))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(NodeState)), records, heartbeats), min_size=1, max_size=6),
       st.floats(0, 1000))
def test_prop_cluster_routing_is_the_same_whatever_the_heartbeat_records(nodes, now_s):
    built = [(f"n{i}", NodeHealth(f"n{i}", state, **rec)) for i, (state, rec, _) in enumerate(nodes)]
    other = [(nid, NodeHealth(nh.node_id, nh.state, nh.reason, nh.since_s, hb, nh.rtt, nh.probe, nh.engine,
                              nh.ejection, nh.ramp, nh.drain, nh.validation))
             for (nid, nh), (_, _, hb) in zip(built, nodes, strict=True)]
    a = cluster_routing([(nid, 1, nh) for nid, nh in built], {}, now_s, CFG)
    b = cluster_routing([(nid, 1, nh) for nid, nh in other], {}, now_s, CFG)
    assert a == b


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(NodeState)), records, heartbeats), min_size=1, max_size=6),
       st.floats(0, 1000))
def test_prop_cluster_routing_with_the_callers_views_is_the_same_decision(nodes, now_s):
    built = [(f"n{i}", 1, NodeHealth(f"n{i}", state, **rec)) for i, (state, rec, _) in enumerate(nodes)]
    views = {nid: node_routing(nh, CFG) for nid, _, nh in built}
    assert cluster_routing(built, {}, now_s, CFG, views=views) == cluster_routing(built, {}, now_s, CFG)
