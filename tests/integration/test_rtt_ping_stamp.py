"""A ping's round trip starts when the ping is written to the stream, not when it was queued: a
ping that waited behind a slow write measures the network, not our queue (2,000 agents dialling
at once put 60-260 ms of our own backlog into the first round trips). Here the stream's first
messages are Hello, ProbeNow and the first Ping; the ProbeNow's write is held 300 ms, so the Ping
waits that long in the session's queue, and its round trip must still read as loopback."""
from __future__ import annotations

import asyncio

import pytest
from test_h2_agents import _beat, _first, _module

from xds_server.config import parse_config
from xds_server.probing.dial_in import InboundCall
from xds_server.server import ControlPlane
from xds_server.testing import wait_for

_HELD_S = 0.3


async def test_a_ping_queued_behind_a_slow_write_measures_from_its_own_write(monkeypatch: pytest.MonkeyPatch):
    h2 = _module()
    write = InboundCall.write
    held: list[bool] = []

    async def slow_probe_now(self: InboundCall, message):
        if message.HasField("probe_now") and not held:
            held.append(True)
            await asyncio.sleep(_HELD_S)  # the write takes 300 ms: the queue behind it waits
        await write(self, message)

    monkeypatch.setattr(InboundCall, "write", slow_probe_now)
    cp = ControlPlane(parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0}, "admin": {"listen": "127.0.0.1:0"},
        "health": {"rtt": {"ping_interval": "10s"}},  # one ping: the first, queued behind the ProbeNow
        "clusters": [{"name": "llm", "nodes": [{"id": "a", "address": "10.0.0.1:8000"}]}]}))
    await cp.start()
    alive = [True]
    runner = asyncio.create_task(h2.run_agents(cp.xds_port, [("a", "10.0.0.1:8000")], _first, _beat, 0.2,
                                               lambda: None, lambda: alive[0]))
    try:
        await wait_for(lambda: cp.core.health["a"].rtt.samples >= 1, timeout_s=10, what="the first RTT sample")
        assert held, "the ProbeNow write was held"
        rtt = cp.core.health["a"].rtt
        assert rtt.last_ms is not None and rtt.last_ms < _HELD_S * 1000 / 3, rtt  # loopback, not the 300 ms
    finally:
        alive[0] = False
        await asyncio.wait_for(runner, 5)
        await cp.stop()
