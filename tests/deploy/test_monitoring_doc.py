"""docs/monitoring.md's "What to monitor": every metric it tells operators to alert on is one the control plane,
the agent or the relay exposes (so a rename cannot leave the alerts pointing at nothing), and the
bounds and refusals of issues 27 and 28 have their alerts there. The control plane is started
(mTLS on every channel, so its TLS, refusal and feed families exist) and its admin ``/metrics``
read over HTTP; the agent's and the relay's registries are theirs, built as they build them."""
from __future__ import annotations

import re

import aiohttp
from aiohttp import web
from deploy_checks import ROOT
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node_probe.agent import ProbeAgent
from node_probe.config import AgentConfig
from node_probe.metrics import AgentMetrics
from node_probe.proto import probe_pb2
from sentinel_relay.config import RelayConfig
from sentinel_relay.connections import BoundedServer
from sentinel_relay.metrics import RelayMetrics
from xds_server.admin.metrics import ControlPlaneCollector
from xds_server.config import parse_config
from xds_server.probing.memory import InMemoryProbes
from xds_server.process.clock import ManualClock
from xds_server.server import ControlPlane
from xds_server.testing import TestCA

_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_info")
#: Added with the bounds of /live, the routing feed and the relay (issue 27) and with who gets in
#: (issue 28): each has its line in the table.
BOUNDS_AND_REFUSALS = {
    "sentinel_admin_live_clients", "sentinel_admin_live_dropped_total", "sentinel_admin_live_refused_total",
    "sentinel_routing_feed_subscribers", "sentinel_routing_feed_closing", "sentinel_routing_feed_dropped_total",
    "sentinel_routing_feed_refused_total", "sentinel_routing_feed_permission_denied_total",
    "sentinel_relay_connections", "sentinel_relay_connections_closed_total", "sentinel_relay_feed_connected",
    "sentinel_access_refused_total", "sentinel_tls_handshakes_total", "sentinel_tls_certificate_expiry_days",
    "node_probe_access_refused_total", "node_probe_tls_certificate_expiry_days",
}


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
    text = (ROOT / "docs" / "monitoring.md").read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


async def _control_plane_families(tmp_path) -> set[str]:
    ca = TestCA(tmp_path / "pki", "ca")
    server, cp_client = ca.issue("xds", dns=["localhost"], ips=["127.0.0.1"]), ca.issue("cp", client=True)
    cfg = parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        "tls": {"mode": "mtls", "cert_file": server.cert, "key_file": server.key, "client_ca_file": ca.cert,
                "agents": {"mode": "mtls", "ca_file": ca.cert, "cert_file": cp_client.cert,
                           "key_file": cp_client.key}},
        "feed": {"allow_identities": ["spiffe://cluster.local/ns/llm/sa/sentinel-relay"]},
        "clusters": [{"name": "llm", "nodes": [
            {"id": "n0", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:9001"}]}]})
    cp = ControlPlane(cfg, probe_sources=InMemoryProbes())
    await cp.start()
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{cp.admin_port}/metrics") as r:
            assert r.status == 200
            return _families(await r.text())
    finally:
        await cp.stop()


def _agent_families(tmp_path) -> set[str]:
    ca = TestCA(tmp_path / "agent-pki", "ca")
    pair = ca.issue("agent", dns=["localhost"])
    agent = ProbeAgent(AgentConfig(engine_url="http://127.0.0.1:1", node_id="gpu-a", tls_cert_file=pair.cert,
                                   tls_key_file=pair.key, tls_client_ca_file=ca.cert))  # built, never started
    return _families(agent.metrics.exposition().decode())


async def _never_served(request: web.BaseRequest) -> web.StreamResponse:
    raise AssertionError("the relay's server is built for its metrics, never served")


async def test_every_metric_in_what_to_monitor_is_exposed(tmp_path):
    cfg = parse_config({"clusters": [{"name": "llm", "nodes": [
        {"id": "n0", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:9001"}]}]})
    cp = ControlPlane(cfg, clock=ManualClock(), probe_sources=InMemoryProbes())
    cp.open()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ControlPlaneCollector(cp.view))
    exposed = _families(generate_latest(reg).decode())
    exposed |= _families(AgentMetrics(_IdleAgent()).exposition().decode())  # type: ignore[arg-type] - a stand-in agent
    assert "sentinel_fail_static" in exposed and "node_probe_engine_stalled" in exposed
    exposed |= await _control_plane_families(tmp_path)
    exposed |= _agent_families(tmp_path)
    relay = RelayMetrics()
    BoundedServer(_never_served, RelayConfig(), relay.registry)  # registers its connection counters
    exposed |= _families(generate_latest(relay.registry).decode())
    assert {"sentinel_admin_live_clients", "sentinel_tls_handshakes", "node_probe_access_refused",
            "sentinel_relay_connections"} <= exposed

    named = set(re.findall(r"\b((?:sentinel|node_probe)_[a-z_]+)", _section("What to monitor")))
    assert len(named) >= 15, named
    missing = []
    for name in sorted(named):
        base = next((name.removesuffix(s) for s in _SUFFIXES if name.endswith(s)), name)
        if name not in exposed and base not in exposed:
            missing.append(name)
    assert not missing, f"docs/monitoring.md names metrics nobody exposes: {missing}"
    assert not BOUNDS_AND_REFUSALS - named, f"no alert line for {sorted(BOUNDS_AND_REFUSALS - named)}"
