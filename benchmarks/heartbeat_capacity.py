"""How many nodes can one control-plane process watch at 100 ms heartbeats?

Usage: python benchmarks/heartbeat_capacity.py [--nodes N ...] [--seconds S]

A separate process runs one fake node_probe agent (grpc.aio) that serves every Watch stream
with a heartbeat every 100 ms (no probes, no pings answered). This process runs the real
ControlPlane with N nodes, all dialing that agent. After a warm-up it measures, over S seconds:
the control plane's CPU (user+sys of this process, which also holds nothing else), heartbeats
received vs sent, and false ejections (transitions to UNHEALTHY: nothing fails here).
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import time

import grpc

from node_probe.proto import probe_pb2, probe_pb2_grpc
from xds_server.config import parse_config
from xds_server.server import ControlPlane
from xds_server.testing import free_port


class _Agent(probe_pb2_grpc.NodeProbeServicer):
    async def Watch(self, request_iterator, context):  # noqa: N802
        loop = asyncio.get_running_loop()
        tel = probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY)
        nxt = loop.time()
        seq = 0
        yield probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=0, interval_ms=100, telemetry=tel))
        # one good probe result so the node is routed (PROBATION) and can be (falsely) ejected
        yield probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(seq=1, ok=True, ttft_ms=10.0))
        while True:
            seq += 1
            yield probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=seq, interval_ms=100, telemetry=tel))
            nxt += 0.1
            await asyncio.sleep(max(0.0, nxt - loop.time()))


def _agent_main(port: int) -> None:
    async def run() -> None:
        srv = grpc.aio.server()
        probe_pb2_grpc.add_NodeProbeServicer_to_server(_Agent(), srv)
        srv.add_insecure_port(f"127.0.0.1:{port}")
        await srv.start()
        await srv.wait_for_termination()

    asyncio.run(run())


async def measure(n: int, seconds: float) -> dict:
    port = free_port()
    # spawn, not fork: a forked child of a process that already ran gRPC hangs
    agent = multiprocessing.get_context("spawn").Process(target=_agent_main, args=(port,), daemon=True)
    agent.start()
    time.sleep(2.0)
    cfg = parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"ping_interval_ms": 60_000},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.{1 + i // 60000}:{1 + i % 60000}",
             "probe_address": f"127.0.0.1:{port}"} for i in range(n)]}],
    })
    cp = ControlPlane(cfg)
    await cp.start()
    try:
        await asyncio.sleep(5.0)  # connect and settle
        hb0 = sum(cp.heartbeats.values())
        ev0 = cp.event_counts["to_UNHEALTHY"]
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        dt = time.monotonic() - t0
        hb = sum(cp.heartbeats.values()) - hb0
        false = cp.event_counts["to_UNHEALTHY"] - ev0
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        return {"nodes": n, "heartbeats_per_s": hb / dt, "expected_per_s": n * 10,
                "cpu_cores": cpu / dt, "cpu_us_per_heartbeat": cpu / max(hb, 1) * 1e6,
                "false_ejections": false, "connected": sum(1 for s in cp.sessions.values() if s.connected),
                "routed": sum(1 for nh in cp.health.values() if nh.state.value in ("PROBATION", "HEALTHY"))}
    finally:
        await cp.stop()
        agent.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[100, 250, 500, 1000])
    ap.add_argument("--seconds", type=float, default=20.0)
    a = ap.parse_args()
    for n in a.nodes:
        r = asyncio.run(measure(n, a.seconds))
        print(f"{r['nodes']:>5} nodes: {r['heartbeats_per_s']:>7.0f} heartbeats/s received of "
              f"{r['expected_per_s']} sent, control plane CPU {r['cpu_cores']:.2f} cores "
              f"({r['cpu_us_per_heartbeat']:.0f} us per heartbeat), connected {r['connected']}, routed at the end {r['routed']}, "
              f"false ejections {r['false_ejections']}", flush=True)


if __name__ == "__main__":
    main()
