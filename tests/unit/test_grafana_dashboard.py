"""deploy/grafana/xds-sentinel.json: valid JSON, and every metric its expressions and variables
name is one the control plane's /metrics or the agent's /metrics exports (a rename that forgets
the dashboard fails here)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from test_control_core import all_healthy, config, in_memory
from test_metrics_exposition import exposition

from node_probe.metrics import AgentMetrics
from node_probe.proto import probe_pb2

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "xds-sentinel.json"
METRIC = re.compile(r"\b((?:sentinel|node_probe)_[a-zA-Z0-9_:]*)")


class _Agent:
    """What the agent collector reads, with one GPU reading."""

    engine_state = probe_pb2.ENGINE_STATE_READY
    stalled = False
    subscriber_count = 1

    def telemetry(self) -> probe_pb2.Telemetry:
        t = probe_pb2.Telemetry()
        t.gpu.state = probe_pb2.NVML_STATE_OK
        t.gpu.gpus.add(index=0, memory_total_bytes=100, memory_used_bytes=40, utilization_ratio=0.5,
                       temperature_c=60.0, power_w=300.0, ecc_uncorrected=0)
        return t


def exported() -> set[str]:
    cp, clock, probes = in_memory(config())
    all_healthy(cp, clock, probes)
    agent = AgentMetrics(_Agent())
    names: set[str] = set()
    for text in (exposition(cp), agent.exposition().decode()):
        for fam in text_string_to_metric_families(text):
            names.add(fam.name)
            names.update(s.name for s in fam.samples)
            # a declared family with no sample yet (no NACK so far) still names its series
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "info": ("_info",)}
            names.update(fam.name + sfx for sfx in suffixes.get(fam.type, ()))
    return names


def expressions(dash: dict) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        if isinstance(q, dict):
            out.append(q["query"])
    return out


def test_every_dashboard_expression_names_an_exported_metric():
    dash = json.loads(DASHBOARD.read_text())
    exprs = expressions(dash)
    assert len(dash["panels"]) >= 20 and len(exprs) >= 30
    names = exported()
    unknown = {}
    for expr in exprs:
        used = METRIC.findall(expr)
        assert used, f"expression names no sentinel/node_probe metric: {expr}"
        missing = [m for m in used if m not in names]
        if missing:
            unknown[expr] = missing
    assert unknown == {}
    # the families the issue asks operators to see are on the dashboard
    text = "\n".join(exprs)
    for must in ("sentinel_node_state", "sentinel_node_ewma_rtt_seconds", "sentinel_node_last_ttft_seconds",
                 "sentinel_node_probe_results_total", "sentinel_node_ejections_total", "sentinel_fail_static",
                 "sentinel_build_info", "node_probe_probe_ttft_seconds_bucket", "node_probe_engine_stalled",
                 "node_probe_metrics_scrape_errors_total", "node_probe_gpu_memory_used_bytes"):
        assert must in text, must


def test_panel_ids_are_unique_and_panels_do_not_overlap():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine
