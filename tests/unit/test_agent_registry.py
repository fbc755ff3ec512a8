"""Nodes that registered themselves (xds_server.discovery.agent_registry): what a registration
changes, when a node whose agent stayed away is forgotten, and what discovery merges."""
from __future__ import annotations

from xds_server.config import NodeConfig
from xds_server.discovery.agent_registry import AgentRegistry


def _node(nid: str, address: str = "10.0.0.1:8000") -> NodeConfig:
    return NodeConfig(id=nid, address=address)


def _registry() -> tuple[AgentRegistry, list[int]]:
    changes: list[int] = []
    return AgentRegistry(lambda: changes.append(1)), changes


def test_a_registration_changes_the_node_sets_once_and_a_repeat_not_at_all():
    reg, changes = _registry()
    assert reg.register("llm", _node("a"), 0.0) and len(changes) == 1
    assert not reg.register("llm", _node("a"), 1.0) and len(changes) == 1   # the agent dialled again
    assert reg.register("llm", _node("a", "10.0.0.2:8000"), 2.0) and len(changes) == 2   # it moved
    assert reg.register("pool", _node("a", "10.0.0.2:8000"), 3.0) and len(changes) == 3  # another cluster
    assert reg.found() == {"pool": [_node("a", "10.0.0.2:8000")]}
    assert reg.registrations == 4 and "a" in reg and reg.ids() == frozenset({"a"})


def test_a_node_is_forgotten_only_after_its_agent_stayed_away_for_its_clusters_forget_after():
    reg, changes = _registry()
    reg.register("llm", _node("a"), 0.0)
    reg.stream("a", True, 0.0)
    assert reg.expire(1_000.0, {"llm": 600.0}) == []        # its stream is open: kept however long
    reg.stream("a", False, 1_000.0)
    assert reg.expire(1_500.0, {"llm": 600.0}) == []        # away 500 s of 600
    reg.stream("a", True, 1_550.0)                          # back, and away again
    reg.stream("a", False, 1_560.0)
    assert reg.expire(2_100.0, {"llm": 600.0}) == []        # 540 s since the last end
    assert reg.expire(2_161.0, {"llm": 600.0}) == ["a"] and reg.found() == {}
    assert len(changes) == 2


def test_a_registered_node_that_never_opened_a_stream_counts_from_its_registration():
    reg, _ = _registry()
    reg.register("llm", _node("a"), 10.0)
    assert reg.expire(15.0, {"llm": 10.0}) == []
    assert reg.expire(20.0, {"llm": 10.0}) == ["a"]


def test_a_cluster_that_no_longer_takes_registrations_loses_its_registered_nodes_at_once():
    reg, _ = _registry()
    reg.register("llm", _node("a"), 0.0)
    reg.register("pool", _node("b"), 0.0)
    reg.stream("a", True, 0.0)
    assert reg.expire(1.0, {"pool": 600.0}) == ["a"]
    assert reg.found() == {"pool": [_node("b")]}


def test_two_streams_of_one_agent_keep_it_connected_until_both_end():
    reg, _ = _registry()
    reg.register("llm", _node("a"), 0.0)
    reg.stream("a", True, 0.0)
    reg.stream("a", True, 1.0)   # its new stream, before the old one's end was read
    reg.stream("a", False, 2.0)
    assert reg.status("llm") == {"source": "agents", "nodes": ["a"], "connected": ["a"], "registrations": 1,
                                  "error": None, "errors": 0}
    reg.stream("a", False, 3.0)
    assert reg.status("llm")["connected"] == []
    assert reg.expire(3.0 + 9.9, {"llm": 10.0}) == [] and reg.expire(3.0 + 10.0, {"llm": 10.0}) == ["a"]


def test_metrics_read_a_cluster_that_takes_registrations_like_any_discovered_one():
    from prometheus_client import CollectorRegistry, generate_latest

    from xds_server.admin.metrics import ControlPlaneCollector
    from xds_server.config import parse_config
    from xds_server.probing.memory import InMemoryProbes
    from xds_server.process.clock import ManualClock
    from xds_server.server import ControlPlane

    cp = ControlPlane(parse_config({"clusters": [{"name": "llm", "discovery": {"agents": {"allow": ["*"]}},
                                                  "nodes": []}]}), clock=ManualClock(), probe_sources=InMemoryProbes())
    cp.open()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ControlPlaneCollector(cp.view))
    text = generate_latest(reg).decode()
    assert 'sentinel_discovery_nodes{cluster="llm",source="agents"} 0.0' in text
    assert 'sentinel_discovery_errors_total{cluster="llm",source="agents"} 0.0' in text
