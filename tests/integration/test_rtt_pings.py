"""The control plane's RTT pings, seen on the stream to one dial-in agent (the simulated agent of
``benchmarks/h2_agents.py``; each test watches the ``InboundCall.write`` of the control plane):

- each wait between pings is ``health.rtt.ping_interval`` x a random factor within
  ``health.rtt.ping_jitter``, so a node's pings do not keep meeting the same periodic work of the
  control plane (whose length would be added to the same nodes' round trips every time);
- a ping's round trip starts when the ping is written, not when it was queued: a ping that waited
  behind a slow write measures the network, not our queue (2,000 agents dialling at once put
  60-260 ms of our own backlog into the first round trips)."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from test_h2_agents import _beat, _first, _module

from xds_server.config import parse_config
from xds_server.probing.dial_in import InboundCall
from xds_server.server import ControlPlane
from xds_server.testing import wait_for

_HELD_S = 0.3

Write = Callable[[InboundCall, object], Awaitable[None]]


@contextlib.asynccontextmanager
async def _one_agent(monkeypatch: pytest.MonkeyPatch, rtt: dict, write: Callable[[Write], Write]
                     ) -> AsyncIterator[ControlPlane]:
    """A control plane with ``health.rtt`` = ``rtt`` and node "a", whose simulated agent has dialled
    in; every write to an agent's stream goes through ``write(the real write)``."""
    h2 = _module()
    monkeypatch.setattr(InboundCall, "write", write(InboundCall.write))
    cp = ControlPlane(parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0}, "admin": {"listen": "127.0.0.1:0"},
        "health": {"rtt": rtt},
        "clusters": [{"name": "llm", "nodes": [{"id": "a", "address": "10.0.0.1:8000"}]}]}))
    await cp.start()
    alive = [True]
    runner = asyncio.create_task(h2.run_agents(cp.xds_port, [("a", "10.0.0.1:8000")], _first, _beat, 0.2,
                                               lambda: None, lambda: alive[0]))
    try:
        await wait_for(lambda: cp.sessions["a"].connected, timeout_s=10, what="the agent's stream")
        yield cp
    finally:
        alive[0] = False
        await asyncio.wait_for(runner, 5)
        await cp.stop()


async def test_rtt_pings_wait_a_jittered_interval(monkeypatch):
    written: list[float] = []

    def recorded(write: Write) -> Write:
        async def w(self: InboundCall, message) -> None:
            if message.HasField("ping"):
                written.append(time.monotonic())
            await write(self, message)
        return w

    async with _one_agent(monkeypatch, {"ping_interval": "100ms", "ping_jitter": 0.5}, recorded):
        written.clear()
        await asyncio.sleep(2.5)
        gaps = [(b - a) * 1000.0 for a, b in itertools.pairwise(written)]
    assert len(gaps) >= 12                       # ~25 pings at 100 ms on average
    assert min(gaps) >= 30                       # never much sooner than 100 x (1 - 0.5) (a write may lag)
    assert max(gaps) - min(gaps) >= 30           # spread over 50-150 ms, not one fixed cadence
    assert 70 <= sum(gaps) / len(gaps) <= 140    # the interval on average


async def test_a_ping_queued_behind_a_slow_write_measures_from_its_own_write(monkeypatch):
    """The stream's first messages are Hello, ProbeNow and the first Ping; the ProbeNow's write is
    held 300 ms, so the Ping waits that long in the session's queue, and its round trip must still
    read as loopback."""
    held: list[bool] = []

    def slow_probe_now(write: Write) -> Write:
        async def w(self: InboundCall, message) -> None:
            if message.HasField("probe_now") and not held:
                held.append(True)
                await asyncio.sleep(_HELD_S)  # the write takes 300 ms: the queue behind it waits
            await write(self, message)
        return w

    # one ping: the first, queued behind the ProbeNow
    async with _one_agent(monkeypatch, {"ping_interval": "10s"}, slow_probe_now) as cp:
        await wait_for(lambda: cp.core.health["a"].rtt.samples >= 1, timeout_s=10, what="the first RTT sample")
        assert held, "the ProbeNow write was held"
        rtt = cp.core.health["a"].rtt
        assert rtt.last_ms is not None and rtt.last_ms < _HELD_S * 1000 / 3, rtt  # loopback, not the 300 ms
