"""Config validation: a bad file names the field and the reason; defaults come from the seeds."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from xds_server.config import ConfigError, load_config, parse_config

GOOD = {
    "clusters": [{
        "name": "llm",
        "nodes": [
            {"id": "a", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:50051"},
            {"id": "b", "address": "127.0.0.1:8002", "probe_address": "127.0.0.1:50052",
             "locality": {"region": "r1", "zone": "z1"}, "priority": 1, "capacity": 4},
        ],
    }],
}


def _with(path: str, value) -> dict:
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    cur = doc
    parts = path.split(".")
    for p in parts[:-1]:
        cur = cur[int(p)] if p.isdigit() else cur.setdefault(p, {})
    cur[parts[-1]] = value
    return doc


def test_good_config_has_seed_defaults():
    cfg = parse_config(GOOD)
    h = cfg.health
    assert (h.heartbeat.interval.ms, h.heartbeat.grace.ms, h.heartbeat.consecutive_misses) == (100.0, 80.0, 3)
    assert (h.probes.ttft_healthy.ms, h.probes.ttft_timeout.ms, h.probes.failures_to_eject) == (200.0, 800.0, 2)
    assert h.probes.good_to_recover == 3 and h.probes.degraded_weight_factor == 0.3 and h.rtt.ewma_alpha == 0.2
    c = cfg.clusters[0]
    assert c.healthy_panic_threshold_percent == 0 and c.update_merge_window.s == 0
    assert c.lb_policy == "LEAST_REQUEST"
    assert [n.id for _, n in cfg.nodes()] == ["a", "b"]


@pytest.mark.parametrize("path,value,field,reason", [
    ("clusters.0.nodes.0.address", "127.0.0.1", "clusters.0.nodes.0.address", "HOST:PORT"),
    ("clusters.0.nodes.0.address", "localhost:80", "clusters.0.nodes.0.address", "IP literal"),
    ("clusters.0.nodes.1.probe_address", "127.0.0.1:99999", "clusters.0.nodes.1.probe_address", "0..65535"),
    ("clusters.0.nodes.1.capacity", 0, "clusters.0.nodes.1.capacity", "greater than or equal to 1"),
    ("clusters.0.nodes.1.priority", 200, "clusters.0.nodes.1.priority", "less than or equal to 128"),
    ("clusters.0.lb_policy", "RANDOM", "clusters.0.lb_policy", "LEAST_REQUEST"),
    ("health.heartbeat.consecutive_misses", 0, "health.heartbeat.consecutive_misses", "greater than or equal to 1"),
    ("health.probes.ttft_timeout", "100ms", "health.probes", "ttft_timeout must be longer than ttft_healthy"),
    ("health.heartbeat.interval", "fast", "health.heartbeat.interval", "'fast' is not a duration"),
    ("health.heartbeat.interval", 100, "health.heartbeat.interval", "100 has no unit"),
    ("health.heartbeat.interval", "0s", "health.heartbeat.interval", "must be longer than 0"),
    ("health.heartbeat.grace", "-5ms", "health.heartbeat.grace", "must not be negative"),
    ("health.heartbeat_interval_ms", "fast", "health", "heartbeat_interval_ms: 'fast' is not a number of ms"),
    ("health.ttft_timeout_ms", 100, "health.probes", "ttft_timeout must be longer than ttft_healthy"),
    ("health.no_such_knob", 1, "health.no_such_knob", "Extra inputs are not permitted"),
    ("clusters.0.nodes.1.id", "a", "clusters.0", "duplicate node id 'a'"),
    ("clusters.0.nodes.1.priority", 2, "clusters.0", "contiguous from 0"),
])
def test_bad_field_is_named_with_reason(path, value, field, reason):
    with pytest.raises(ConfigError) as ei:
        parse_config(_with(path, value))
    msg = str(ei.value)
    assert f"{field}:" in msg, msg
    assert reason in msg, msg


def test_missing_clusters_and_non_mapping():
    with pytest.raises(ConfigError, match=r"clusters: Field required"):
        parse_config({})
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        parse_config(["x"])


def test_load_config_reports_yaml_position(tmp_path: Path):
    p = tmp_path / "bad.yaml"
    p.write_text("clusters:\n  - name: llm\n    nodes: [\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+, column \d+"):
        load_config(p)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")


def test_check_config_cli(tmp_path: Path):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(GOOD))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_with("clusters.0.nodes.0.capacity", -1)))
    cmd = [sys.executable, "-m", "xds_server.cli", "check-config"]
    r = subprocess.run(cmd + [str(good)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "OK (1 cluster(s), 2 node(s))" in r.stdout
    r = subprocess.run(cmd + [str(bad)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "clusters.0.nodes.0.capacity: Input should be greater than or equal to 1" in r.stderr
