"""README's "What to monitor": every metric it tells operators to alert on is one the control plane
or the agent exposes (so a rename cannot leave the alerts pointing at nothing)."""
from __future__ import annotations

import re

from deploy_checks import ROOT
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node_probe.metrics import AgentMetrics
from node_probe.proto import probe_pb2
from xds_server.admin.metrics import ControlPlaneCollector
from xds_server.config import parse_config
from xds_server.probing.memory import InMemoryProbes
from xds_server.process.clock import ManualClock
from xds_server.server import ControlPlane

_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_info")


class _IdleAgent:
    """What AgentMetrics reads from an agent at scrape time: an agent with no engine or GPU data."""

    cfg = None
    engine_state = 0
    stalled = False
    subscriber_count = 0

    def telemetry(self) -> probe_pb2.Telemetry:
        return probe_pb2.Telemetry()


def _families(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def test_every_metric_in_what_to_monitor_is_exposed():
    cfg = parse_config({"clusters": [{"name": "llm", "nodes": [
        {"id": "n0", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:9001"}]}]})
    cp = ControlPlane(cfg, clock=ManualClock(), probe_sources=InMemoryProbes())
    cp.open()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ControlPlaneCollector(cp.view))
    exposed = _families(generate_latest(reg).decode())
    exposed |= _families(AgentMetrics(_IdleAgent()).exposition().decode())  # type: ignore[arg-type] - a stand-in agent
    assert "sentinel_fail_static" in exposed and "node_probe_engine_stalled" in exposed

    named = set(re.findall(r"\b((?:sentinel|node_probe)_[a-z_]+)", _section("What to monitor")))
    assert len(named) >= 15, named
    missing = []
    for name in sorted(named):
        base = next((name.removesuffix(s) for s in _SUFFIXES if name.endswith(s)), name)
        if name not in exposed and base not in exposed:
            missing.append(name)
    assert not missing, f"README names metrics nobody exposes: {missing}"
