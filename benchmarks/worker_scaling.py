"""Probe workers: does the per-heartbeat cost stay flat from one worker to two (issue 12 item 2)?

Usage: python benchmarks/worker_scaling.py [--nodes N] [--seconds S] [--workers 0 1 2]

A separate process runs a fake node_probe agent fleet (grpc.aio: every Watch stream gets a
heartbeat every 100 ms and one good probe result; pings are not answered) on one port. This
process runs the real ControlPlane with N nodes dialling it and ``probe.workers`` = W. After a
warm-up it measures over S seconds, from /proc, the CPU (user+sys) of the main process and of
each worker process, the heartbeats the workers received (their reports' counts) and false
ejections (transitions to UNHEALTHY: nothing fails here), and per report frame the bytes on the
channel and the main process's CPU to apply it.

CPU time per heartbeat per process is the measure that survives a shared machine: "W workers
watch W times what one does" holds when the per-heartbeat CPU of a worker does not grow with W
and the main process's share stays small; nodes per core = 1e6 / (us per heartbeat x 10).
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import time

import grpc

from node_probe.proto import probe_pb2, probe_pb2_grpc
from xds_server.config import parse_config
from xds_server.server import ControlPlane
from xds_server.testing import free_port

_TICK = os.sysconf("SC_CLK_TCK")


class _FakeAgent(probe_pb2_grpc.NodeProbeServicer):
    async def Watch(self, request_iterator, context):  # noqa: N802
        loop = asyncio.get_running_loop()
        tel = probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY)
        nxt = loop.time()
        seq = 0
        yield probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=0, interval_ms=100, telemetry=tel))
        yield probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(seq=1, ok=True, ttft_ms=10.0))
        while True:
            seq += 1
            yield probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=seq, interval_ms=100, telemetry=tel))
            nxt += 0.1
            await asyncio.sleep(max(0.0, nxt - loop.time()))


def fake_fleet_main(port: int) -> None:
    """Serve the fake agent fleet on 127.0.0.1:``port`` until killed."""
    async def run() -> None:
        srv = grpc.aio.server()
        probe_pb2_grpc.add_NodeProbeServicer_to_server(_FakeAgent(), srv)
        srv.add_insecure_port(f"127.0.0.1:{port}")
        await srv.start()
        await srv.wait_for_termination()

    asyncio.run(run())


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (from /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


async def measure(n: int, workers: int, seconds: float) -> dict:
    port = free_port()
    fleet = multiprocessing.get_context("spawn").Process(target=fake_fleet_main, args=(port,), daemon=True)
    fleet.start()
    time.sleep(2.0)
    cfg = parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"ping_interval_ms": 60_000},
        "probe": {"workers": workers},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.{1 + i // 60000}:{1 + i % 60000}",
             "probe_address": f"127.0.0.1:{port}"} for i in range(n)]}],
    })
    cp = ControlPlane(cfg)
    await cp.start()
    try:
        await asyncio.sleep(6.0)  # connect, settle, first full reports
        pool = cp.probe_pool
        pids = [h.proc.pid for h in pool.handles] if pool else []
        hb0 = sum(cp.heartbeats.values())
        ev0 = cp.event_counts["to_UNHEALTHY"]
        rep0 = pool.reports if pool else 0
        main0, w0 = cpu_s(os.getpid()), [cpu_s(p) for p in pids]
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        main1, w1 = cpu_s(os.getpid()), [cpu_s(p) for p in pids]
        dt = time.monotonic() - t0
        hb = sum(cp.heartbeats.values()) - hb0
        routed = sum(1 for r in cp.routing.values() if r.health_status == "HEALTHY")
        return {
            "nodes": n, "workers": workers, "seconds": dt, "heartbeats_per_s": hb / dt,
            "expected_per_s": n * 10, "main_cores": (main1 - main0) / dt,
            "worker_cores": [(b - a) / dt for a, b in zip(w0, w1)],
            "reports_per_s": ((pool.reports - rep0) / dt) if pool else 0.0,
            "false_ejections": cp.event_counts["to_UNHEALTHY"] - ev0, "routed": routed,
            "restarts": pool.restarts if pool else 0,
        }
    finally:
        await cp.stop()
        fleet.kill()
        fleet.join()


def report(r: dict) -> str:
    hb = max(r["heartbeats_per_s"], 1.0)
    wc = r["worker_cores"]
    per_hb_w = [c * 1e6 / (hb / max(len(wc), 1)) for c in wc]
    main_us = r["main_cores"] * 1e6 / hb
    line = (f"{r['nodes']:>5} nodes, workers={r['workers']}: {r['heartbeats_per_s']:>6.0f}/{r['expected_per_s']} hb/s, "
            f"main {r['main_cores']:.2f} cores ({main_us:.1f} us/hb)")
    if wc:
        line += (", workers " + " + ".join(f"{c:.2f}" for c in wc) + " cores ("
                 + ", ".join(f"{u:.0f}" for u in per_hb_w) + " us/hb each), "
                 f"{r['reports_per_s']:.1f} reports/s")
    line += f", false ejections {r['false_ejections']}, routed {r['routed']}, restarts {r['restarts']}"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[300])
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--seconds", type=float, default=15.0)
    a = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    for n in a.nodes:
        for w in a.workers:
            print(report(asyncio.run(measure(n, w, a.seconds))), flush=True)
    print(f"load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
