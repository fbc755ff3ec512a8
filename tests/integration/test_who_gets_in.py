"""Who gets in, with real `xds-server serve` and `node-probe` processes and
certificates made here (one CA, a foreign one): typed identities on all three channels (ADS, the
routing feed, the agent), refusals counted and logged per identity, handshakes counted, the admin
token guarded and counted per peer over HTTPS.

Each identity trick gets a certificate from the right CA: a CN and a DNS SAN that
*read* as the allowed SPIFFE id. On today's main (before the change) all of them passed.
"""
from __future__ import annotations

import asyncio
import re
import ssl
import sys
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.load_stats.v3 import lrs_pb2

from node_probe.proto import probe_pb2, probe_pb2_grpc
from xds_server.process.tls import ClientTls, dial
from xds_server.proto import routing_pb2, routing_pb2_grpc
from xds_server.testing import ManagedProcess, TestCA, free_port, wait_for
from xds_server.xds.resources import CLUSTER_TYPE_URL

ENVOY = "spiffe://cluster.local/ns/llm/sa/envoy"
RELAY = "spiffe://cluster.local/ns/llm/sa/sentinel-relay"
CP = "spiffe://cluster.local/ns/llm/sa/xds-server"
TOKEN = "t0ken-28-9c1f77aa"
ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
PY = sys.executable


class Stack:
    """docs/tls.md's mTLS setup on every channel: paths, ports, processes."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.ca = TestCA(d / "pki", "ca")
        self.other_ca = TestCA(d / "pki-other", "other")
        ca = self.ca
        self.server = ca.issue("xds", dns=["localhost"], ips=["127.0.0.1"])
        self.agent_server = ca.issue("agent", dns=["localhost"], ips=["127.0.0.1"])
        self.envoy = ca.issue("envoy", uris=[ENVOY], client=True)
        self.relay = ca.issue("relay", uris=[RELAY], client=True)
        self.cp_client = ca.issue("cp", uris=[CP], client=True)
        # The tricks: the right CA, a name of another kind reading like the allowed id.
        self.tricks = {}
        for who, spiffe in (("envoy", ENVOY), ("relay", RELAY), ("cp", CP)):
            self.tricks[(who, "cn")] = ca.issue(f"cn-{who}", common_name=spiffe, client=True)
            self.tricks[(who, "cn+san")] = ca.issue(f"cnsan-{who}", common_name=spiffe, dns=["x.example"],
                                                    client=True)
            self.tricks[(who, "dns")] = ca.issue(f"dns-{who}", dns=[spiffe], client=True)
        self.foreign = self.other_ca.issue("foreign", uris=[ENVOY], client=True)
        self.expired = ca.issue("expired", uris=[ENVOY], client=True, valid_from_s=-7200, valid_for_s=3600)
        self.xds_port, self.admin_port, self.agent_port, self.agent_metrics = (free_port() for _ in range(4))
        self.engine_port = free_port()  # nothing listens: the agent serves its stream all the same

    def config(self) -> dict:
        s = self
        return {
            "xds": {"listen": f"127.0.0.1:{s.xds_port}", "warmup_timeout_ms": 0},
            "admin": {"listen": f"127.0.0.1:{s.admin_port}", "token": TOKEN,
                      "tls": {"cert_file": s.server.cert, "key_file": s.server.key}},
            "tls": {"mode": "mtls", "cert_file": s.server.cert, "key_file": s.server.key,
                    "client_ca_file": s.ca.cert, "expiry_warning_days": 0.5,
                    "node_allow": [{"identity": ENVOY, "node_ids": ["envoy-llm-*"]}],
                    "agents": {"mode": "mtls", "ca_file": s.ca.cert, "cert_file": s.cp_client.cert,
                               "key_file": s.cp_client.key}},
            "feed": {"allow_identities": [RELAY]},
            "clusters": [{"name": "llm", "nodes": [{"id": "gpu-a", "address": f"127.0.0.1:{s.engine_port}",
                                                    "probe_address": f"127.0.0.1:{s.agent_port}"}]}],
        }

    def processes(self) -> list[ManagedProcess]:
        cfg = self.dir / "xds.yaml"
        cfg.write_text(yaml.safe_dump(self.config()))
        agent = ManagedProcess("agent", [
            PY, "-m", "node_probe.cli", "--engine-url", f"http://127.0.0.1:{self.engine_port}",
            "--listen", f"127.0.0.1:{self.agent_port}", "--node-id", "gpu-a",
            "--metrics-listen", f"127.0.0.1:{self.agent_metrics}",
            "--tls-cert", self.agent_server.cert, "--tls-key", self.agent_server.key,
            "--tls-client-ca", self.ca.cert, "--tls-allow-client", CP], self.dir / "agent.log",
            ready_pattern="listening")
        server = ManagedProcess("xds-server", [PY, "-m", "xds_server.cli", "serve", "--config", str(cfg)],
                                self.dir / "xds.log", ready_pattern="admin listening")
        return [agent, server]

    def tls(self, pair, server_name: str = "localhost") -> ClientTls:
        return ClientTls(self.ca.cert, pair.cert if pair else None, pair.key if pair else None, server_name)

    def admin_ssl(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca.cert)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("who-gets-in"))
    procs = s.processes()
    try:
        for p in procs:
            p.start(timeout_s=30)
        yield s
    finally:
        for p in reversed(procs):
            p.stop()


def raw(ca: str, pair) -> grpc.ChannelCredentials:
    """Channel credentials read as they are (our dial refuses an expired certificate of its own)."""
    return grpc.ssl_channel_credentials(Path(ca).read_bytes(), Path(pair.key).read_bytes(),
                                        Path(pair.cert).read_bytes())


def channel(port: int, tls: ClientTls | grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if isinstance(tls, grpc.ChannelCredentials):
        return grpc.aio.secure_channel(f"127.0.0.1:{port}", tls, options=[("grpc.ssl_target_name_override",
                                                                           "localhost")])
    return dial(f"127.0.0.1:{port}", tls=tls)


async def ads(port: int, tls: ClientTls | grpc.ChannelCredentials | None, node_id: str = "envoy-llm-1"):
    """Open SotW ADS and ask for CDS as ``node_id``: the first response, or the status code."""
    async with channel(port, tls) as ch:
        call = ch.stream_stream(ADS, request_serializer=discovery_pb2.DiscoveryRequest.SerializeToString,
                                response_deserializer=discovery_pb2.DiscoveryResponse.FromString)()
        try:
            await call.write(discovery_pb2.DiscoveryRequest(node=base_pb2.Node(id=node_id), type_url=CLUSTER_TYPE_URL))
            return await asyncio.wait_for(call.read(), 10)
        except grpc.aio.AioRpcError as e:
            return e.code()


async def feed(port: int, tls: ClientTls | None):
    """Watch the routing feed: the first update, or the status code."""
    async with dial(f"127.0.0.1:{port}", tls=tls) as ch:
        call = routing_pb2_grpc.RoutingFeedStub(ch).Watch(routing_pb2.WatchRequest(subscriber_id="t"))
        try:
            return await asyncio.wait_for(call.read(), 10)
        except grpc.aio.AioRpcError as e:
            return e.code()


async def agent(port: int, tls: ClientTls | None):
    """Open the agent's Watch stream: the first message (the agent speaks first: a heartbeat), or
    the status code. Nothing is written: a write racing the agent's abort is INTERNAL at the
    client ("Internal error from Core", measured 5 in 120 tries), not what the agent answered."""
    async with dial(f"127.0.0.1:{port}", tls=tls) as ch:
        call = probe_pb2_grpc.NodeProbeStub(ch).Watch()
        try:
            return await asyncio.wait_for(call.read(), 10)
        except grpc.aio.AioRpcError as e:
            return e.code()


async def metrics(url: str, ssl_ctx: ssl.SSLContext | None = None) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async with s.get(url, ssl=ssl_ctx if ssl_ctx is not None else False) as r:
            return await r.text()


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of an exposition, None when absent."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(r"([a-z_]+)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name and ",".join(sorted((m.group(2) or "").split(","))) == want:
            return float(m.group(3))
    return None


async def test_the_right_identities_pass_on_every_channel(stack):
    assert not isinstance(await ads(stack.xds_port, stack.tls(stack.envoy)), grpc.StatusCode)
    assert isinstance(await feed(stack.xds_port, stack.tls(stack.relay)), routing_pb2.RoutingUpdate)
    assert isinstance(await agent(stack.agent_port, stack.tls(stack.cp_client)), probe_pb2.AgentMessage)


async def test_cn_and_dns_tricks_are_refused_on_ads_feed_and_agent_and_each_is_logged_by_name(stack):
    denied = grpc.StatusCode.PERMISSION_DENIED
    for kind in ("cn", "cn+san", "dns"):
        assert await ads(stack.xds_port, stack.tls(stack.tricks[("envoy", kind)])) == denied, kind
        assert await feed(stack.xds_port, stack.tls(stack.tricks[("relay", kind)])) == denied, kind
        assert await agent(stack.agent_port, stack.tls(stack.tricks[("cp", kind)])) == denied, kind
    # Envoy's certificate is on node_allow, not on feed.allow_identities: the feed refuses it.
    assert await feed(stack.xds_port, stack.tls(stack.envoy)) == denied

    text = await metrics(f"https://127.0.0.1:{stack.admin_port}/metrics", stack.admin_ssl())
    assert sample(text, "sentinel_access_refused_total", port="xds", reason="node_allow") >= 3
    assert sample(text, "sentinel_access_refused_total", port="xds", reason="feed_allow") >= 4
    agent_text = await metrics(f"http://127.0.0.1:{stack.agent_metrics}/metrics")
    assert sample(agent_text, "node_probe_access_refused_total", node="gpu-a", port="agent", reason="allow_client") >= 3

    # Every refused identity is named within seconds of the others (rate-limited per identity).
    def logged(path: Path, port: str, reason: str, identity: str) -> bool:
        pat = f"refused on the {port} port ({reason}): peer ipv4:127.0.0.1:"
        return any(pat in line and f"identity {identity}" in line for line in path.read_text().splitlines())

    async def all_logged() -> bool:
        return all([
            logged(stack.dir / "xds.log", "xds", "node_allow", f"cn:{ENVOY}"),
            logged(stack.dir / "xds.log", "xds", "node_allow", "dns:x.example"),  # the CN next to SANs: not a name
            logged(stack.dir / "xds.log", "xds", "node_allow", f"dns:{ENVOY}"),
            logged(stack.dir / "xds.log", "xds", "feed_allow", f"cn:{RELAY}"),
            logged(stack.dir / "xds.log", "xds", "feed_allow", f"dns:{RELAY}"),
            logged(stack.dir / "xds.log", "xds", "feed_allow", ENVOY),
            logged(stack.dir / "agent.log", "agent", "allow_client", f"cn:{CP}"),
            logged(stack.dir / "agent.log", "agent", "allow_client", f"dns:{CP}"),
        ])
    await wait_for(all_logged, timeout_s=10.0, step_s=0.2)
    # ... once: the refusal record (peer and identity) is the only line of a refused subscriber.
    feed_lines = [ln for ln in (stack.dir / "xds.log").read_text().splitlines() if "routing feed refused" in ln]
    assert all("refused on the xds port (feed_allow): peer ipv4:127.0.0.1:" in ln for ln in feed_lines), feed_lines
    assert len([ln for ln in feed_lines if f"identity cn:{RELAY}" in ln]) == 1, feed_lines


async def _pipelined(port: int, tls: ClientTls, method: str, requests: list[bytes]) -> str:
    """Write ``requests`` back to back without waiting, then read: the status code's name (the
    client gets the server's refusal, not grpcio's INTERNAL for a write that raced it)."""
    async with dial(f"127.0.0.1:{port}", tls=tls) as ch:
        call = ch.stream_stream(method)()
        try:
            for raw in requests:
                await call.write(raw)
            await asyncio.wait_for(call.read(), 10)
            return "answered"
        except grpc.aio.AioRpcError as e:
            return e.code().name
        except asyncio.InvalidStateError:  # a write after the status came: the status itself
            return (await call.code()).name


async def test_every_refused_stream_kind_answers_permission_denied_to_a_client_that_keeps_writing(stack):
    delta = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
    lrs = "/envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats"
    agent_watch = "/node_probe.v1.NodeProbe/Watch"

    def dreq(node_id: str) -> bytes:
        return discovery_pb2.DeltaDiscoveryRequest(node=base_pb2.Node(id=node_id),
                                                   type_url=CLUSTER_TYPE_URL).SerializeToString()

    def sreq(node_id: str) -> bytes:
        req = discovery_pb2.DiscoveryRequest(node=base_pb2.Node(id=node_id), type_url=CLUSTER_TYPE_URL)
        return req.SerializeToString()

    cases = {  # the refusals seen answering INTERNAL, and their SotW and LRS siblings
        "delta: Envoy certificate claiming a GPU node's id": (stack.xds_port, stack.envoy, delta, dreq("gpu-a")),
        "delta: certificate not in tls.node_allow": (stack.xds_port, stack.relay, delta, dreq("envoy-llm-1")),
        "sotw: certificate not in tls.node_allow": (stack.xds_port, stack.relay, ADS, sreq("envoy-llm-1")),
        "lrs: certificate not in tls.node_allow": (
            stack.xds_port, stack.relay, lrs, lrs_pb2.LoadStatsRequest(node=base_pb2.Node(id="envoy-llm-1"))
            .SerializeToString()),
        "agent: identity only in the CN": (stack.agent_port, stack.tricks[("cp", "cn")], agent_watch,
                                           probe_pb2.ControlMessage().SerializeToString()),
    }
    for what, (port, pair, method, raw) in cases.items():
        got = [await _pipelined(port, stack.tls(pair), method, [raw] * 3) for _ in range(15)]
        assert got == ["PERMISSION_DENIED"] * 15, (what, got)


async def test_refused_handshakes_never_reach_python_and_raise_the_handshake_counter(stack):
    url = f"https://127.0.0.1:{stack.admin_port}/metrics"
    before = await metrics(url, stack.admin_ssl())
    hs0 = sample(before, "sentinel_tls_handshakes_total", port="xds")
    refused0 = sum(sample(before, "sentinel_access_refused_total", port="xds", reason=r) for r in
                   ("node_allow", "feed_allow"))
    attempts = {
        "plaintext": None,
        "no certificate": ClientTls(stack.ca.cert, server_name="localhost"),
        "another CA": stack.tls(stack.foreign),
        "expired": raw(stack.ca.cert, stack.expired),
    }
    for what, tls in attempts.items():
        assert await ads(stack.xds_port, tls) == grpc.StatusCode.UNAVAILABLE, what
    after = await metrics(url, stack.admin_ssl())
    assert sample(after, "sentinel_tls_handshakes_total", port="xds") >= hs0 + len(attempts)
    # ... and nothing else: no identity was ever seen, so no refusal by identity is counted.
    assert sum(sample(after, "sentinel_access_refused_total", port="xds", reason=r) for r in
               ("node_allow", "feed_allow")) == refused0


async def test_admin_serves_https_and_counts_and_logs_token_refusals_per_peer(stack):
    base = f"https://127.0.0.1:{stack.admin_port}"
    ctx = stack.admin_ssl()
    with pytest.raises(aiohttp.ClientError):  # HTTPS only: a plain HTTP client gets no answer
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            async with s.get(f"http://127.0.0.1:{stack.admin_port}/healthz") as r:
                await r.read()
    statuses = []
    for source, header in (("127.0.0.1", None), ("127.0.0.1", "Bearer nope"), ("127.0.0.2", "Bearer guess-2"),
                           ("127.0.0.2", "Bearer guess-3")):
        conn = aiohttp.TCPConnector(local_addr=(source, 0), ssl=ctx)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=5)) as s:
            hdrs = {"Authorization": header} if header else {}
            async with s.post(f"{base}/nodes/gpu-a/drain", headers=hdrs) as r:
                statuses.append(r.status)
            async with s.post(f"{base}/reload", headers=hdrs) as r:
                statuses.append(r.status)
    assert statuses == [401] * 8
    text = await metrics(f"{base}/metrics", ctx)
    assert sample(text, "sentinel_access_refused_total", port="admin", reason="token_missing") == 2
    assert sample(text, "sentinel_access_refused_total", port="admin", reason="token_wrong") == 6

    def lines(peer: str, reason: str) -> list[str]:
        return [ln for ln in (stack.dir / "xds.log").read_text().splitlines()
                if f"refused on the admin port ({reason}): peer {peer}," in ln]

    async def both_peers_named() -> bool:
        return bool(lines("127.0.0.1", "token_missing") and lines("127.0.0.1", "token_wrong")
                    and lines("127.0.0.2", "token_wrong"))
    await wait_for(both_peers_named, timeout_s=10.0, step_s=0.2)
    assert len(lines("127.0.0.2", "token_wrong")) == 1  # its 3 more guesses inside 10 s: one line
    log = (stack.dir / "xds.log").read_text()
    assert "nope" not in log and "guess-2" not in log and TOKEN not in log  # never the token given


async def test_certificate_expiry_is_on_metrics(stack):
    text = await metrics(f"https://127.0.0.1:{stack.admin_port}/metrics", stack.admin_ssl())
    left = sample(text, "sentinel_tls_certificate_expiry_seconds", role="xds_server", file=stack.server.cert)
    assert left is not None and 20 * 3600 < left < 24 * 3600 + 60  # the test certificates end a day from now
    days = sample(text, "sentinel_tls_certificate_expiry_days", role="admin_server", file=stack.server.cert)
    assert days is not None and 0.8 < days < 1.01
    assert sample(text, "sentinel_tls_certificate_expiry_seconds", role="agents_client", file=stack.cp_client.cert)
