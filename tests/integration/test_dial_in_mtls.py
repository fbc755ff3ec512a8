"""Agents dialling in under mutual TLS: real agents (ProbeAgent, dial-in) against a real control
plane with ``tls.mode: mtls``. An agent whose certificate names its node is served; one whose
certificate names another node is refused (PERMISSION_DENIED, counted as ``agent_identity``) and
never feeds that node; an agent registering into a cluster whose allow-list its identity does not
match is refused as well, and one that matches joins the cluster."""
from __future__ import annotations

from pathlib import Path

from node_probe.agent import AgentConfig, ProbeAgent
from xds_server.config import parse_config
from xds_server.server import ControlPlane
from xds_server.testing import TestCA, free_port, wait_for

XDS_NAME = "xds.sentinel.test"


def _agent(node_id: str, port: int, ca: TestCA, cert_dns: str, **kw: object) -> ProbeAgent:
    cert = ca.issue(f"agent-{node_id}-{cert_dns}", dns=[cert_dns], client=True)
    return ProbeAgent(AgentConfig(
        engine_url=f"http://127.0.0.1:{free_port()}", listen=None, node_id=node_id, gpu_interval_s=0,
        control_planes=(f"127.0.0.1:{port}",), control_plane_ca_file=ca.cert, control_plane_server_name=XDS_NAME,
        client_cert_file=cert.cert, client_key_file=cert.key, **kw))  # type: ignore[arg-type]  # kw: str/int fields


async def test_a_certificate_naming_another_node_is_refused_and_the_right_one_is_served(tmp_path: Path):
    ca = TestCA(tmp_path / "pki", "ca")
    xds = ca.issue("xds", dns=[XDS_NAME], ips=["127.0.0.1"])
    port = free_port()
    cp = ControlPlane(parse_config({
        "xds": {"listen": f"127.0.0.1:{port}"}, "admin": {"listen": "127.0.0.1:0"},
        "tls": {"mode": "mtls", "cert_file": xds.cert, "key_file": xds.key, "client_ca_file": ca.cert},
        "clusters": [
            {"name": "llm", "nodes": [{"id": "gpu-a", "address": "127.0.0.1:8001"},
                                      {"id": "gpu-b", "address": "127.0.0.1:8002"}]},
            {"name": "pool", "nodes": [{"id": "p-0", "address": "127.0.0.1:8003"}],
             "discovery": {"agents": {"allow": ["dns:*.pool.test"]}}}]}))
    agents: list[ProbeAgent] = []
    try:
        await cp.start()
        impostor = _agent("gpu-a", port, ca, "gpu-b.agents.test")   # gpu-b's certificate, claiming gpu-a
        honest = _agent("gpu-b", port, ca, "gpu-b.agents.test")
        outsider = _agent("p-9", port, ca, "p-9.elsewhere.test", cluster="pool", serving_address="127.0.0.1:8009")
        member = _agent("p-1", port, ca, "p-1.pool.test", cluster="pool", serving_address="127.0.0.1:8004")
        for a in (impostor, honest, outsider, member):
            agents.append(a)
            await a.start()
        refused = cp.refusals.counts
        await wait_for(lambda: cp.sessions["gpu-b"].connected, timeout_s=10)
        await wait_for(lambda: refused[("xds", "agent_identity")] >= 2, timeout_s=10)
        await wait_for(lambda: "p-1" in cp.sessions and cp.sessions["p-1"].connected, timeout_s=10)
        assert not cp.sessions["gpu-a"].connected        # the impostor never fed gpu-a
        assert "p-9" not in cp.sessions                  # nor registered a node
        assert cp.core.node_cluster["p-1"] == "pool"
        assert cp.config.clusters[1].nodes[-1].address == "127.0.0.1:8004"
        assert cp.hub.refused >= 2 and cp.hub.accepted >= 2
    finally:
        for a in agents:
            await a.stop()
        await cp.stop()
