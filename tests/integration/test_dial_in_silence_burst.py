"""Dial-in streams that fall silent: one alone is its agent's (ended, the node judged by its
silence); many at once are ours (a control plane starved of CPU reads every stream late): kept
open, counted, nobody ejected. Real control plane, real gRPC streams from in-process agents whose
transports stay up (gRPC's C core answers the PINGs) while their heartbeats stop.
"""
from __future__ import annotations

import asyncio

from dial_in_agent import DialInAgent

from xds_server.config import parse_config
from xds_server.health.records import NodeState
from xds_server.server import ControlPlane
from xds_server.testing import free_port, wait_for

NODES = 12
REFRESH_MS = 200  # silent bound: max(silent_stream_redial 300 ms, 3 x 200 ms) = 600 ms
QUIET_S = 1.5


async def test_many_streams_silent_at_once_are_ours_and_kept_one_alone_is_its_agents():
    port = free_port()
    ids = [f"n{i}" for i in range(NODES)]
    cp = ControlPlane(parse_config({
        "xds": {"listen": f"127.0.0.1:{port}"}, "admin": {"listen": "127.0.0.1:0"},
        "probe": {"transport": {"telemetry_refresh": f"{REFRESH_MS}ms"},
                  "channel": {"silent_stream_redial": "300ms"}},
        "health": {"rtt": {"ping_interval": "60s"},
                   "probation": {"ramp_start_percent": 100, "ramp_step": "100ms", "clean": "1s"}},
        "clusters": [{"name": "llm", "nodes": [{"id": i, "address": f"127.0.0.{k + 1}:8000"}
                                               for k, i in enumerate(ids)]}]}))
    agents = [DialInAgent(i, port, REFRESH_MS) for i in ids]
    try:
        await cp.start()
        for a in agents:
            a.dial()
        await wait_for(lambda: all(cp.core.health[i].state is NodeState.HEALTHY for i in ids), timeout_s=15)
        connects = {i: cp.sessions[i].connects for i in ids}
        silent = cp.counters.silent_streams

        for a in agents:  # every heartbeat stops at once, the transports stay up
            a.talking = False
        await asyncio.sleep(QUIET_S)
        for a in agents:
            a.talking = True
        await asyncio.sleep(0.5)
        # judged ours (the first ones looked at; the rest held as after a stall of ours), none alone
        assert silent["burst"] >= 1 and silent["node"] == 0, dict(silent)
        assert {i: cp.core.health[i].state for i in ids} == dict.fromkeys(ids, NodeState.HEALTHY)
        assert {i: cp.sessions[i].connects for i in ids} == connects  # no stream ended, none redialled
        assert cp.counters.ejections == {}

        agents[0].talking = False  # one alone: its agent's silence
        await wait_for(lambda: cp.core.health["n0"].state is NodeState.UNHEALTHY, timeout_s=3)
        assert silent["node"] == 1
        assert "consecutive misses" in cp.core.health["n0"].reason
        assert all(cp.core.health[i].state is NodeState.HEALTHY for i in ids[1:])
    finally:
        for a in agents:
            await a.cut()
        await cp.stop()
