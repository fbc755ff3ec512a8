"""Agents dialling (back) in after a burst of drops judged ours: while they keep coming in, the
nodes whose agents are not back yet stay held (a starved control plane takes its time to take their new
streams); a node whose agent is not back by one hold after the last return is judged. Real control
plane, real gRPC streams: every agent's transport is cut at once (its channel closed: the call
ends under the server, as a PING timeout does), then the agents dial back one by one. And a drop
read just after a stall of our own loop is ours, though the node was heard after we woke.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from dial_in_agent import DialInAgent, heartbeat, probe_ok, register

from node_probe.dial_stream import METADATA
from node_probe.proto import probe_pb2, probe_pb2_grpc
from xds_server.config import parse_config
from xds_server.health.records import NodeState
from xds_server.probing.drop_burst import DropWatch
from xds_server.server import ControlPlane
from xds_server.testing import free_port, wait_for

NODES = 8
REFRESH_MS = 200
BACK_EVERY_S = 0.35  # an agent back every 0.35 s: the last one ~2.5 s after the burst (the hold: 1 s)


async def _burst_then_back_one_by_one(recovery: str) -> tuple[ControlPlane, list[DialInAgent], list[str]]:
    port = free_port()
    ids = [f"n{i}" for i in range(NODES)]
    cp = ControlPlane(parse_config({
        "xds": {"listen": f"127.0.0.1:{port}"}, "admin": {"listen": "127.0.0.1:0"},
        "probe": {"transport": {"telemetry_refresh": f"{REFRESH_MS}ms"},
                  "dial_in": {"burst_recovery": recovery}},
        "health": {"rtt": {"ping_interval": "60s"},
                   "probation": {"ramp_start_percent": 100, "ramp_step": "100ms", "clean": "1s"}},
        "clusters": [{"name": "llm", "nodes": [{"id": i, "address": f"127.0.0.{k + 1}:8000"}
                                               for k, i in enumerate(ids)]}]}))
    agents = [DialInAgent(i, port, REFRESH_MS) for i in ids]
    await cp.start()
    for a in agents:
        a.dial()
    await wait_for(lambda: all(cp.core.health[i].state is NodeState.HEALTHY for i in ids), timeout_s=15)
    await asyncio.gather(*(a.cut() for a in agents))  # every transport at once: a burst, ours
    drops = cp.counters.transport_drops
    # all ours: the first drops make a burst and the rest follow it within a hold (a stall noted
    # for it), or, when this process's own loop ran a PING timeout late meanwhile (a loaded
    # machine), every one is read after a stall of ours. Which rule claims which drop is the pure
    # rules' business (test_drop_burst, test_stall_hold); here either starts the stretch of ours
    # that the returns below rest on.
    await wait_for(lambda: drops["burst"] + drops["stall"] == NODES, timeout_s=3, what="the drops judged ours")
    assert drops["node"] == 0, dict(drops)
    for a in agents[:-1]:  # back one by one; the last agent never comes back
        await asyncio.sleep(BACK_EVERY_S)
        a.dial()
    return cp, agents, ids


async def test_nodes_not_back_yet_stay_held_while_agents_keep_coming_back_after_a_burst_of_ours():
    cp, agents, ids = await _burst_then_back_one_by_one("30s")
    try:
        await wait_for(lambda: all(cp.sessions[i].connected for i in ids[:-1]), timeout_s=5, what="agents back")
        # every agent that came back, even ~2.5 s after the burst, found its node still HEALTHY
        assert {i: cp.core.health[i].state for i in ids[:-1]} == dict.fromkeys(ids[:-1], NodeState.HEALTHY)
        assert not any(nid in ids[:-1] for nid, _ in cp.counters.ejections)
        assert cp.counters.transport_drops["returned"] >= 3
        # the returns belong to the burst's stretch of verdicts of ours, so its bound holds for them
        stretch = DropWatch.of(asyncio.get_running_loop()).stretch
        assert stretch is not None and stretch.last_s - stretch.since_s >= 1.5, stretch
        # the one that never came back is judged one hold after the last return
        await wait_for(lambda: cp.core.health[ids[-1]].state is NodeState.UNHEALTHY, timeout_s=4)
    finally:
        for a in agents:
            await a.cut()
        await cp.stop()


async def test_without_the_recovery_rule_agents_slower_than_one_hold_find_their_nodes_ejected():
    cp, agents, ids = await _burst_then_back_one_by_one("1ms")  # returns never hold again
    try:
        await wait_for(lambda: all(cp.sessions[i].connected for i in ids[:-1]), timeout_s=5, what="agents back")
        late = {nid for nid, _ in cp.counters.ejections} & set(ids[:-1])
        assert len(late) >= 3, sorted(late)  # those back more than ~1.2 s after the burst
        assert cp.counters.transport_drops["returned"] == 0
    finally:
        for a in agents:
            await a.cut()
        await cp.stop()


async def test_a_fleet_still_dialling_in_holds_the_nodes_whose_streams_were_cut_by_a_burst_of_ours():
    """A started control plane takes a fleet's first dials for tens of seconds, and agents whose
    streams a verdict of ours cut meanwhile wait behind them: first dials hold the cut nodes as
    returns do. 8 agents cut at once (a burst, ours), 8 other agents dial in for the first time one
    every 0.3 s, and only then the cut ones come back, ~2.7 s after the burst (one hold: 1 s): none
    of their nodes was ejected. (Before: first dials held nothing, and all 8 were.)"""
    port = free_port()
    ids = [f"n{i}" for i in range(2 * NODES)]
    cp = ControlPlane(parse_config({
        "xds": {"listen": f"127.0.0.1:{port}"}, "admin": {"listen": "127.0.0.1:0"},
        "probe": {"transport": {"telemetry_refresh": f"{REFRESH_MS}ms"}},
        "health": {"rtt": {"ping_interval": "60s"},
                   "probation": {"ramp_start_percent": 100, "ramp_step": "100ms", "clean": "1s"}},
        "clusters": [{"name": "llm", "nodes": [{"id": i, "address": f"127.0.0.{k + 1}:8000"}
                                               for k, i in enumerate(ids)]}]}))
    cut, late = [DialInAgent(i, port, REFRESH_MS) for i in ids[:NODES]], [DialInAgent(i, port, REFRESH_MS)
                                                                         for i in ids[NODES:]]
    try:
        await cp.start()
        for a in cut:
            a.dial()
        await wait_for(lambda: all(cp.core.health[i].state is NodeState.HEALTHY for i in ids[:NODES]),
                       timeout_s=15)
        await asyncio.gather(*(a.cut() for a in cut))
        drops = cp.counters.transport_drops
        await wait_for(lambda: drops["burst"] + drops["stall"] == NODES, timeout_s=3, what="the drops judged ours")
        for a in late:  # the fleet's first dials, still coming
            await asyncio.sleep(0.3)
            a.dial()
        await asyncio.sleep(0.3)
        for a in cut:
            a.dial()
        await wait_for(lambda: all(cp.sessions[i].connected for i in ids), timeout_s=5, what="every agent in")
        assert not {nid for nid, _ in cp.counters.ejections} & set(ids[:NODES]), dict(cp.counters.ejections)
        assert {i: cp.core.health[i].state for i in ids[:NODES]} == dict.fromkeys(ids[:NODES], NodeState.HEALTHY)
        assert 1 <= drops["returned"] <= NODES  # the cut agents' returns; first dials hold, uncounted there
    finally:
        for a in cut + late:
            await a.cut()
        await cp.stop()


class ThreadAgent:
    """A dial-in agent on threads of its own (gRPC's blocking API), so it talks while our event
    loop stands still: a Register, a good probe result, a heartbeat every REFRESH_MS."""

    def __init__(self, node_id: str, port: int) -> None:
        self.node_id = node_id
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self._stop = threading.Event()
        self._call: Any = None

    def _requests(self, stop: threading.Event) -> Iterator[probe_pb2.AgentMessage]:
        yield register(self.node_id)
        seq = 0
        while not stop.is_set():
            seq += 1
            yield heartbeat(self.node_id, seq)
            if seq == 1:
                yield probe_ok()
            stop.wait(REFRESH_MS / 1000.0)

    def dial(self) -> None:
        self._stop = threading.Event()
        self._call = probe_pb2_grpc.ProbeHubStub(self._channel).Connect(self._requests(self._stop),
                                                                        metadata=METADATA)
        threading.Thread(target=self._drain, args=(self._call,), daemon=True).start()

    @staticmethod
    def _drain(call: Any) -> None:
        with contextlib.suppress(grpc.RpcError):
            for _ in call:  # Hello, ProbeNow, pings: read, not answered
                pass

    def cut(self) -> None:
        """Cancel the stream: it ends under the server."""
        self._stop.set()
        if self._call is not None:
            self._call.cancel()

    def close(self) -> None:
        self.cut()
        self._channel.close()


async def test_a_stream_cut_just_after_our_loop_stood_still_is_ours_though_its_node_was_heard_after():
    """Our loop stands still 0.4 s (what a SIGSTOP looks like to it); the agent's heartbeats wait
    unread meanwhile and are read when we wake (the node is heard after our stall); its stream is
    cut 50 ms later. Within a hold after a stall of ours longer than the PING timeout, that drop is
    ours: the node is held, its agent dials again, nobody is ejected. (Before: a lone drop after
    the node was heard was its death, the whole miss threshold at once.)"""
    port = free_port()
    cp = ControlPlane(parse_config({
        "xds": {"listen": f"127.0.0.1:{port}"}, "admin": {"listen": "127.0.0.1:0"},
        "probe": {"transport": {"telemetry_refresh": f"{REFRESH_MS}ms"}},
        "health": {"rtt": {"ping_interval": "60s"},
                   "probation": {"ramp_start_percent": 100, "ramp_step": "100ms", "clean": "1s"}},
        "clusters": [{"name": "llm", "nodes": [{"id": "n0", "address": "127.0.0.1:8000"}]}]}))
    agent = ThreadAgent("n0", port)
    try:
        await cp.start()
        agent.dial()
        await wait_for(lambda: cp.core.health["n0"].state is NodeState.HEALTHY, timeout_s=15,
                       what=f"HEALTHY ({cp.core.health['n0'].state.name}: {cp.core.health['n0'].reason})")
        drops = cp.counters.transport_drops
        cutter = threading.Timer(0.45, agent.cut)
        cutter.start()
        time.sleep(0.4)  # our loop stands still
        heard = cp.counters.heartbeats["n0"]
        await wait_for(lambda: drops.total() >= 1, timeout_s=3, what="the cut read")
        assert cp.counters.heartbeats["n0"] > heard  # heard after the stall, then found cut
        assert dict(drops) == {"stall": 1}, dict(drops)
        agent.dial()  # the agent dials again, within the hold
        await wait_for(lambda: cp.sessions["n0"].connected, timeout_s=5, what="the agent back")
        await asyncio.sleep(1.5)  # past the hold
        assert cp.core.health["n0"].state is NodeState.HEALTHY
        assert cp.counters.ejections == {}
    finally:
        agent.close()
        await cp.stop()


async def test_a_stall_of_our_own_loop_stays_ours_when_a_stretch_of_ours_has_run_past_its_bound():
    """``burst_recovery`` bounds verdicts of ours that rest on each other (a stall noted for one),
    not the loop's own stalls: with the bound at 1 ms, a second stall of our loop 0.6 s after a
    first one's verdict (a stretch running, begun long past the bound) still makes its drop ours."""
    port = free_port()
    cp = ControlPlane(parse_config({
        "xds": {"listen": f"127.0.0.1:{port}"}, "admin": {"listen": "127.0.0.1:0"},
        "probe": {"transport": {"telemetry_refresh": f"{REFRESH_MS}ms"}, "dial_in": {"burst_recovery": "1ms"}},
        "health": {"rtt": {"ping_interval": "60s"},
                   "probation": {"ramp_start_percent": 100, "ramp_step": "100ms", "clean": "1s"}},
        "clusters": [{"name": "llm", "nodes": [{"id": i, "address": f"127.0.0.{k + 1}:8000"}
                                               for k, i in enumerate(("n0", "n1"))]}]}))
    agents = [ThreadAgent("n0", port), ThreadAgent("n1", port)]
    try:
        await cp.start()
        for a in agents:
            a.dial()
        await wait_for(lambda: all(cp.core.health[i].state is NodeState.HEALTHY for i in ("n0", "n1")),
                       timeout_s=15)
        drops = cp.counters.transport_drops
        for k, a in enumerate(agents):  # our loop stands still, the agent is cut just after we wake
            cutter = threading.Timer(0.45, a.cut)
            cutter.start()
            time.sleep(0.4)
            await wait_for(lambda k=k: drops.total() >= k + 1, timeout_s=3, what="the cut read")
            if k == 0:
                await asyncio.sleep(0.2)  # the second stall comes ~0.6 s after the first verdict
        assert dict(drops) == {"stall": 2}, dict(drops)
        for a in agents:
            a.dial()
        await wait_for(lambda: all(cp.sessions[i].connected for i in ("n0", "n1")), timeout_s=5, what="back")
        await asyncio.sleep(1.5)  # past the hold
        assert cp.counters.ejections == {}
    finally:
        for a in agents:
            a.close()
        await cp.stop()
