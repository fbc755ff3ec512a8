"""TLS and mutual TLS end to end, one real Envoy for the module.

A control plane with ``tls.mode: mtls`` and a node allow-list, two agents serving mTLS (the control
plane dials them with its client certificate and checks their names through ``{node_id}``),
a real Envoy whose ADS connection presents a SPIFFE client certificate through filesystem SDS:

- requests are routed through Envoy to both engines; both agents' streams are up;
- ADS refuses plaintext, a client without a certificate and one from another CA (the handshake
  fails: UNAVAILABLE), and a good certificate with a node id the allow-list does not give it
  (PERMISSION_DENIED, counted);
- the routing feed works for the relay's FeedClient over mTLS; an agent refuses a client
  without a certificate, and one whose certificate names no allowed identity (PERMISSION_DENIED);
- rotation: the ADS certificate files are replaced by ones from a new CA; new connections get
  the new certificate, Envoy's open ADS stream stays.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from node_probe.agent import AgentConfig, ProbeAgent
from node_probe.proto import probe_pb2, probe_pb2_grpc
from node_probe.sim import SimConfig, build_app
from sentinel_relay.feed import FeedClient
from xds_server.config import parse_config
from xds_server.envoy.tls import xds_tls_sds_secrets, xds_tls_transport_socket
from xds_server.process.tls import ClientTls, dial
from xds_server.server import ControlPlane
from xds_server.testing import StandaloneEnvoy, TestCA, free_port, wait_for
from xds_server.xds.resources import CLUSTER_TYPE_URL

pytestmark = pytest.mark.envoy

ENVOY_ID = "spiffe://cluster.local/ns/llm/sa/envoy"
ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
XDS_NAME = "xds.sentinel.test"


async def ads_first_response(port: int, tls: ClientTls | None, node_id: str):
    """Open SotW ADS, ask for CDS as ``node_id``; the first response, or the gRPC status code."""
    async with dial(f"127.0.0.1:{port}", tls=tls) as ch:
        call = ch.stream_stream(ADS, request_serializer=discovery_pb2.DiscoveryRequest.SerializeToString,
                                response_deserializer=discovery_pb2.DiscoveryResponse.FromString)()
        try:
            await call.write(discovery_pb2.DiscoveryRequest(node=base_pb2.Node(id=node_id),
                                                            type_url=CLUSTER_TYPE_URL))
            return await asyncio.wait_for(call.read(), 10)
        except grpc.aio.AioRpcError as e:
            return e.code()


async def test_mtls_envoy_agents_feed_allow_list_and_rotation(tmp_path: Path):
    pki = tmp_path / "pki"
    ca = TestCA(pki, "ca")
    xds = ca.issue("xds", dns=[XDS_NAME], ips=["127.0.0.1"])
    envoy_cert = ca.issue("envoy", uris=[ENVOY_ID], client=True)
    relay_cert = ca.issue("relay", uris=["spiffe://cluster.local/ns/llm/sa/relay"], client=True)
    cp_client = ca.issue("xds-client", uris=["spiffe://cluster.local/ns/sentinel/sa/xds-server"], client=True)
    stranger = TestCA(tmp_path / "other", "other").issue("stranger", uris=[ENVOY_ID], client=True)

    cleanups = []
    cp = envoy = None
    try:
        nodes = []
        for nid in ("n1", "n2"):
            port = free_port()
            runner = web.AppRunner(build_app(SimConfig(port=port, replica_id=nid, token_interval_ms=5)))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            cleanups.append(runner.cleanup)
            agent_cert = ca.issue(f"agent-{nid}", dns=[f"{nid}.agents.test"])
            agent = ProbeAgent(AgentConfig(
                engine_url=f"http://127.0.0.1:{port}", listen="127.0.0.1:0", node_id=nid,
                probe_interval_s=0.2, gpu_interval_s=0, tls_cert_file=agent_cert.cert,
                tls_key_file=agent_cert.key, tls_client_ca_file=ca.cert,
                tls_allow_clients=("spiffe://cluster.local/ns/sentinel/sa/*",)))
            aport = await agent.start()
            cleanups.insert(0, agent.stop)
            nodes.append({"id": nid, "address": f"127.0.0.1:{port}", "probe_address": f"127.0.0.1:{aport}"})
        cp = ControlPlane(parse_config({
            "xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0"},
            "health": {"ramp_step_percent": 50, "ramp_step_s": 0.2, "probation_clean_s": 1.0},
            "tls": {"mode": "mtls", "cert_file": xds.cert, "key_file": xds.key, "client_ca_file": ca.cert,
                    "node_allow": [{"identity": "spiffe://cluster.local/ns/llm/sa/*",
                                    "node_ids": ["envoy-llm-*"]}],
                    "agents": {"mode": "mtls", "ca_file": ca.cert, "cert_file": cp_client.cert,
                               "key_file": cp_client.key, "server_name": "{node_id}.agents.test"}},
            "clusters": [{"name": "llm", "nodes": nodes}]}))
        await cp.start()
        for name, secret in xds_tls_sds_secrets(ca.cert, envoy_cert.cert, envoy_cert.key, XDS_NAME).items():
            (pki / name).write_text(yaml.safe_dump(secret))
        envoy = await StandaloneEnvoy(cp.xds_port, xds_tls=xds_tls_transport_socket(
            ca.cert, envoy_cert.cert, envoy_cert.key, XDS_NAME, sds_dir=str(pki))).start()

        # Agents over mTLS, Envoy's ADS over mTLS: both engines routed, a request served.
        async def routed() -> bool:
            hosts = await envoy.hosts()
            return len(hosts) == 2 and all(h["health"] == "HEALTHY" for h in hosts.values())
        def diagnosis() -> str:
            agents = {n: (s.connected, s.last_error) for n, s in cp.sessions.items()}
            return (f"both nodes HEALTHY in Envoy over mTLS; agents {agents}, ADS streams "
                    f"{[s.node_id for s in cp.ads.streams.values()]}, Envoy:\n{envoy.proc.output_tail()}")
        await wait_for(routed, timeout_s=20, what=diagnosis)
        assert all(cp.sessions[n].connected for n in ("n1", "n2"))
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{envoy.url}/v1/completions",
                              json={"model": "sim-model", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-sentinel-upstream-host"] in {n["address"] for n in nodes}
        envoy_streams = [s.node_id for s in cp.ads.streams.values()]
        assert envoy_streams == ["envoy-llm-gw-1"]

        # Refused: plaintext, no client certificate, a certificate from another CA.
        port = cp.xds_port
        assert await ads_first_response(port, None, "envoy-llm-x") == grpc.StatusCode.UNAVAILABLE
        assert await ads_first_response(port, ClientTls(ca.cert), "envoy-llm-x") == grpc.StatusCode.UNAVAILABLE
        assert await ads_first_response(port, ClientTls(ca.cert, stranger.cert, stranger.key),
                                        "envoy-llm-x") == grpc.StatusCode.UNAVAILABLE
        # A good certificate, a node id it may not use: PERMISSION_DENIED, counted.
        good = ClientTls(ca.cert, envoy_cert.cert, envoy_cert.key, XDS_NAME)
        assert await ads_first_response(port, good, "rogue-1") == grpc.StatusCode.PERMISSION_DENIED
        assert cp.ads.stats.rejected[("sotw", "permission_denied")] == 1
        resp = await ads_first_response(port, good, "envoy-llm-x")
        assert resp.type_url == CLUSTER_TYPE_URL and len(resp.resources) == 1

        # The relay's feed over mTLS; an agent refuses a caller without a client certificate.
        got = asyncio.Event()
        feed = FeedClient(f"127.0.0.1:{port}", lambda n, snap: got.set(),
                          tls=ClientTls(ca.cert, relay_cert.cert, relay_cert.key, XDS_NAME))
        feed.start()
        try:
            await asyncio.wait_for(got.wait(), 10)
            assert set(feed.nodes) == {"n1", "n2"}
        finally:
            await feed.stop()
        async with dial(nodes[0]["probe_address"], tls=ClientTls(ca.cert, server_name="n1.agents.test")) as ch:
            call = probe_pb2_grpc.NodeProbeStub(ch).Watch()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.write(probe_pb2.ControlMessage())
                await asyncio.wait_for(call.read(), 10)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        # ... and one whose certificate (right CA) carries no allowed name (--tls-allow-client).
        async with dial(nodes[0]["probe_address"], tls=ClientTls(ca.cert, relay_cert.cert, relay_cert.key,
                                                                 "n1.agents.test")) as ch:
            call = probe_pb2_grpc.NodeProbeStub(ch).Watch()
            # read only: a write racing the agent's abort can come back INTERNAL instead (5 in 120 tries)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call.read(), 10)
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED

        # Rotation: the ADS certificate files are replaced by ones from a new CA.
        ca2 = TestCA(tmp_path / "ca2", "ca2")
        ca2.issue("xds", dns=[XDS_NAME], ips=["127.0.0.1"], directory=pki)
        rotated = ClientTls(ca2.cert, envoy_cert.cert, envoy_cert.key, XDS_NAME)
        resp = await ads_first_response(port, rotated, "envoy-llm-y")
        assert not isinstance(resp, grpc.StatusCode), resp
        assert await ads_first_response(port, good, "envoy-llm-x") == grpc.StatusCode.UNAVAILABLE
        assert cp.view.tls_files is not None and cp.view.tls_files.reloads == 1
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{cp.admin_port}/metrics") as r:
                text = await r.text()
        assert 'sentinel_tls_certificate_reloads_total{result="ok"} 1.0' in text
        assert 'sentinel_xds_streams_rejected_total{reason="permission_denied",variant="sotw"} 1.0' in text
        assert [s.node_id for s in cp.ads.streams.values()] == ["envoy-llm-gw-1"]  # Envoy's stream stayed
    finally:
        if envoy is not None:
            envoy.stop()
        if cp is not None:
            await cp.stop()
        for c in cleanups:
            await c()
