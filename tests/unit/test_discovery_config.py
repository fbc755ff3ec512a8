"""Discovery config, targets file errors and the file source's keep-the-last-good rule."""
from __future__ import annotations

import logging

import pytest

from xds_server.config import ConfigError, NodeConfig, parse_config
from xds_server.config.discovery import FileDiscoveryConfig
from xds_server.discovery import FileTargets, TargetsError, drop_readdressed, merge_discovered, parse_targets

NODE = {"id": "s0", "address": "10.0.0.1:8000", "probe_address": "10.0.0.1:9100"}


def cfg(discovery: dict | None = None, nodes: list | None = None):
    cluster = {"name": "llm", "nodes": nodes if nodes is not None else [NODE]}
    if discovery is not None:
        cluster["discovery"] = discovery
    return parse_config({"tls": {"agents": {"mode": "plaintext"}}, "clusters": [cluster]})


def test_discovery_config_defaults_and_errors_name_the_field():
    c = cfg({"file": {"path": "t.yaml"},
             "kubernetes": {"label_selector": {"app": "vllm"}, "target_port": "http", "probe_port": 9100}})
    k = c.clusters[0].discovery.kubernetes
    assert (c.clusters[0].discovery.file.interval.s, k.namespace, k.watch_timeout.s) == (1.0, "default", 300)
    for bad, where in [({}, "clusters.0.discovery: discovery needs a source"),
                       ({"file": {"path": "t", "interval_s": 0}},
                        "clusters.0.discovery.file.interval: 0 must be longer than 0"),
                       ({"kubernetes": {"label_selector": {}, "target_port": 1, "probe_port": 2}},
                        "clusters.0.discovery.kubernetes.label_selector"),
                       ({"kubernetes": {"label_selector": {"app": "a b"}, "target_port": 1, "probe_port": 2}},
                        "label value 'a b'"),
                       ({"kubernetes": {"label_selector": {"a": "b"}, "target_port": "Not_A_Name", "probe_port": 2}},
                        "clusters.0.discovery.kubernetes.target_port"),
                       ({"kubernetes": {"label_selector": {"a": "b"}, "target_port": 1, "probe_port": 70000}},
                        "probe_port 70000 outside 1..65535")]:
        with pytest.raises(ConfigError) as e:
            cfg(bad)
        assert where in str(e.value), (bad, str(e.value))


@pytest.mark.parametrize("text, message", [
    ("", "t.yaml: empty (write [] for no nodes)"),
    ("[{id: a", "t.yaml: not valid YAML/JSON at line 1"),
    ("{a: 1}", "expected a list of nodes"),
    ("- 3", "entry 0: expected a mapping, got int"),
    ("- {id: a, address: 'x:1', probe_address: '10.0.0.1:9100'}",
     "entry 0 (id 'a'): address: host 'x' must be an IP literal"),
    ("- {id: a, probe_address: '10.0.0.1:2'}", "entry 0 (id 'a'): address: Field required"),
    ("- {id: a, address: '10.0.0.1:1', probe_address: '10.0.0.1:2'}\n"
     "- {id: a, address: '10.0.0.2:1', probe_address: '10.0.0.2:2'}",
     "entry 1 (id 'a'): duplicate id (entry 0 has it too)"),
])
def test_targets_errors_name_file_entry_and_reason(text, message):
    with pytest.raises(TargetsError) as e:
        parse_targets(text, "t.yaml")
    assert message in str(e.value)
    assert str(e.value).startswith("targets file t.yaml: ")


def test_empty_list_means_no_nodes():
    assert parse_targets("[]", "t") == () and parse_targets("nodes: []", "t") == ()


def test_file_source_keeps_last_good_on_a_bad_file_and_counts_each_bad_content_once(tmp_path, caplog):
    path = tmp_path / "targets.yaml"
    src = FileTargets("llm", FileDiscoveryConfig(path=str(path)), on_change=lambda: None)
    assert src.check() is False and src.errors == 1 and "cannot read" in src.error  # missing
    path.write_text("- {id: a, address: '10.0.0.1:8000', probe_address: '10.0.0.1:9100'}\n")
    assert src.check() is True and [n.id for n in src.nodes] == ["a"] and src.error is None
    assert src.check() is False and src.loads == 1  # unchanged content is not parsed again
    caplog.set_level(logging.ERROR, "xds_server.discovery")
    caplog.clear()
    path.write_text("- {id: a, address: '10.0.0.1:8000', probe_address: '10.0.0.1:9100'}\n- {id: b}\n")
    assert src.check() is False and src.check() is False
    assert [n.id for n in src.nodes] == ["a"] and src.errors == 2
    assert "entry 1 (id 'b'): address: Field required" in src.error
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and str(path) in logged[0] and "keeping the last good 1 node(s)" in logged[0]
    path.write_text("[]")
    assert src.check() is True and src.nodes == () and src.error is None
    assert src.status()["loads"] == 2


def test_merge_leaves_out_a_discovered_node_that_clashes_or_leaves_a_priority_gap():
    from xds_server.config import NodeConfig
    static = cfg(nodes=[NODE])
    clash = NodeConfig(**{**NODE, "address": "10.0.0.9:8000"})
    gap = NodeConfig(id="far", address="10.0.0.3:8000", probe_address="10.0.0.3:9100", priority=3)
    ok = NodeConfig(id="d1", address="10.0.0.2:8000", probe_address="10.0.0.2:9100", priority=1)
    merged, problems = merge_discovered(static, {"llm": [clash, gap, ok]})
    assert [n.id for n in merged.clusters[0].nodes] == ["s0", "d1"]
    assert problems == ("cluster 'llm': discovered node 's0' left out: id already used in this cluster",
                        "cluster 'llm': discovered node 'far' left out: priority 3 leaves a gap "
                        "(priorities run 0..N without skipping)")


def test_drop_readdressed_removes_the_node_from_declared_and_leaving():
    from xds_server.config import NodeConfig
    old = cfg(nodes=[NODE, {"id": "s1", "address": "10.0.0.2:8000", "probe_address": "10.0.0.2:9100"}])
    new = cfg(nodes=[{**NODE, "address": "10.0.0.7:8000"},
                     {"id": "s1", "address": "10.0.0.2:8000", "probe_address": "10.0.0.2:9100"}])
    leaving = {"s0": (old.clusters[0], NodeConfig(**NODE))}
    declared, left, gone = drop_readdressed(old, leaving, old, new)
    assert gone == ("s0",) and left == {} and [n.id for n in declared.clusters[0].nodes] == ["s1"]
    assert drop_readdressed(old, {}, old, old) == (old, {}, ())


def test_kubernetes_discovery_needs_tls_agents_mode_stated_and_file_nodes_off_loopback_are_left_out():
    kube = {"kubernetes": {"label_selector": {"app": "vllm"}, "target_port": 8000, "probe_port": 9100}}
    with pytest.raises(ConfigError, match=r"clusters\.0\.discovery\.kubernetes: pods are dialled on their pod IPs"):
        parse_config({"clusters": [{"name": "llm", "nodes": [], "discovery": kube}]})
    local = {"id": "s0", "address": "127.0.0.1:8000", "probe_address": "127.0.0.1:9100"}
    static = parse_config({"clusters": [{"name": "llm", "nodes": [local]}]})
    far = NodeConfig(id="far", address="10.0.0.9:8000", probe_address="10.0.0.9:9100")
    near = NodeConfig(id="near", address="127.0.0.1:8009", probe_address="127.0.0.1:9109")
    merged, problems = merge_discovered(static, {"llm": [far, near]})
    assert [n.id for n in merged.clusters[0].nodes] == ["s0", "near"]
    assert problems == ("cluster 'llm': discovered node 'far' left out: probe address 10.0.0.9:9100 is not a "
                        "loopback address: set tls.agents.mode to mtls or tls (or to plaintext to dial agents "
                        "unauthenticated explicitly)",)
    stated = parse_config({"tls": {"agents": {"mode": "plaintext"}}, "clusters": [{"name": "llm", "nodes": [NODE]}]})
    assert [n.id for n in merge_discovered(stated, {"llm": [far]})[0].clusters[0].nodes] == [NODE["id"], "far"]
