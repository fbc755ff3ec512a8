"""A probe timed across a pause of the agent's own event loop is run once more: the pause is the
agent's, not the engine's TTFT (node_probe.prober.LoopPause). Real HTTP on 127.0.0.1, the
simulated engine in the same loop, the loop blocked with time.sleep as a GC or a slow call would."""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest
from aiohttp import web

from node_probe.config import AgentConfig
from node_probe.prober import OWN_PAUSE_MS, LoopPause, Prober
from node_probe.sim import SimConfig, build_app
from xds_server.testing import free_port


@pytest.fixture
async def engine_url():
    port = free_port()
    runner = web.AppRunner(build_app(SimConfig(port=port, replica_id="gpu-a", token_interval_ms=5)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def _probe(url: str) -> object:
    prober = Prober(AgentConfig(engine_url=url, listen="127.0.0.1:0", gpu_interval_s=0))
    async with aiohttp.ClientSession() as s:
        await prober.probe(s, deep=False)  # model discovered, connection open
        asyncio.get_running_loop().call_later(0.001, time.sleep, 0.3)  # the loop pauses mid-probe
        return await prober.probe(s, deep=False)


async def test_a_probe_across_the_agents_own_pause_is_probed_again_and_reports_the_engines_ttft(engine_url, caplog):
    with caplog.at_level(logging.INFO, logger="node_probe.prober"):
        out = await _probe(engine_url)
    assert out.ok and out.ttft_ms is not None and out.ttft_ms < 200.0, out
    assert any("pause of the agent's own loop: probing again" in r.getMessage() for r in caplog.records)


async def test_the_pause_watch_sees_a_pause_that_ends_with_the_watched_await():
    async with LoopPause() as quiet:
        await asyncio.sleep(0.05)
    assert quiet.longest_ms < OWN_PAUSE_MS
    async with LoopPause() as paused:
        time.sleep(0.25)  # no await between: the tick is read at the exit
    assert paused.longest_ms >= 200.0
