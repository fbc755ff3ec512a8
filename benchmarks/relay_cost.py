"""Relay cost: CPU per 1,000 chunks/s and latency added per chunk (p50/p99), in one run.

Both paths against the same clock engine (benchmarks/relay_clock_engine.py, which stamps every
chunk with its send time): clients straight to the engine, then the same load through
``sentinel-relay`` (a real process, ``--workers 1``). Envoy is left out on purpose: it is the
same in both paths of a deployment, and this isolates what the relay adds.

    .venv/bin/python benchmarks/relay_cost.py [--streams 20] [--interval-ms 20] [--seconds 10]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from xds_server.testing import ManagedProcess, ProcCpu, free_port

T_RE = re.compile(rb'"t":(\d+)')
def cpu_s(pids: list[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pids`` so far (a process gone counts 0)."""
    got = [c for pid in pids if (c := ProcCpu.of(pid)) is not None]
    return sum(c.user_s for c in got), sum(c.system_s for c in got)


def group_pids(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid:
                    out.append(int(d))
            except OSError:
                pass
    return out


async def load(url: str, streams: int, tokens: int, seconds: float) -> dict:
    lat: list[int] = []
    chunks = 0
    stop_at = time.monotonic() + seconds
    body = {"prompt": "x", "max_tokens": tokens, "stream": True}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker() -> None:
            nonlocal chunks
            while time.monotonic() < stop_at:
                async with s.post(url + "/v1/completions", json=body) as r:
                    async for data in r.content.iter_any():
                        now = time.monotonic_ns()
                        for m in T_RE.finditer(data):
                            lat.append(now - int(m.group(1)))
                            chunks += 1
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(streams)))
        wall = time.monotonic() - t0
    lat.sort()
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] / 1e6  # noqa: E731 - a one-line helper
    return {"chunks": chunks, "wall_s": wall, "chunks_per_s": chunks / wall,
            "p50_ms": q(0.50), "p99_ms": q(0.99)}


async def run(args: argparse.Namespace) -> dict:
    wd = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    eng_port, relay_port = free_port(), free_port()
    engine = ManagedProcess("clock-engine", [sys.executable, str(Path(__file__).with_name("relay_clock_engine.py")),
                                             str(eng_port), str(args.interval_ms)],
                            wd / "relay-bench-engine.log", ready_pattern="listening").start()
    relay = None
    try:
        engine_url = f"http://127.0.0.1:{eng_port}"
        await load(engine_url, 2, 5, 0.5)  # warm-up
        direct = await load(engine_url, args.streams, args.tokens, args.seconds)
        relay = ManagedProcess("relay", [sys.executable, "-m", "sentinel_relay.cli", "--listen",
                                         f"127.0.0.1:{relay_port}", "--upstream", engine_url,
                                         "--admin-listen", f"127.0.0.1:{free_port()}",
                                         "--workers", "1", "--log-level", "WARNING",
                                         "--loop", args.loop],
                               wd / "relay-bench-relay.log", ready_pattern="ready on").start()
        relay_url = f"http://127.0.0.1:{relay_port}"
        await load(relay_url, 2, 5, 0.5)
        pids = group_pids(relay.pid)
        c0 = cpu_s(pids)
        via = await load(relay_url, args.streams, args.tokens, args.seconds)
        c1 = cpu_s(pids)
        user, system = c1[0] - c0[0], c1[1] - c0[1]
        cpu = user + system
    finally:
        if relay is not None:
            relay.stop()
        engine.stop()
    cores = cpu / via["wall_s"]
    return {
        "streams": args.streams, "interval_ms": args.interval_ms, "loop": args.loop,
        "direct": direct, "relay": via,
        "relay_cores": round(cores, 4),
        "relay_user_system_s": [round(user, 2), round(system, 2)],
        "relay_cores_per_1000_chunks_s": round(cores / (via["chunks_per_s"] / 1000), 4),
        "added_p50_ms": round(via["p50_ms"] - direct["p50_ms"], 3),
        "added_p99_ms": round(via["p99_ms"] - direct["p99_ms"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=20)
    ap.add_argument("--interval-ms", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto")
    res = asyncio.run(run(ap.parse_args()))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
