"""Probe workers: does the per-heartbeat cost stay flat from one worker to two (issue 12 item 2)?

Usage: python benchmarks/worker_scaling.py [--per-worker N] [--workers 0 1 2] [--repeat R] [--seconds S]
           [--loop asyncio|uvloop]

A separate process runs the fake node_probe agent fleet of benchmarks/heartbeat_capacity.py
(every Watch stream gets a heartbeat every 100 ms; pings are not answered) on one port. This
process runs the real ControlPlane with N nodes dialling it and ``probe.workers`` = W. After a
warm-up it measures over S seconds, from /proc, the CPU (user+sys) of the main process and of
each worker process, the heartbeats the workers received (their reports' counts) and false
ejections (transitions to UNHEALTHY: nothing fails here), and per report frame the bytes on the
channel and the main process's CPU to apply it.

Weak scaling: W workers watch W x N nodes (N per worker; W = 0, in-process, watches N), so each
worker process sees the same heartbeat rate in every run (grpc.aio's cost per message falls as
more arrive per event-loop turn, so equal rates per process are the fair comparison). Runs
alternate between settings ``--repeat`` times and the median is reported.

CPU time per heartbeat per process is the measure that survives a shared machine: "W workers
watch W times what one does" holds when the per-heartbeat CPU of a worker does not grow with W
and the main process's share stays small; nodes per core = 1e6 / (us per heartbeat x 10).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import math
import multiprocessing
import os
import pickle
import socket
import statistics
import time
from collections.abc import Callable

from xds_server.config import parse_config
from xds_server.process import event_loop
from xds_server.server import ControlPlane
from xds_server.testing import free_port, process_cpu_s


def _start_fleet() -> tuple[int, Callable[[], None]]:
    """Start the fake agent fleet of benchmarks/heartbeat_capacity.py in its own process: its
    ``FakeFleet`` when it has one, else its ``_agent_main``. Returns (port, stop)."""
    try:
        from heartbeat_capacity import FakeFleet
    except ImportError:
        from heartbeat_capacity import _agent_main

        port = free_port()
        # spawn, not fork: a forked child of a process that already ran gRPC hangs
        proc = multiprocessing.get_context("spawn").Process(target=_agent_main, args=(port,), daemon=True)
        proc.start()
        _wait_listening(port, 30.0)
        return port, lambda: (proc.kill(), proc.join())
    fleet = FakeFleet().start()
    return fleet.port, fleet.stop


def _wait_listening(port: int, timeout_s: float) -> None:
    """Until 127.0.0.1:``port`` accepts a TCP connection; RuntimeError after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"fake agent fleet not listening on {port} after {timeout_s} s")


async def measure(n: int, workers: int, seconds: float) -> dict:
    port, stop_fleet = _start_fleet()
    cfg = parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        # nodes go HEALTHY at the first ramp step: the steady state is measured, not 100 s of ramping
        "health": {"ping_interval_ms": 60_000, "ramp_start_percent": 100.0, "ramp_step_s": 1.0},
        "probe": {"workers": workers},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.{1 + i // 60000}:{1 + i % 60000}",
             "probe_address": f"127.0.0.1:{port}"} for i in range(n)]}],
    })
    cp = ControlPlane(cfg)
    await cp.start()
    try:
        # settle: every stream connected (worker start-up takes seconds on a loaded host), then
        # 4 s more for first reports, ramps and the phi estimates
        end = time.monotonic() + 60.0
        while time.monotonic() < end and not all(s.connected for s in cp.sessions.values()):
            await asyncio.sleep(0.2)
        await asyncio.sleep(4.0)
        pool = cp.probe_pool
        pids = [h.proc.pid for h in pool.handles] if pool else []
        hb0 = sum(cp.heartbeats.values())
        ev0 = cp.event_counts["to_UNHEALTHY"]
        rep0 = pool.reports if pool else 0
        main0, w0 = process_cpu_s(os.getpid()), [process_cpu_s(p) for p in pids]
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        main1, w1 = process_cpu_s(os.getpid()), [process_cpu_s(p) for p in pids]
        dt = time.monotonic() - t0
        hb = sum(cp.heartbeats.values()) - hb0
        routed = sum(1 for r in cp.routing.values() if r.health_status == "HEALTHY")
        states = collections.Counter(nh.state.value for nh in cp.health.values())
        return {
            "nodes": n, "workers": workers, "seconds": dt, "heartbeats_per_s": hb / dt,
            "expected_per_s": n * 10, "main_cores": (main1 - main0) / dt,
            "worker_cores": [(b - a) / dt for a, b in zip(w0, w1, strict=True)],
            "reports_per_s": ((pool.reports - rep0) / dt) if pool else 0.0,
            "false_ejections": cp.event_counts["to_UNHEALTHY"] - ev0, "routed": routed,
            "restarts": pool.restarts if pool else 0, "states": dict(states),
            "fail_static": cp.core.fail_static.active,
        }
    finally:
        await cp.stop()
        stop_fleet()


def channel_cost(nodes: int = 100, rounds: int = 200) -> dict:
    """Bytes and CPU of one report frame of ``nodes`` changed nodes (a routed node's health after
    40 heartbeats, a ping and a probe, with one transition): encode in the worker, decode in main."""
    from xds_server.config import HealthConfig
    from xds_server.health import model as hm
    from xds_server.probing.workers import Detector
    from xds_server.probing.workers._channel import encode

    d = Detector(HealthConfig())
    for i in range(nodes):
        d.add(f"n{i}", None, None, 0.0, 3.0)
        for k in range(40):
            d.observe(f"n{i}", hm.HeartbeatObserved(requests_running=2.0, requests_waiting=0.0,
                                                    gpu_free_ratio=0.4), k * 0.1)
        d.observe(f"n{i}", hm.PingObserved(1.2), 4.0)
        d.observe(f"n{i}", hm.ProbeObserved(hm.ProbeResultKind.OK, ttft_ms=25.0), 4.0)
    reports = d.take(True)
    msg = ("report", reports, {f"n{i}": 10 for i in range(nodes)}, {}, {}, {}, nodes)
    frame = encode(msg)
    t0 = time.process_time()
    for _ in range(rounds):
        encode(msg)
    t1 = time.process_time()
    for _ in range(rounds):
        pickle.loads(frame[4:])
    t2 = time.process_time()
    return {"nodes": nodes, "bytes": len(frame), "encode_us": (t1 - t0) / rounds / nodes * 1e6,
            "decode_us": (t2 - t1) / rounds / nodes * 1e6}


def per_heartbeat(r: dict) -> tuple[float, float]:
    """(main process us per heartbeat, mean worker process us per heartbeat it received)."""
    hb = max(r["heartbeats_per_s"], 1.0)
    wc = r["worker_cores"]
    worker = (sum(wc) / len(wc)) * 1e6 / (hb / len(wc)) if wc else 0.0
    return r["main_cores"] * 1e6 / hb, worker


def report(r: dict) -> str:
    main_us, worker_us = per_heartbeat(r)
    line = (f"{r['nodes']:>5} nodes, workers={r['workers']}: {r['heartbeats_per_s']:>6.0f}/{r['expected_per_s']} hb/s, "
            f"main {r['main_cores']:.2f} cores ({main_us:.1f} us/hb)")
    if r["worker_cores"]:
        line += (", workers " + " + ".join(f"{c:.2f}" for c in r["worker_cores"]) + f" cores ({worker_us:.0f} us/hb "
                 f"each), {r['reports_per_s']:.1f} reports/s")
    line += (f", false ejections {r['false_ejections']}, routed {r['routed']} {r['states']}"
             f"{' (fail-static)' if r['fail_static'] else ''}, restarts {r['restarts']}")
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-worker", type=int, default=150, help="nodes per worker process (W=0: in all)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--loop", choices=event_loop.LOOPS, default="asyncio",
                    help="the control plane's event loop; its probe workers run the same (serve --loop)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    print(f"load average at start: {os.getloadavg()}, {os.cpu_count()} CPUs", flush=True)
    c = channel_cost()
    print(f"channel: a report of {c['nodes']} changed nodes is {c['bytes']:,} bytes "
          f"({c['bytes'] / c['nodes']:.0f} per node); pickle encode {c['encode_us']:.1f} us, "
          f"decode {c['decode_us']:.1f} us per node", flush=True)
    runs: dict[int, list[dict]] = {w: [] for w in a.workers}  # valid runs only
    for _ in range(a.repeat):
        for w in a.workers:
            r = event_loop.run(measure(a.per_worker * max(w, 1), w, a.seconds), a.loop)
            valid = r["heartbeats_per_s"] >= 0.8 * r["expected_per_s"]
            if valid:
                runs[w].append(r)
            print(report(r) + ("" if valid else "  [not counted: under 80 % of the heartbeats arrived]"),
                  flush=True)
    print(f"load average at end: {os.getloadavg()}", flush=True)
    runs = {w: rs for w, rs in runs.items() if rs}
    # best of the runs (least disturbed by the other tenants of the machine, as timeit does) and median
    best = {w: (min(per_heartbeat(r)[0] for r in rs), min(per_heartbeat(r)[1] for r in rs)) for w, rs in runs.items()}
    med = {w: (statistics.median(per_heartbeat(r)[0] for r in rs), statistics.median(per_heartbeat(r)[1] for r in rs))
           for w, rs in runs.items()}
    for w in runs:
        print(f"workers={w}: main {best[w][0]:.1f} us/hb best, {med[w][0]:.1f} median"
              + (f"; worker {best[w][1]:.0f} us/hb best, {med[w][1]:.0f} median" if w else " (in-process)"))
    if 1 in best and 2 in best:
        for name, m in (("best", best), ("median", med)):
            one, two = m[1][1], m[2][1]
            print(f"{name}: two workers watch {2 * one / two:.2f} x what one does "
                  f"(per-worker cost {one:.0f} -> {two:.0f} us/hb)")
        two, main_us = best[2][1], best[2][0]
        for fleet in (2_000, 10_000):
            hbs = fleet * 10
            print(f"{fleet:>6} nodes at 100 ms (best figures): {hbs * two / 1e6:.2f} worker cores "
                  f"({math.ceil(hbs * two / 1e6 / 0.7)} workers at 70 % each) + main {hbs * main_us / 1e6:.2f} cores")


if __name__ == "__main__":
    main()
