"""A stream ended by an unanswered PING is a suspicion, as phi's is: the node is out at once, and
back as it was (no clean period, no ramp) when its agent, having dialled again, is heard before
the count rule proves the loss; an agent silent past the count is proven and comes back through
PROBATION. Real agent process (SIGSTOPped: its gRPC core stops answering PINGs), real control
plane and its server-side keepalive, a simulated engine."""
from __future__ import annotations

import asyncio
import sys
import time

from aiohttp import web

from node_probe.sim import SimConfig, build_app
from xds_server.config import parse_config
from xds_server.health.records import EjectionCause, NodeState
from xds_server.server import ControlPlane
from xds_server.testing import ManagedProcess, free_port, wait_for

MISSES = 20  # heartbeat.consecutive_misses: the count proves a loss ~2.1 s after the stream's end


async def test_an_agent_heard_again_before_the_count_resumes_its_node_one_silent_past_it_comes_back_on_probation(
        tmp_path):
    engine_port, xds_port = free_port(), free_port()
    runner = web.AppRunner(build_app(SimConfig(port=engine_port, replica_id="gpu-a", token_interval_ms=5)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", engine_port).start()
    cp = ControlPlane(parse_config({
        "xds": {"listen": f"127.0.0.1:{xds_port}"}, "admin": {"listen": "127.0.0.1:0"},
        # a PING unanswered for 300 ms ends the stream: a stall of ours that long would be judged
        # ours (no verdict), which this test is not about
        "probe": {"dial_in": {"keepalive": "100ms", "ping_timeout": "300ms"}},
        "health": {"heartbeat": {"consecutive_misses": MISSES},
                   "probation": {"ramp_start_percent": 50, "ramp_step_percent": 50, "ramp_step": "200ms",
                                 "clean": "1s"}},
        "clusters": [{"name": "llm", "nodes": [{"id": "gpu-a", "address": f"127.0.0.1:{engine_port}"}]}]}))
    agent = ManagedProcess("agent-gpu-a", [
        sys.executable, "-m", "node_probe.cli", "--engine-url", f"http://127.0.0.1:{engine_port}",
        "--control-plane", f"127.0.0.1:{xds_port}", "--node-id", "gpu-a", "--probe-interval-s", "0.3"],
        tmp_path / "agent.log", ready_pattern="dialling")
    try:
        await cp.start()
        await asyncio.to_thread(agent.start)  # (off the loop: a blocked loop is a stall of ours)
        nh = lambda: cp.core.health["gpu-a"]  # noqa: E731 - a one-line reader
        await wait_for(lambda: nh().state is NodeState.HEALTHY, 20, what="gpu-a HEALTHY")

        def story(since: float) -> list[tuple[str, str, str]]:
            return [(e.from_state or "", e.to_state or "", e.reason) for e in cp.core.events
                    if e.node_id == "gpu-a" and e.kind == "transition" and e.wall_time_s >= since]

        # 0.7 s stopped: the PING deadline ends the stream (~0.4 s); the agent dials again on waking
        t0 = time.time()
        agent.freeze()
        try:
            await wait_for(lambda: nh().state is NodeState.UNHEALTHY, 3, what="gpu-a out on its PING deadline")
            out = nh()
        finally:
            await asyncio.sleep(max(0.0, 0.7 - (time.time() - t0)))
            agent.thaw()
        assert out.ejection.cause is EjectionCause.TRANSPORT, out
        assert "transport lost" in out.reason and f"suspected until {MISSES} consecutive misses" in out.reason
        await wait_for(lambda: nh().state is NodeState.HEALTHY, 5, what="gpu-a back")
        seen = story(t0)
        assert [(a, b) for a, b, _ in seen] == [("HEALTHY", "UNHEALTHY"), ("UNHEALTHY", "HEALTHY")], seen
        assert seen[1][2].startswith("transport suspicion disproved: heartbeat arrived after"), seen
        assert cp.counters.transport_drops["node"] == 1

        # 3.5 s stopped: past the count (~2.1 s after the stream's end): proven, back through PROBATION
        t1 = time.time()
        agent.freeze()
        try:
            await wait_for(lambda: nh().ejection.cause is EjectionCause.HEARTBEAT, 5,
                           what="the loss proven by the count rule")
            assert nh().state is NodeState.UNHEALTHY
            assert f"heartbeat: {MISSES} consecutive misses" in nh().reason, nh().reason
        finally:
            await asyncio.sleep(max(0.0, 3.5 - (time.time() - t1)))
            agent.thaw()
        await wait_for(lambda: nh().state is NodeState.HEALTHY, 15, what="gpu-a back after probation")
        path = [b for _, b, _ in story(t1)]
        assert path[0] == "UNHEALTHY" and "PROBATION" in path and path[-1] == "HEALTHY", story(t1)
    finally:
        agent.stop()
        await cp.stop()
        await runner.cleanup()
