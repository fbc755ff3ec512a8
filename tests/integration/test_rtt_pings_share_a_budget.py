"""RTT pings on real streams share the process's budget (health.rtt.ping_budget): three
scripted agents (real gRPC NodeProbe servers) dialled by a real control plane, pings every
50 ms each unless the budget stretches them."""
from __future__ import annotations

import asyncio

import pytest
from scripted_agent import ScriptedAgent

from xds_server.config import parse_config
from xds_server.server import ControlPlane
from xds_server.testing import wait_for

WINDOW_S = 2.0


def _config(ports: list[int], budget: float) -> dict:
    return {
        "xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0"},
        "health": {"rtt": {"ping_interval": "50ms", "ping_budget": budget}},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.1:{8001 + i}", "probe_address": f"127.0.0.1:{port}"}
            for i, port in enumerate(ports)]}],
    }


async def _pings_per_agent(budget: float) -> list[int]:
    """Pings each of three agents received over WINDOW_S once all three streams are open."""
    agents = [await ScriptedAgent.start() for _ in range(3)]
    cp = ControlPlane(parse_config(_config([a.port for a in agents], budget)))
    await cp.start()
    try:
        await wait_for(lambda: all(a.streams and any(m.HasField("ping") for m in a.received) for a in agents),
                       timeout_s=10)
        before = [sum(m.HasField("ping") for m in a.received) for a in agents]
        await asyncio.sleep(WINDOW_S)
        return [sum(m.HasField("ping") for m in a.received) - b for a, b in zip(agents, before, strict=True)]
    finally:
        await cp.stop()
        for a in agents:
            await a.stop()


@pytest.mark.parametrize("budget", [6.0, 0.0])
async def test_the_streams_of_one_process_ping_within_its_budget_together(budget):
    got = await _pings_per_agent(budget)
    if budget:
        # 3 streams at 6 pings a second in all: each every 0.5 s (+-20 % jitter), ~4 in 2 s
        assert all(2 <= n <= 6 for n in got), got
        assert sum(got) <= budget * WINDOW_S * 1.25 + 3, got
    else:
        # no budget: each every 50 ms (+-20 %), ~40 in 2 s
        assert all(n >= 25 for n in got), got
