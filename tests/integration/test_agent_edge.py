"""The agent edge: regression tests, one per hostile case, against a real control plane
and a scripted fake agent (a real gRPC NodeProbe server)."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time

import aiohttp
import pytest
from scripted_agent import ScriptedAgent, heartbeat, result

from node_probe.proto import probe_pb2
from xds_server.config import parse_config
from xds_server.health.model import NodeState, ProbeObserved, StreamClosed
from xds_server.server import ControlPlane
from xds_server.testing import wait_for


def config(agent_port: int, probe: dict | None = None, **health) -> dict:
    return {
        "xds": {"listen": "127.0.0.1:0"},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"ping_interval_ms": 100, "ramp_start_percent": 100, "probation_clean_s": 1.0, **health},
        "probe": {"silent_stream_redial_ms": 1000, **(probe or {})},
        "clusters": [{"name": "llm", "nodes": [
            {"id": "a", "address": "127.0.0.1:8001", "probe_address": f"127.0.0.1:{agent_port}"}]}],
    }


#: ``wait_for`` with this module's polling defaults (s).
until = functools.partial(wait_for, timeout_s=5.0, step_s=0.02)


def strict_json(text: str):
    def bad(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(text, parse_constant=bad)


@pytest.fixture
async def rig():
    """(control plane, agent, admin session); node "a" HEALTHY with a 12 ms probe before the test."""
    agent = await ScriptedAgent.start()
    cp = ControlPlane(parse_config(config(agent.port)))
    await cp.start()
    http = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{cp.admin_port}")
    try:
        await until(lambda: cp.health["a"].state is NodeState.WARMING)
        agent.send(result(ttft_ms=12.0))
        await until(lambda: cp.health["a"].state is NodeState.HEALTHY)
        yield cp, agent, http
    finally:
        await http.close()
        await cp.stop()
        await agent.stop()


async def detect_agent_loss_s(cp: ControlPlane, agent: ScriptedAgent) -> float:
    """Stop the agent (host dead); seconds until the node is published UNHEALTHY."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await agent.stop()
    await until(lambda: cp.routing["a"].health_status == "UNHEALTHY", timeout_s=3.0, step_s=0.005)
    return loop.time() - t0


def bad(cp: ControlPlane, field: str, reason: str) -> int:
    return cp.counters.bad_fields[(field, reason)]


async def test_ttft_inf_does_not_end_health_checking(rig):
    cp, agent, _ = rig
    agent.send(result(ttft_ms=float("inf")))
    await until(lambda: bad(cp, "inference_result.ttft_ms", "not_finite") == 1)
    hb = cp.heartbeats["a"]
    await until(lambda: cp.heartbeats["a"] >= hb + 3)  # still counting heartbeats
    assert cp.sessions["a"].alive and cp.health["a"].state is NodeState.HEALTHY
    assert await detect_agent_loss_s(cp, agent) < 1.0  # seed 000: 3 misses (380 ms); phi sooner


async def test_ttft_1e308_never_reaches_the_model_nor_makes_an_outlier(rig):
    cp, agent, http = rig
    agent.send(result(ttft_ms=1e308), result(ttft_ms=-5.0))
    await until(lambda: bad(cp, "inference_result.ttft_ms", "out_of_range") == 1
                and bad(cp, "inference_result.ttft_ms", "negative") == 1)
    assert cp.health["a"].probe.ewma_ttft_ms == 12.0 and cp.health["a"].probe.last_ttft_ms == 12.0
    async with http.get("/nodes/a") as r:
        v = strict_json(await r.text())
    assert v["ewma_ttft_ms"] == 12.0 and v["state"] == "HEALTHY"


async def test_unknown_nvml_state_reads_unknown_and_admin_answers_200(rig):
    cp, agent, http = rig
    msg = heartbeat(99)
    msg.heartbeat.telemetry.gpu.state = 77
    msg.heartbeat.telemetry.engine_state = 42
    agent.heartbeats = False
    agent.send(msg)
    await until(lambda: bad(cp, "heartbeat.telemetry.gpu.state", "unknown_enum") == 1)
    assert bad(cp, "heartbeat.telemetry.engine_state", "unknown_enum") == 1
    for path in ("/nodes", "/nodes/a", "/clusters", "/metrics"):
        async with http.get(path) as r:
            assert r.status == 200, path
    async with http.get("/nodes/a") as r:
        v = strict_json(await r.text())
    assert v["gpu"]["nvml"] == "NVML_STATE_UNKNOWN"
    assert v["engine_state"] == "COLD"  # an unknown engine state reads as COLD: not routed


async def test_nan_and_inf_telemetry_never_reach_nodes_json_or_eds(rig):
    cp, agent, http = rig
    msg = heartbeat(99)
    load = msg.heartbeat.telemetry.engine_load
    load.requests_waiting = float("nan")
    load.requests_running = float("inf")
    load.kv_cache_usage_ratio = 5.0
    agent.heartbeats = False
    agent.send(msg)
    await until(lambda: bad(cp, "heartbeat.telemetry.engine_load.requests_waiting", "not_finite") == 1)
    assert bad(cp, "heartbeat.telemetry.engine_load.requests_running", "not_finite") == 1
    assert bad(cp, "heartbeat.telemetry.engine_load.kv_cache_usage_ratio", "out_of_range") == 1
    async with http.get("/nodes") as r:
        text = await r.text()
    node = strict_json(text)["nodes"][0]
    assert node["engine_load"]["requests_waiting"] is None and node["engine_load"]["requests_running"] is None
    assert node["engine_load"]["kv_cache_usage_ratio"] is None
    assert cp.health["a"].engine.requests_waiting is None and cp.routing["a"].weight == 100


async def test_huge_stall_detail_is_clipped_in_reasons_events_logs_and_probe_now(rig, caplog):
    cp, agent, http = rig
    caplog.set_level(logging.INFO)
    msg = heartbeat(99, stalled=True, stall_detail="S" * 1_000_000)
    agent.send(msg)
    await until(lambda: bad(cp, "heartbeat.telemetry.stall_detail", "too_long") >= 1)
    await until(lambda: any(r.startswith("engine stalled") for r in agent.probe_now_reasons()))
    limit = cp.config.probe.limits.max_text_chars
    assert max(len(r) for r in agent.probe_now_reasons()) <= limit
    assert all(len(e.reason) <= cp.config.admin.event_reason_max_chars for e in cp.events)
    assert len(cp.health["a"].reason) < 2 * limit
    async with http.get("/events?limit=5") as r:
        assert len(await r.read()) < 10_000
    assert max(len(r.getMessage()) for r in caplog.records) < 2_000


async def test_a_failure_handling_one_message_does_not_end_the_session(rig):
    cp, agent, _ = rig
    sess = cp.sessions["a"]
    real = sess.sink
    failed = []

    def flaky(node_id, obs, now_s):
        if isinstance(obs, (ProbeObserved, StreamClosed)) and len(failed) < 2:
            failed.append(obs)
            raise RuntimeError("boom")
        return real(node_id, obs, now_s)

    sess.sink = flaky
    agent.send(result(ttft_ms=15.0))
    await until(lambda: len(failed) == 1)
    agent.end_stream()  # the StreamClosed observation fails too: the old session died here
    await until(lambda: len(failed) == 2 and agent.streams == 2 and sess.connected)
    agent.send(result(ttft_ms=17.0))
    await until(lambda: cp.health["a"].probe.last_ttft_ms == 17.0)
    assert sess.alive and sess.handler_errors == 2
    assert cp.counters.handler_errors == {"message": 1, "stream_closed": 1}
    assert await detect_agent_loss_s(cp, agent) < 1.0


async def test_silent_open_probe_stream_is_redialled():
    agent = await ScriptedAgent.start()
    agent.heartbeats = False
    cp = ControlPlane(parse_config(config(agent.port, probe={"silent_stream_redial_ms": 300})))
    await cp.start()
    try:
        await until(lambda: agent.streams >= 1)
        await until(lambda: agent.streams >= 3, timeout_s=3.0)  # redialled, twice
        agent.heartbeats = True
        await until(lambda: cp.sessions["a"].connected and cp.heartbeats["a"] > 3)
    finally:
        await cp.stop()
        await agent.stop()


async def test_malformed_agent_message_flood_is_logged_rate_limited(rig, caplog):
    cp, agent, _ = rig
    caplog.set_level(logging.WARNING, logger="xds_server.probing")
    agent.send(*[probe_pb2.AgentMessage(pong=probe_pb2.Pong(seq=10_000_000 + i)) for i in range(1000)])
    await until(lambda: cp.counters.malformed["a"] >= 1000, timeout_s=30)
    lines = [r for r in caplog.records if r.name == "xds_server.probing"]
    assert cp.counters.malformed["a"] == 1000 and bad(cp, "pong.seq", "mismatch") == 1000
    assert 1 <= len(lines) <= 4  # one per kind per 10 s, not one per message
    assert cp.sessions["a"].connected


# -- our own stall (xds_server.probing.stall_hold): the control plane's event loop blocked, as a SIGSTOP,
#    a VM pause or a long GC would; the agent shares the loop here, so it is stopped too and
#    heartbeats again as soon as the loop runs


def _stall_own_loop(s: float) -> float:
    """Block the event loop for ``s`` seconds; returns the loop time we woke at."""
    time.sleep(s)
    return asyncio.get_running_loop().time()


async def test_a_stream_cut_during_our_own_stall_is_redialled_without_an_ejection(rig):
    cp, agent, _ = rig
    # none of the node's heartbeats may be in flight when we stall, so the cut is the first thing
    # read on waking (a heartbeat read first would make the node heard after the stall, and the
    # close would be judged at once, without a hold): the last one before the stall is sent by hand
    # and read (the agent's count of heartbeats sent, its seq, equals ours of heartbeats read)
    agent.heartbeats = False
    agent._seq += 1
    agent.send(heartbeat(agent._seq))
    await until(lambda: cp.heartbeats["a"] == agent._seq and agent._script.empty())
    streams, hb = agent.streams, cp.heartbeats["a"]
    agent.end_stream()     # the agent ends the stream while we are stopped: we find it cut on waking
    woke = _stall_own_loop(0.6)   # 3 miss windows: the close alone would count 6 misses, an ejection
    agent.heartbeats = True        # the next stream heartbeats again
    await until(lambda: agent.streams > streams and cp.heartbeats["a"] >= hb + 3)
    loop = asyncio.get_running_loop()
    await until(lambda: loop.time() > woke + cp.config.probe.stalls.stall_hold.s)  # any hold is over
    assert cp.health["a"].state is NodeState.HEALTHY and not cp.health["a"].heartbeat.stream_closed
    assert sum(cp.counters.ejections.values()) == 0
    assert cp.sessions["a"].silence_gate.held >= 1  # the close was held, then dropped: heard again


async def test_a_node_silent_after_our_own_stall_is_ejected_when_the_hold_ends(rig):
    cp, agent, _ = rig
    agent.heartbeats = False  # the node stays silent after we wake
    woke = _stall_own_loop(0.6)
    await until(lambda: cp.health["a"].state is NodeState.UNHEALTHY)
    # judged once the hold ended (as long as the stall, >= 0.55 s: 0.6 s less the sampler's
    # period; at most probe.stalls.stall_hold), not one miss window (0.18 s) after waking
    assert asyncio.get_running_loop().time() >= woke + 0.5
    assert "consecutive misses" in cp.health["a"].reason or "phi" in cp.health["a"].reason
