"""benchmarks/h2_agents.py, the simulated dial-in agents that speak HTTP/2 by hand (the load
generator of ``benchmarks/dial_in.py --agent-kind h2``), against the real control plane: it takes
them for agents (streams open, heartbeats read, nodes routed), they answer its keepalive PINGs
every 90 ms without a drop, a Ping message gets its Pong (an RTT sample), and a stream the control
plane ends is dialled again."""
from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

from node_probe.proto import probe_pb2
from xds_server.config import parse_config
from xds_server.health.records import NodeState
from xds_server.server import ControlPlane
from xds_server.testing import wait_for

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "h2_agents.py"


def _module():
    spec = importlib.util.spec_from_file_location("h2_agents", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["h2_agents"] = mod
    spec.loader.exec_module(mod)
    return mod


def _beat(nid: str, seq: int) -> bytes:
    return probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(
        seq=seq, interval_ms=100, node_id=nid, liveness=probe_pb2.LIVENESS_TRANSPORT,
        telemetry=probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY))).SerializeToString()


def _first(nid: str, addr: str) -> list[bytes]:
    return [probe_pb2.AgentMessage(register=probe_pb2.Register(
                node_id=nid, cluster="llm", address=addr, agent_version="h2-test")).SerializeToString(),
            _beat(nid, 1),
            probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(
                seq=1, ok=True, ttft_ms=10.0, trigger="scheduled")).SerializeToString()]


async def test_the_control_plane_takes_the_simulated_agents_for_agents():
    h2 = _module()
    nodes = [("a", "10.0.0.1:8000"), ("b", "10.0.0.2:8000")]
    cp = ControlPlane(parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0}, "admin": {"listen": "127.0.0.1:0"},
        "probe": {"transport": {"telemetry_refresh": "200ms"},
                  "dial_in": {"keepalive": "90ms", "ping_timeout": "80ms"}},
        "health": {"rtt": {"ping_interval": "300ms"},
                   "probation": {"ramp_start_percent": 100.0, "ramp_step": "100ms"}},
        "clusters": [{"name": "llm", "nodes": [{"id": i, "address": a} for i, a in nodes]}]}))
    await cp.start()
    dials = [0]
    alive = [True]

    def dialled() -> None:
        dials[0] += 1

    runner = asyncio.create_task(h2.run_agents(cp.xds_port, nodes, _first, _beat, 0.2, dialled, lambda: alive[0]))
    try:
        await wait_for(lambda: all(cp.sessions[i].connected for i, _ in nodes), timeout_s=10, what="both streams")
        await wait_for(lambda: all(cp.core.health[i].state is NodeState.HEALTHY for i, _ in nodes),
                       timeout_s=10, what="both nodes HEALTHY")
        beats = {i: cp.core.counters.heartbeats[i] for i, _ in nodes}
        await asyncio.sleep(1.5)  # ~17 keepalive PINGs per connection, each answered within 80 ms
        assert dials[0] == 2, "no stream was dropped and dialled again"
        for i, _ in nodes:
            assert cp.core.counters.heartbeats[i] >= beats[i] + 5  # the 200 ms refresh: ~7 in 1.5 s
            assert cp.core.health[i].rtt.samples >= 2  # Ping messages answered with a Pong
            assert cp.core.health[i].state is NodeState.HEALTHY
        cp.sessions["a"]._current.cancel("test: end the stream")  # the control plane ends one stream
        await wait_for(lambda: dials[0] == 3, timeout_s=10, what="the ended stream dialled again")
        await wait_for(lambda: cp.sessions["a"].connected and cp.sessions["a"].connects >= 2, timeout_s=10,
                       what="node a's new stream")
    finally:
        alive[0] = False
        await asyncio.wait_for(runner, 5)
        await cp.stop()
