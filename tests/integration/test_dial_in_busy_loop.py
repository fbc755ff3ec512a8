"""A control plane busy on its own event loop (a long collection, a publish of thousands of
endpoints; here a spin holding the GIL) does not stop gRPC's threads from answering the agents'
PINGs: no live agent's stream is cut, and a stream cut meanwhile, an agent frozen, is the node's,
judged once the loop is free, not held as a stall of ours. Only a loop whose thread did not run
at all (a stopped or starved process) makes such a cut ours. Real agent processes, the real
control plane and its server-side keepalive, simulated engines in processes of their own (an
engine on the test's loop would be busy too: its probes slow, its node DEGRADED)."""
from __future__ import annotations

import asyncio
import sys
import time

from xds_server.config import parse_config
from xds_server.health.records import EjectionCause, NodeState
from xds_server.server import ControlPlane
from xds_server.testing import ManagedProcess, free_port, wait_for

KEEPALIVE_S, PING_TIMEOUT_S = 0.1, 0.2
BUSY_S = 0.5  # past a PING's whole span (keepalive + ping_timeout)


def _busy(seconds: float) -> float:
    """Spin ``seconds`` on this thread holding the GIL (no other Python thread runs meanwhile);
    returns the wall time of it that the thread did not run (s: other processes' share of the CPU)."""
    wall, cpu, interval = time.perf_counter(), time.thread_time(), sys.getswitchinterval()
    sys.setswitchinterval(seconds * 2)
    try:
        while time.perf_counter() - wall < seconds:
            pass
    finally:
        sys.setswitchinterval(interval)
    return (time.perf_counter() - wall) - (time.thread_time() - cpu)


async def test_a_busy_loop_cuts_no_live_agent_and_a_drop_during_it_is_the_nodes(tmp_path):
    ids = ("gpu-a", "gpu-b")
    ports = {nid: free_port() for nid in ids}
    xds_port = free_port()
    engines = [ManagedProcess(f"engine-{nid}", [
        sys.executable, "-m", "node_probe.cli", "sim-engine", "--port", str(ports[nid]), "--replica-id", nid,
        "--token-interval-ms", "5"], tmp_path / f"engine-{nid}.log", ready_pattern="listening") for nid in ids]
    cp = ControlPlane(parse_config({
        "xds": {"listen": f"127.0.0.1:{xds_port}"}, "admin": {"listen": "127.0.0.1:0"},
        "probe": {"dial_in": {"keepalive": f"{KEEPALIVE_S * 1000:g}ms",
                              "ping_timeout": f"{PING_TIMEOUT_S * 1000:g}ms"}},
        "health": {"probation": {"ramp_start_percent": 100, "clean": "200ms"}},
        "clusters": [{"name": "llm", "nodes": [{"id": nid, "address": f"127.0.0.1:{ports[nid]}"} for nid in ids]}]}))
    agents = {nid: ManagedProcess(f"agent-{nid}", [
        sys.executable, "-m", "node_probe.cli", "--engine-url", f"http://127.0.0.1:{ports[nid]}",
        "--control-plane", f"127.0.0.1:{xds_port}", "--node-id", nid, "--probe-interval-s", "0.3"],
        tmp_path / f"{nid}.log", ready_pattern="dialling") for nid in ids}
    try:
        for e in engines:
            await asyncio.to_thread(e.start)
        await cp.start()
        for a in agents.values():
            await asyncio.to_thread(a.start)  # (off the loop: a blocked loop is a stall of ours)
        state = lambda nid: cp.core.health[nid].state  # noqa: E731 - a one-line reader
        await wait_for(lambda: all(state(n) is NodeState.HEALTHY for n in ids), 20, what="both HEALTHY")

        def moves(since: float) -> list[tuple[str, str, str, str]]:
            return [(e.node_id, e.from_state or "", e.to_state or "", e.reason) for e in cp.core.events
                    if e.kind == "transition" and e.wall_time_s >= since]

        # the loop busy past a PING's span: every PING still answered and read by gRPC's threads
        t0 = time.time()
        _busy(BUSY_S)
        await asyncio.sleep(3 * (KEEPALIVE_S + PING_TIMEOUT_S))
        assert sum(cp.counters.transport_drops.values()) == 0, dict(cp.counters.transport_drops)
        assert moves(t0) == [], moves(t0)

        # gpu-a frozen, then the loop busy while its PING deadline runs out: the node's drop, judged
        # when the loop is free (unless this thread was itself kept off the CPU that long)
        t1 = time.time()
        agents["gpu-a"].freeze()
        try:
            off_cpu = _busy(BUSY_S)
            freed = time.monotonic()
            await wait_for(lambda: state("gpu-a") is NodeState.UNHEALTHY, 5, what="gpu-a out")
            judged_s = time.monotonic() - freed
            drops = dict(cp.counters.transport_drops)
        finally:
            agents["gpu-a"].thaw()
        # the watch's reading of a stop is a lower bound, short by at most the CPU used in the
        # sampler's period before it: between the two, either verdict is right
        if off_cpu < PING_TIMEOUT_S:  # the thread ran: the busy loop is no stall of ours
            assert drops == {"node": 1}, (drops, off_cpu)
            # read after the busy loop, the stream's end may already be past the count rule: proven at once
            cause = cp.core.health["gpu-a"].ejection.cause
            assert cause in (EjectionCause.TRANSPORT, EjectionCause.HEARTBEAT), cp.core.health["gpu-a"]
            assert judged_s < cp.config.probe.stalls.stall_hold.s / 2, (judged_s, drops)
        elif off_cpu >= PING_TIMEOUT_S + cp.config.probe.stalls.loop_watch_interval.s:  # starved: ours
            assert drops == {"stall": 1}, (drops, off_cpu)
        else:
            assert sum(drops.values()) == 1 and set(drops) <= {"stall", "node"}, (drops, off_cpu)
        assert [m for m in moves(t1) if m[0] == "gpu-b"] == [], moves(t1)
        assert state("gpu-b") is NodeState.HEALTHY
    finally:
        for a in agents.values():
            a.stop()
        await cp.stop()
        for e in engines:
            e.stop()
