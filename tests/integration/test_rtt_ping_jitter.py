"""RTT pings are jittered: each wait is ``health.rtt.ping_interval`` x a random factor within
``health.rtt.ping_jitter``, so a node's pings do not keep meeting the same periodic work of the
control plane (whose length would be added to the same nodes' round trips every time). Measured
on the Ping messages the control plane writes to a dial-in agent's stream."""
from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from test_h2_agents import _beat, _first, _module

from xds_server.config import parse_config
from xds_server.probing.dial_in import InboundCall
from xds_server.server import ControlPlane
from xds_server.testing import wait_for


async def _ping_gaps_ms(monkeypatch: pytest.MonkeyPatch, jitter: float, seconds: float) -> list[float]:
    """Gaps (ms) between the Ping messages written to one agent's stream, 100 ms pings."""
    h2 = _module()
    written: list[float] = []
    write = InboundCall.write

    async def recorded(self: InboundCall, message):
        if message.HasField("ping"):
            written.append(time.monotonic())
        await write(self, message)

    monkeypatch.setattr(InboundCall, "write", recorded)
    cp = ControlPlane(parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0}, "admin": {"listen": "127.0.0.1:0"},
        "health": {"rtt": {"ping_interval": "100ms", "ping_jitter": jitter}},
        "clusters": [{"name": "llm", "nodes": [{"id": "a", "address": "10.0.0.1:8000"}]}]}))
    await cp.start()
    alive = [True]
    runner = asyncio.create_task(h2.run_agents(cp.xds_port, [("a", "10.0.0.1:8000")], _first, _beat, 0.2,
                                               lambda: None, lambda: alive[0]))
    try:
        await wait_for(lambda: cp.sessions["a"].connected, timeout_s=10, what="the agent's stream")
        written.clear()
        await asyncio.sleep(seconds)
        return [(b - a) * 1000.0 for a, b in itertools.pairwise(written)]
    finally:
        alive[0] = False
        await asyncio.wait_for(runner, 5)
        await cp.stop()


async def test_rtt_pings_wait_a_jittered_interval(monkeypatch):
    gaps = await _ping_gaps_ms(monkeypatch, 0.5, 2.5)
    assert len(gaps) >= 12                       # ~25 pings at 100 ms on average
    assert min(gaps) >= 30                       # never much sooner than 100 x (1 - 0.5) (a write may lag)
    assert max(gaps) - min(gaps) >= 30           # spread over 50-150 ms, not one fixed cadence
    assert 70 <= sum(gaps) / len(gaps) <= 140    # the interval on average
