"""A dial-in agent whose own event loop hangs while its process runs: gRPC's C core keeps
answering the control plane's PINGs, so the transport cannot see it. Its heartbeats (the telemetry
refresh) are what prove its loop alive: a stream without one for three refreshes is ended and the
node judged by its silence. A hang shorter than that bound changes nothing. Real agent (its own
thread and event loop, as its own process would have), real control plane, real simulated engine.
"""
from __future__ import annotations

import asyncio
import threading
import time

from aiohttp import web

from node_probe.agent import AgentConfig, ProbeAgent
from node_probe.sim import SimConfig, build_app
from xds_server.config import parse_config
from xds_server.health.records import NodeState
from xds_server.server import ControlPlane
from xds_server.testing import free_port, wait_for

REFRESH_MS = 300  # the stream is ended after 3 x 300 ms without a heartbeat


class AgentThread:
    """A ProbeAgent on an event loop of its own, in a thread; ``hang(s)`` blocks that loop."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.agent: ProbeAgent | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.agent = ProbeAgent(self.cfg)
        asyncio.run_coroutine_threadsafe(self.agent.start(), self.loop).result(10)

    def hang(self, seconds: float) -> None:
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def stop(self) -> None:
        if self.agent is not None:
            asyncio.run_coroutine_threadsafe(self.agent.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def test_a_hung_agent_loop_is_caught_within_three_refreshes_and_a_short_hang_changes_nothing():
    engine_port, xds_port = free_port(), free_port()
    runner = web.AppRunner(build_app(SimConfig(port=engine_port, replica_id="gpu-a", token_interval_ms=5)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", engine_port).start()
    cp = ControlPlane(parse_config({
        "xds": {"listen": f"127.0.0.1:{xds_port}"}, "admin": {"listen": "127.0.0.1:0"},
        "probe": {"transport": {"telemetry_refresh": f"{REFRESH_MS}ms"},
                  "channel": {"silent_stream_redial": "500ms"}},
        "health": {"probation": {"ramp_start_percent": 100, "ramp_step": "100ms", "clean": "1s"}},
        "clusters": [{"name": "llm", "nodes": [{"id": "gpu-a", "address": f"127.0.0.1:{engine_port}"}]}]}))
    agent = AgentThread(AgentConfig(engine_url=f"http://127.0.0.1:{engine_port}", listen=None, node_id="gpu-a",
                                    control_planes=(f"127.0.0.1:{xds_port}",), probe_interval_s=0.3,
                                    gpu_interval_s=0))
    try:
        await cp.start()
        agent.start()
        session = cp.sessions["gpu-a"]
        await wait_for(lambda: cp.core.health["gpu-a"].state is NodeState.HEALTHY, timeout_s=15)
        connects = session.connects

        agent.hang(0.5)  # under the bound (0.9 s): PINGs answered, the stream stays, nothing counted
        await asyncio.sleep(1.2)
        assert session.connects == connects and session.connected
        assert cp.core.health["gpu-a"].state is NodeState.HEALTHY

        t0 = time.monotonic()
        agent.hang(3.0)  # over it: the stream is ended and the node judged by its silence
        await wait_for(lambda: cp.core.health["gpu-a"].state is NodeState.UNHEALTHY, timeout_s=5)
        caught_s = time.monotonic() - t0
        reason = cp.core.health["gpu-a"].reason
        assert 0.8 <= caught_s <= 2.0, caught_s
        assert "consecutive misses" in reason, reason   # silence counted after the stream was ended
        await wait_for(lambda: session.connects > connects, timeout_s=10)  # it dials again once awake
        await wait_for(lambda: cp.core.health["gpu-a"].state in (NodeState.PROBATION, NodeState.HEALTHY),
                       timeout_s=10)
    finally:
        agent.stop()
        await cp.stop()
        await runner.cleanup()
