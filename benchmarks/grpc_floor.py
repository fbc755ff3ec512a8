"""What gRPC alone costs to receive heartbeats: a grpc.aio client with none of our code.

Usage: python benchmarks/grpc_floor.py [--streams N ...] [--seconds S] [--rounds R]
           [--cp-cpu C] [--fleet-cpu F]

The fake agent fleet of ``heartbeat_capacity.py`` (its own process, pinned to ``--fleet-cpu``)
sends every Watch stream a heartbeat each 100 ms with 8 GPU readings. Each variant below runs as
a fresh client process pinned to ``--cp-cpu``: N channels, one Watch stream each, every message
read with ``call.read()`` (parsed by the stub, as the control plane's are) and counted, nothing
else. After 5 s of settling it measures for S seconds: messages/s, the process CPU (user+sys)
in cores and per message (us), and how that CPU splits between the main thread (event loop,
grpc.aio's Python layer, parsing) and gRPC's own threads (``/proc/self/task``).

Variants, alternated in each of R rounds:

- ``asyncio``: the standard event loop, gRPC's defaults (``xds-server serve``'s default);
- ``uvloop``: uvloop's loop (``xds-server serve --loop uvloop``);
- ``asyncio, legacy I/O`` and ``uvloop, legacy I/O``: the same with
  ``GRPC_EXPERIMENTS=-event_engine_client`` (gRPC's older client transport: reads in the
  completion-queue thread, not in EventEngine threads). An experiment switch of gRPC that may go
  away in any release: measured here, not used by xds-server.

This is the floor of ``heartbeat_capacity.py --floor`` without our stream bookkeeping.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = (("asyncio", False), ("uvloop", False), ("asyncio", True), ("uvloop", True))


def _thread_ticks() -> tuple[int, int]:
    """(main thread, all other threads) CPU clock ticks of this process so far."""
    main = other = 0
    me = os.getpid()
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        if int(task.name) == me:
            main += ticks
        else:
            other += ticks
    return main, other


async def _read_streams(n: int, seconds: float, port: int) -> dict:
    import grpc

    from node_probe.proto import probe_pb2_grpc

    count = 0

    async def one() -> None:
        nonlocal count
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = probe_pb2_grpc.NodeProbeStub(ch).Watch()
            while (msg := await call.read()) is not grpc.aio.EOF:
                del msg
                count += 1

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    await asyncio.sleep(5.0)

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    c0, m0, t0, th0 = cpu(), count, time.monotonic(), _thread_ticks()
    await asyncio.sleep(seconds)
    c1, m1, t1, th1 = cpu(), count, time.monotonic(), _thread_ticks()
    for t in tasks:
        t.cancel()
    msgs, dt = m1 - m0, t1 - t0
    main, other = th1[0] - th0[0], th1[1] - th0[1]
    return {"streams": n, "per_s": msgs / dt, "cores": (c1 - c0) / dt, "us": (c1 - c0) / max(1, msgs) * 1e6,
            "main_share": main / max(1, main + other)}


def _child(n: int, seconds: float, loop: str, port: int, cpu: int | None) -> None:
    from xds_server.process import event_loop

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    print(json.dumps(event_loop.run(_read_streams(n, seconds, port), loop)), flush=True)


def _variant(n: int, seconds: float, loop: str, legacy: bool, port: int, cpu: int | None) -> dict:
    env = dict(os.environ)
    if legacy:
        env["GRPC_EXPERIMENTS"] = "-event_engine_client"
    else:
        env.pop("GRPC_EXPERIMENTS", None)
    out = subprocess.run([sys.executable, __file__, "--child", str(n), str(seconds), loop, str(port),
                          "" if cpu is None else str(cpu)], env=env, capture_output=True, text=True,
                         timeout=seconds + 120)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"variant {loop} legacy={legacy} failed: {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        n, seconds, loop, port, cpu = sys.argv[2:7]
        _child(int(n), float(seconds), loop, int(port), int(cpu) if cpu else None)
        return
    from heartbeat_capacity import FakeFleet  # this folder is on sys.path when run as a script

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[300, 1000], help="stream counts to measure")
    ap.add_argument("--seconds", type=float, default=10.0,
                    help="measured window per variant, after 5 s of settling (default 10)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of all variants per stream count (default 2)")
    ap.add_argument("--cp-cpu", type=int, default=None, help="pin each client process to this CPU")
    ap.add_argument("--fleet-cpu", type=int, default=None, help="pin the fake fleet to this CPU")
    a = ap.parse_args()
    try:
        import uvloop  # noqa: F401 - only: is it installed?
        variants = VARIANTS
    except ImportError:
        print("uvloop is not installed (pip install 'xds-sentinel[uvloop]'): asyncio variants only")
        variants = tuple(v for v in VARIANTS if v[0] == "asyncio")
    with FakeFleet(8, a.fleet_cpu) as fleet:
        for n in a.streams:
            for _ in range(a.rounds):
                for loop, legacy in variants:
                    r = _variant(n, a.seconds, loop, legacy, fleet.port, a.cp_cpu)
                    name = f"{loop}{', legacy I/O' if legacy else ''}"
                    print(f"{n:>5} streams, {name:<20}: {r['per_s']:>7.0f} messages/s, {r['cores']:.2f} cores, "
                          f"{r['us']:.0f} us per message (main thread {r['main_share'] * 100:.0f} %), "
                          f"load avg {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
