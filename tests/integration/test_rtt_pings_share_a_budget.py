"""RTT pings on real streams share the process's budget (health.rtt.ping_budget): three
scripted agents (real gRPC NodeProbe servers) dialled by a real control plane, pings every
50 ms each unless the budget stretches them; /metrics says each process's pace."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from scripted_agent import ScriptedAgent

from xds_server.config import parse_config
from xds_server.server import ControlPlane
from xds_server.testing import wait_for

WINDOW_S = 2.0


def _config(ports: list[int], budget: float, workers: int = 0) -> dict:
    return {
        "xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0"},
        "health": {"rtt": {"ping_interval": "50ms", "ping_budget": budget}},
        "probe": {"workers": workers, "worker_report_interval": "100ms"},
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


async def _pace_metrics(admin_port: int) -> dict[tuple[str, str], float]:
    """(metric, process) -> value of the two ping-pace gauges."""
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        for name in ("sentinel_rtt_pinging_streams", "sentinel_rtt_ping_interval_seconds"):
            if line.startswith(name + '{process="'):
                process = line.split('"')[1]
                out[(name, process)] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("workers", [0, 1])
async def test_each_process_says_its_pinging_streams_and_their_ping_interval(workers):
    """Three streams at 6 pings a second: 0.5 s between one stream's pings, in the process that
    holds them (the main one, or the probe worker); a process with none pings at ping_interval."""
    agents = [await ScriptedAgent.start() for _ in range(3)]
    cp = ControlPlane(parse_config(_config([a.port for a in agents], 6.0, workers)))
    await cp.start()
    holder, idle = ("main", None) if workers == 0 else ("worker-0", "main")
    try:
        async def pinging(n: int) -> dict | None:
            m = await _pace_metrics(cp.admin_port)
            return m if m.get(("sentinel_rtt_pinging_streams", holder)) == n else None

        m = await wait_for(lambda: pinging(3), timeout_s=10, what="three streams pinging")
        assert m[("sentinel_rtt_ping_interval_seconds", holder)] == pytest.approx(0.5)
        if idle is not None:
            assert m[("sentinel_rtt_pinging_streams", idle)] == 0
            assert m[("sentinel_rtt_ping_interval_seconds", idle)] == pytest.approx(0.05)
        await agents[0].stop()  # its stream ends: two left, each pinging every 2 / 6 s
        m = await wait_for(lambda: pinging(2), timeout_s=10, what="two streams pinging")
        assert m[("sentinel_rtt_ping_interval_seconds", holder)] == pytest.approx(2 / 6)
    finally:
        await cp.stop()
        for a in agents:
            await a.stop()
