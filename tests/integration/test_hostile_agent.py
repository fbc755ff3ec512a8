"""Hostile agent: hypothesis-generated AgentMessage sequences (NaN, inf, negative, 1e308,
unknown enums, huge strings, seq backwards or repeated, floods, reconnect storms) from a scripted
fake agent (a real grpc.aio NodeProbe server) against a real control plane.

After every sequence: the probe session is alive and counting heartbeats, every planted bad field
was counted under its (field, reason), /nodes is strict JSON with only finite numbers, and the
published ClusterLoadAssignment has weights in range. After all sequences: stopping the agent
(a dead host) is detected within its normal time.

The control plane and the agent run on an event loop in a helper thread; hypothesis drives them
from the test thread (one control plane for the whole run keeps the budget small).
"""
from __future__ import annotations

import asyncio
import collections
import functools
import json
import math
import threading

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted_agent import ScriptedAgent, heartbeat, result

from node_probe.proto import probe_pb2
from xds_server.config import parse_config
from xds_server.health.model import NodeState
from xds_server.server import ControlPlane
from xds_server.testing import wait_for
from xds_server.xds.resources import CLA_TYPE_URL

BIG = "\n\x1b[2J" + "Z" * 20_000

# (value, expected reason or None) per field
_WAITING = [(3.0, None), (math.nan, "not_finite"), (math.inf, "not_finite"), (-1.0, "negative"),
            (1e308, "out_of_range")]
_RATIO = [(0.5, None), (5.0, "out_of_range"), (-math.inf, "not_finite")]
_NVML = [(probe_pb2.NVML_STATE_OK, None), (77, "unknown_enum")]
_ENGINE = [(probe_pb2.ENGINE_STATE_READY, None), (42, "unknown_enum")]
_TEXT = [("", None), ("stalled at step 12", None), (BIG, "too_long")]
_TTFT = [(12.0, None), (math.inf, "not_finite"), (math.nan, "not_finite"), (-1.0, "negative"),
         (1e308, "out_of_range")]
_FAILURE = [(probe_pb2.FAILURE_KIND_TIMEOUT, None), (77, "unknown_enum")]

Step = tuple[str, object, collections.Counter]


@st.composite
def hostile_heartbeat(draw) -> Step:
    bad: collections.Counter = collections.Counter()
    msg = heartbeat(draw(st.sampled_from([0, 1, 5, 2 ** 64 - 1])))
    tel = msg.heartbeat.telemetry
    p = "heartbeat.telemetry."
    v, why = draw(st.sampled_from(_WAITING))
    tel.engine_load.requests_waiting = v
    if why:
        bad[(p + "engine_load.requests_waiting", why)] += 1
    v, why = draw(st.sampled_from(_RATIO))
    tel.engine_load.kv_cache_usage_ratio = v
    if why:
        bad[(p + "engine_load.kv_cache_usage_ratio", why)] += 1
    v, why = draw(st.sampled_from(_NVML))
    tel.gpu.state = v
    if why:
        bad[(p + "gpu.state", why)] += 1
    v, why = draw(st.sampled_from(_ENGINE))
    tel.engine_state = v
    if why:
        bad[(p + "engine_state", why)] += 1
    v, why = draw(st.sampled_from(_TEXT))
    tel.stall_detail = v
    if why:
        bad[(p + "stall_detail", why)] += 1
    return ("send", [msg], bad)


@st.composite
def hostile_result(draw) -> Step:
    bad: collections.Counter = collections.Counter()
    text, why_t = draw(st.sampled_from(_TEXT))
    if why_t:
        bad[("inference_result.detail", why_t)] += 1
    if draw(st.booleans()):
        ttft, why = draw(st.sampled_from(_TTFT))
        if why:
            bad[("inference_result.ttft_ms", why)] += 1
        return ("send", [result(True, ttft, detail=text)], bad)
    failure, why = draw(st.sampled_from(_FAILURE))
    if why:
        bad[("inference_result.failure", why)] += 1
    return ("send", [result(False, 0.0, failure=failure, detail=text)], bad)


def pong_flood(n: int) -> Step:
    msgs = [probe_pb2.AgentMessage(pong=probe_pb2.Pong(seq=10 ** 12 + i)) for i in range(n)]
    return ("send", msgs, collections.Counter({("pong.seq", "mismatch"): n}))


steps = st.one_of(
    hostile_heartbeat(),
    hostile_result(),
    st.sampled_from([1, 40, 400]).map(pong_flood),
    st.just(("send", [probe_pb2.AgentMessage()], collections.Counter({("agent_message", "empty"): 1}))),
    st.lists(st.integers(0, 3), min_size=2, max_size=5).map(  # seq backwards or repeated: accepted
        lambda seqs: ("send", [heartbeat(s) for s in seqs], collections.Counter())),
    st.just(("reconnect", None, collections.Counter())),
)


class Rig:
    """A control plane and a scripted agent on an event loop in a helper thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.agent: ScriptedAgent | None = None
        self.cp: ControlPlane | None = None

    def run(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def start(self) -> None:
        self.agent = await ScriptedAgent.start()
        self.cp = ControlPlane(parse_config({
            "xds": {"listen": "127.0.0.1:0"},
            "admin": {"listen": "127.0.0.1:0"},
            "health": {"ping_interval_ms": 50, "ramp_start_percent": 100, "probation_clean_s": 0.5},
            "clusters": [{"name": "llm", "nodes": [
                {"id": "a", "address": "127.0.0.1:8001", "probe_address": f"127.0.0.1:{self.agent.port}"}]}],
        }))
        await self.cp.start()
        self.http = aiohttp.ClientSession(f"http://127.0.0.1:{self.cp.admin_port}")
        await until(lambda: self.cp.health["a"].state is NodeState.WARMING)
        self.agent.send(result(ttft_ms=12.0))
        await until(lambda: self.cp.health["a"].state is NodeState.HEALTHY)

    async def stop(self) -> None:
        await self.http.close()
        if self.cp is not None:
            await self.cp.stop()
        if self.agent is not None:
            await self.agent.stop()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


#: ``wait_for`` with this module's polling defaults (s).
until = functools.partial(wait_for, timeout_s=10.0, step_s=0.01)


def _all_finite(obj) -> bool:
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(_all_finite(v) for v in obj.values())
    if isinstance(obj, list):
        return all(_all_finite(v) for v in obj)
    return True


async def play(rig: Rig, seq: list[Step]) -> None:
    cp, agent = rig.cp, rig.agent
    before = collections.Counter(cp.counters.bad_fields)
    expected: collections.Counter = collections.Counter()
    def counted() -> bool:
        return all(cp.counters.bad_fields[k] - before[k] >= v for k, v in expected.items())

    for kind, msgs, bad in seq:
        if kind == "send":
            agent.send(*msgs)
        else:
            # What was sent on this stream must have been read before the stream ends: a message
            # still in flight when the agent drops the stream is lost, not malformed.
            await until(counted)
            agent.end_stream()
            streams = agent.streams
            await until(lambda streams=streams: agent.streams > streams)
        expected.update(bad)
    await until(counted)
    delta = collections.Counter({k: cp.counters.bad_fields[k] - before[k] for k in expected})
    assert delta == expected  # each planted bad field counted once, under its (field, reason)
    hb = cp.heartbeats["a"]
    await until(lambda: cp.heartbeats["a"] >= hb + 2)  # the session is alive and heartbeats count
    assert cp.sessions["a"].alive and cp.sessions["a"].connected
    async with rig.http.get("/nodes") as r:
        assert r.status == 200
        body = json.loads(await r.text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert _all_finite(body)
    node = body["nodes"][0]
    assert len(json.dumps(node)) < 8_000 and len(node["reason"]) <= 2 * cp.config.probe.limits.max_text_chars
    el = node.get("engine_load") or {}
    for k in ("requests_waiting", "requests_running"):
        assert el.get(k) is None or 0 <= el[k] <= cp.config.probe.limits.max_requests
    assert el.get("kv_cache_usage_ratio") is None or 0 <= el["kv_cache_usage_ratio"] <= 1
    nh = cp.health["a"]
    for v in (nh.probe.ewma_ttft_ms, nh.probe.last_ttft_ms):
        assert v is None or 0 <= v <= cp.config.probe.limits.max_ttft.ms
    res = cp.cache.resources(CLA_TYPE_URL).get("llm")
    if res is not None:
        from envoy.config.endpoint.v3 import endpoint_pb2

        cla = endpoint_pb2.ClusterLoadAssignment()
        cla.ParseFromString(res.any.value)
        for lle in cla.endpoints:
            for e in lle.lb_endpoints:
                assert 1 <= e.load_balancing_weight.value <= 100 and e.health_status in (1, 2, 3)


def test_hostile_agent_sequences_never_stop_health_checking_nor_poison_state():
    rig = Rig()
    try:
        rig.run(rig.start())

        @settings(max_examples=25, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(st.lists(steps, min_size=1, max_size=8))
        def sequences(seq):
            rig.run(play(rig, seq))

        sequences()
        cp, agent = rig.cp, rig.agent

        async def dead_host_detection_s() -> float:
            # a good node again first (an unknown engine state may have sent it to WARMING)
            agent.send(result(ttft_ms=12.0))
            await until(lambda: cp.health["a"].heartbeat.consecutive_misses == 0 and cp.sessions["a"].connected)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await agent.stop()
            need = cp.config.health.heartbeat.consecutive_misses
            await until(lambda: cp.health["a"].heartbeat.consecutive_misses >= need
                        and cp.routing["a"].health_status != "HEALTHY", step_s=0.005)
            return loop.time() - t0

        # seed 000: 3 misses at 100 ms + 80 ms grace = 380 ms; allow scheduling slack, not minutes
        assert rig.run(dead_host_detection_s()) < 1.5
    finally:
        try:
            rig.run(rig.stop())
        finally:
            rig.close()
