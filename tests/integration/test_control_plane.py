"""The control plane with real agents and engines in-process (no Envoy): admin views, metrics,
malformed agent messages, agent loss and return."""
from __future__ import annotations

import asyncio
import math

import aiohttp
import grpc
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from node_probe.agent import AgentConfig, ProbeAgent
from node_probe.proto import probe_pb2, probe_pb2_grpc
from node_probe.sim import SimConfig, build_app
from xds_server.config import parse_config
from xds_server.server import ControlPlane
from xds_server.testing import free_port, wait_for


async def start_engine(replica: str) -> tuple[web.AppRunner, int]:
    port = free_port()
    runner = web.AppRunner(build_app(SimConfig(port=port, replica_id=replica, token_interval_ms=5)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def cp_config(nodes: list[tuple[str, int, int]], **health) -> dict:
    return {
        "xds": {"listen": "127.0.0.1:0"},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"ping_interval_ms": 100, "ramp_step_percent": 50, "ramp_step_s": 0.2,
                   "probation_clean_s": 1.0, **health},
        "clusters": [{"name": "llm", "nodes": [
            {"id": nid, "address": f"127.0.0.1:{eport}", "probe_address": f"127.0.0.1:{aport}"}
            for nid, eport, aport in nodes]}],
    }


@pytest.fixture
async def stack():
    """Two engines + two agents + control plane, all in this process."""
    cleanups = []
    nodes = []
    agents = {}
    for nid in ("n1", "n2"):
        runner, eport = await start_engine(nid)
        cleanups.append(runner.cleanup)
        agent = ProbeAgent(AgentConfig(engine_url=f"http://127.0.0.1:{eport}", listen="127.0.0.1:0",
                                       node_id=nid, probe_interval_s=0.2, gpu_interval_s=0))
        aport = await agent.start()
        agents[nid] = agent
        nodes.append((nid, eport, aport))
    cp = ControlPlane(parse_config(cp_config(nodes)))
    await cp.start()
    http = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{cp.admin_port}")
    yield cp, http, agents, nodes
    await http.close()
    await cp.stop()
    for a in agents.values():
        await a.stop()
    for c in cleanups:
        await c()


async def test_nodes_become_healthy_and_admin_shows_why(stack):
    _cp, http, _agents, _ = stack

    async def all_healthy():
        async with http.get("/nodes") as r:
            nodes = (await r.json())["nodes"]
        # weights follow the seed score; wait for the RTT EWMAs to settle after start-up
        return nodes if all(n["state"] == "HEALTHY" and n["ewma_rtt_ms"] and n["weight"] == 100
                            for n in nodes) else None

    nodes = await wait_for(all_healthy)
    n1 = nodes[0]
    assert n1["id"] == "n1" and n1["weight"] == 100 and n1["eds_health_status"] == "HEALTHY"
    assert n1["probation"] is None and n1["drain"] is None
    assert 0 < n1["last_ttft_ms"] < 200 and 0 < n1["ewma_rtt_ms"] < 100
    assert n1["probe_stream_connected"] and n1["heartbeats"] > 0 and n1["xds_version"]
    assert n1["engine_load"]["metrics_ok"] is True and n1["engine_load"]["requests_waiting"] == 0.0
    assert n1["engine_load"]["kv_cache_metric"] == "vllm:kv_cache_usage_perc"
    async with http.get("/readyz") as r:
        assert r.status == 200
    async with http.get("/events") as r:
        evs = (await r.json())["events"]
    n1_moves = [e for e in evs if e["node"] == "n1" and e["kind"] == "transition"]
    assert [(e["from"], e["to"]) for e in n1_moves[:3]] == [
        ("COLD", "WARMING"), ("WARMING", "PROBATION"), ("PROBATION", "HEALTHY")]
    assert n1_moves[2]["reason"] == "ramp complete (100 %)"
    # A starved CI host may slow one probe past its bound once it is HEALTHY (DEGRADED, back after
    # good probes: "3 consecutive good probes ..." seen once); /nodes then says the latest move's why.
    assert n1["reason"] == n1_moves[-1]["reason"] and n1_moves[-1]["to"] == "HEALTHY"
    async with http.get("/config_dump") as r:
        dump = await r.json()
    cla = dump["endpoints"]["resources"][0]["resource"]
    assert [e["healthStatus"] for e in cla["endpoints"][0]["lbEndpoints"]] == ["HEALTHY", "HEALTHY"]
    assert dump["clusters"]["resources"][0]["resource"]["commonLbConfig"]["healthyPanicThreshold"] == {}
    async with http.get("/metrics") as r:
        text = await r.text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    states = {(s.labels["node"], s.labels["state"]): s.value for s in fams["sentinel_node_state"].samples}
    assert states[("n1", "HEALTHY")] == 1.0 and states[("n1", "UNHEALTHY")] == 0.0
    # the metric is the weight /nodes shows (the RTT term can move it between two reads on a
    # loaded machine: read both until one pair agrees)
    async def metric_and_nodes_weights():
        async with http.get("/metrics") as r:
            fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
        async with http.get("/nodes") as r:
            shown = {n["id"]: float(n["weight"]) for n in (await r.json())["nodes"]}
        weights = {s.labels["node"]: s.value for s in fams["sentinel_node_weight"].samples}
        return weights if weights == shown else None

    weights = await wait_for(metric_and_nodes_weights, timeout_s=5.0)
    assert set(weights) == {"n1", "n2"} and all(50.0 <= w <= 100.0 for w in weights.values()), weights
    async with http.get("/nodes/nope") as r:
        assert r.status == 404


async def test_agent_lost_then_back_recovers(stack):
    _cp, http, agents, nodes = stack
    await wait_for(lambda: _state(http, "n1", "HEALTHY"))
    aport = nodes[0][2]
    await agents["n1"].stop()
    v = await wait_for(lambda: _state(http, "n1", "UNHEALTHY"), timeout_s=3)
    assert v["reason"].startswith("heartbeat: ")
    assert v["eds_health_status"] == "UNHEALTHY" and v["not_routed_because"].startswith("UNHEALTHY: heartbeat")
    eport = nodes[0][1]
    agent = ProbeAgent(AgentConfig(engine_url=f"http://127.0.0.1:{eport}", listen=f"127.0.0.1:{aport}",
                                   node_id="n1", probe_interval_s=0.2, gpu_interval_s=0))
    await agent.start()
    agents["n1"] = agent
    # the view gives the state at once and the weight of the last assignment published, which may
    # still be the one from before (a loaded CI host: PROBATION at 1 % beside weight 100)
    v = await wait_for(lambda: _published(http, "n1", "PROBATION"), timeout_s=10)
    assert v["probation"]["ramp_percent"] in (1.0, 51.0) and v["weight"] in (1, 51)
    v = await wait_for(lambda: _state(http, "n1", "HEALTHY"), timeout_s=10)
    assert v["reason"] == "ramp complete (100 %)"
    async with http.get("/events") as r:
        evs = [(e["from"], e["to"]) for e in (await r.json())["events"] if e["node"] == "n1"]
    assert evs[-3:] == [("HEALTHY", "UNHEALTHY"), ("UNHEALTHY", "PROBATION"), ("PROBATION", "HEALTHY")]


async def _state(http, node, state):
    async with http.get(f"/nodes/{node}") as r:
        v = await r.json()
    return v if v["state"] == state else None


async def _published(http, node, state):
    """The node's view once it is in ``state`` and its published weight is no longer full (the
    assignment with the state's weight out)."""
    v = await _state(http, node, state)
    return v if v is not None and v["weight"] < 100 else None


class _BadAgent(probe_pb2_grpc.NodeProbeServicer):
    """Sends heartbeats with malformed messages mixed in."""

    async def Watch(self, request_iterator, context):
        seq = 0
        for i in range(1000):
            seq += 1
            yield probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(
                seq=seq, telemetry=probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY)))
            if i == 2:
                yield probe_pb2.AgentMessage()                                  # no payload
                yield probe_pb2.AgentMessage(pong=probe_pb2.Pong(seq=999999))   # unknown ping
                yield probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(
                    seq=1, ok=True, ttft_ms=math.nan))                          # nonsense TTFT
            if i == 3:
                yield probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(
                    seq=2, ok=True, ttft_ms=12.0))
            await asyncio.sleep(0.1)


async def test_malformed_agent_messages_are_counted_and_do_not_break_the_session():
    srv = grpc.aio.server()
    probe_pb2_grpc.add_NodeProbeServicer_to_server(_BadAgent(), srv)
    aport = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    cp = ControlPlane(parse_config(cp_config([("bad", 9, aport)], ping_interval_ms=5000)))
    await cp.start()
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{cp.admin_port}") as http:
            v = await wait_for(lambda: _state(http, "bad", "HEALTHY"), timeout_s=5)
            assert v["last_ttft_ms"] == 12.0
            async with http.get("/metrics") as r:
                fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
        bad = [s.value for s in fams["sentinel_probe_malformed_messages"].samples if s.name.endswith("_total")]
        assert bad == [3.0]
        assert cp.sessions["bad"].connected
    finally:
        await cp.stop()
        await srv.stop(0)


class _RecordingAgent(probe_pb2_grpc.NodeProbeServicer):
    """Heartbeats only; records what the control plane sends."""

    def __init__(self) -> None:
        self.received: list[str] = []

    async def Watch(self, request_iterator, context):
        async def read():
            async for m in request_iterator:
                self.received.append(m.WhichOneof("msg")
                                     + (f":{m.probe_now.reason}" if m.HasField("probe_now") else ""))

        reader = asyncio.ensure_future(read())
        try:
            for seq in range(1, 100):
                yield probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(
                    seq=seq, telemetry=probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY)))
                await asyncio.sleep(0.1)
        finally:
            reader.cancel()


async def test_control_plane_asks_for_a_probe_on_connect():
    agent = _RecordingAgent()
    srv = grpc.aio.server()
    probe_pb2_grpc.add_NodeProbeServicer_to_server(agent, srv)
    aport = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    cp = ControlPlane(parse_config(cp_config([("rec", 9, aport)], ping_interval_ms=5000)))
    await cp.start()
    try:
        await wait_for(lambda: _true_if(len(agent.received) >= 3), timeout_s=5)
        assert agent.received[:3] == ["hello", "probe_now:connected", "ping"]
    finally:
        await cp.stop()
        await srv.stop(0)


async def _true_if(v: bool) -> bool:
    return v


async def test_drain_and_undrain_through_admin_need_the_admin_token(stack):
    """Field case fc10."""
    cp, http, _agents, _ = stack
    await wait_for(lambda: _state(http, "n1", "HEALTHY"))
    async with http.post("/nodes/n1/drain") as r:
        assert r.status == 403  # no admin.token configured: drain disabled
    cp.config = cp.config.model_copy(update={"admin": cp.config.admin.model_copy(update={"token": "s3cret"})})
    async with http.post("/nodes/n1/drain", headers={"Authorization": "Bearer wrong"}) as r:
        assert r.status == 401
    async with http.post("/nodes/n1/drain?reason=maintenance", headers={"Authorization": "Bearer s3cret"}) as r:
        v = await r.json()
    assert v["state"] == "DRAINING" and v["health_state"] == "HEALTHY" and v["eds_health_status"] == "DRAINING"
    assert v["drain"]["in_flight"] in (0.0, 1.0)  # idle engine: nothing but, at times, our own micro-probe

    async def drained():
        async with http.get("/nodes/n1") as r:
            d = (await r.json())["drain"]
        return d if d["in_flight"] == 0.0 and d["drained"] is True else None

    # the engine's running count includes the agent's probe (0.2 s cadence, ~20 ms each): drained
    # as soon as a heartbeat reports none running
    await wait_for(drained, timeout_s=3.0)
    async with http.get("/config_dump") as r:
        cla = (await r.json())["endpoints"]["resources"][0]["resource"]
    statuses = {e["endpoint"]["hostname"]: e["healthStatus"] for e in cla["endpoints"][0]["lbEndpoints"]}
    assert statuses == {"n1": "DRAINING", "n2": "HEALTHY"}
    async with http.post("/nodes/n1/undrain", headers={"Authorization": "Bearer s3cret"}) as r:
        v = await r.json()
    assert v["state"] == "HEALTHY" and v["eds_health_status"] == "HEALTHY" and v["drain"] is None
    async with http.post("/nodes/nope/drain", headers={"Authorization": "Bearer s3cret"}) as r:
        assert r.status == 404
