"""A ping's round trip across our own stall is no RTT sample (the fault matrix's SIGSTOP finding).

The control plane, stopped 5 s, woke to a pong that had waited unread in its socket and measured
a 5,000 ms RTT; the EWMA (alpha 0.2) read ~1,011 ms against a cluster median of 10 ms and a healthy
node was ejected as an RTT outlier for 30 s. Real gRPC: the control plane's probe session against a
scripted agent that runs on its own thread and event loop, so it answers while the control
plane's loop is blocked (here: ``time.sleep`` on the loop, what a SIGSTOP looks like to it)."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator

import pytest
from scripted_agent import ScriptedAgent

from xds_server.config import parse_config
from xds_server.server import ControlPlane
from xds_server.testing import wait_for


class AgentThread:
    """A ScriptedAgent served by its own event loop on a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.agent: ScriptedAgent = asyncio.run_coroutine_threadsafe(ScriptedAgent.start(), self.loop).result(10)

    def pings(self) -> int:
        return sum(1 for m in list(self.agent.received) if m.HasField("ping"))

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.agent.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def agent_thread() -> Iterator[AgentThread]:
    a = AgentThread()
    try:
        yield a
    finally:
        a.close()


async def test_a_pong_that_waited_through_our_stall_gives_no_rtt_sample(agent_thread):
    agent = agent_thread.agent
    cp = ControlPlane(parse_config({
        "xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0"},
        "health": {"ping_interval_ms": 200}, "probe": {"workers": 0},
        "clusters": [{"name": "llm", "nodes": [
            {"id": "a", "address": "127.0.0.1:8001", "probe_address": f"127.0.0.1:{agent.port}"}]}],
    }))
    await cp.start()
    try:
        await wait_for(lambda: cp.health["a"].rtt.last_ms is not None, timeout_s=10, what="a first RTT sample")
        # No heartbeat may come between the ping and its pong, so the pong is the first message
        # read after we wake (a heartbeat after a gap already drops the pings outstanding).
        agent.heartbeats = False
        # The pong leaves 0.3 s after its ping reached the agent: we are stalled by then, however
        # late this poll sees the ping (else a loaded machine reads the pong before the stall).
        agent.pong_delay_s = 0.3
        n = agent_thread.pings()
        await wait_for(lambda: agent_thread.pings() > n, timeout_s=5, step_s=0.001, what="a ping")
        time.sleep(1.5)  # our loop runs nothing: the agent's pong waits unread
        await asyncio.sleep(0.2)  # read it
        rtt = cp.health["a"].rtt
        # one 1,500 ms sample would lift the EWMA (alpha 0.2) by ~300 ms; LAN round trips are ~1 ms
        assert rtt.ewma_ms is not None and rtt.ewma_ms < 50, rtt
        assert cp.counters.rtt_not_taken["ours"] >= 1
        # and a round trip with no stall in it is still a sample
        before = rtt.last_ms
        agent.heartbeats, agent.pong_delay_s = True, 0.0
        await wait_for(lambda: cp.health["a"].rtt.last_ms != before, timeout_s=5, what="a new RTT sample")
    finally:
        await cp.stop()


async def test_pongs_read_behind_a_queue_of_our_own_give_no_rtt_sample(agent_thread):
    """Our loop never stops but runs every callback up to 45 ms late (no stall: the loop watch records
    those from 50 ms): a round trip read meanwhile that the loop watch saw wait on our queue is
    not a sample (``health.rtt.self_lag_max``, 20 ms), a ping due while the loop has just run that
    late is not sent, and what slips between the watch's runs leaves the EWMA low; once the queue
    is gone, samples are taken again."""
    agent = agent_thread.agent
    cp = ControlPlane(parse_config({
        "xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0"},
        "health": {"rtt": {"ping_interval": "100ms"}}, "probe": {"workers": 0},
        "clusters": [{"name": "llm", "nodes": [
            {"id": "a", "address": "127.0.0.1:8001", "probe_address": f"127.0.0.1:{agent.port}"}]}],
    }))
    await cp.start()
    try:
        await wait_for(lambda: cp.health["a"].rtt.samples >= 2, timeout_s=10, what="RTT samples")
        before, samples, pings = cp.counters.rtt_not_taken.copy(), cp.health["a"].rtt.samples, agent_thread.pings()
        loop = asyncio.get_running_loop()
        end = loop.time() + 1.5

        rng = random.Random(3)

        def busy() -> None:  # 25-45 ms of work, 1-10 ms free, again: a queue, never a stall
            time.sleep(rng.uniform(0.025, 0.045))
            if loop.time() < end:
                loop.call_later(rng.uniform(0.001, 0.01), busy)

        loop.call_soon(busy)
        await asyncio.sleep(1.6)
        not_taken = cp.counters.rtt_not_taken - before
        sent = agent_thread.pings() - pings
        rtt = cp.health["a"].rtt
        # the queue was seen: pings due while the loop ran late not sent, round trips refused
        assert not_taken["late"] + not_taken["ours"] >= 5, (not_taken, rtt)
        # a ping whose round trip is already known to time our queue is not sent at all
        assert not_taken["late"] >= 3 and sent <= 20 - not_taken["late"], (not_taken, sent)
        # Round trips taken meanwhile were read between busy callbacks, or waited on one that the
        # loop watch (every 50 ms) never found running late: up to ~45 ms, counted as at most
        # rtt.spike_factor x the EWMA. The EWMA stays far under an outlier's 3 x median + 50 ms
        # (measured: 0.9-8.4 ms over 12 runs, ~2 ms before the queue).
        assert rtt.ewma_ms is not None and rtt.ewma_ms < 20, (rtt, not_taken, rtt.samples - samples)
        after = cp.health["a"].rtt.samples
        await wait_for(lambda: cp.health["a"].rtt.samples >= after + 3, timeout_s=10, what="samples again")
    finally:
        await cp.stop()
