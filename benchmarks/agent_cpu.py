"""CPU cost of the node_probe agent per heartbeat.

Usage: python benchmarks/agent_cpu.py [--seconds 20] [--streams 1,4]

Starts the agent as its own process (``python -m node_probe.cli``, GPU telemetry off: no NVML
here) against a fake engine in this process that serves a real vLLM 0.32 ``/metrics`` page
(fixture 13, ~57 KB, idle: 0 running) and answers 1-token streaming completions; opens N Watch
streams like N control planes and reads everything they push. The agent's CPU time comes from
/proc/PID/stat (user + system) over the measured window, after a 2 s warm-up.

Two configurations per N:
  heartbeats-only   scrapes and probes pushed out to once an hour: the cost of heartbeats alone
  defaults          the agent's defaults: heartbeats every 100 ms, /metrics scraped and
                    stall-checked every 100 ms, idle micro-probes every 0.5 s
Prints CPU % of one core, CPU per heartbeat sent (all streams together) and, for the defaults,
the part that is scraping + probing (defaults minus heartbeats-only).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from node_probe.proto import probe_pb2, probe_pb2_grpc  # noqa: E402 - after the sys.path setup
from xds_server.testing import free_port, process_cpu_s  # noqa: E402 - after the sys.path setup

FIXTURE = ROOT / "tests" / "fixtures" / "vllm-0.32.0-cpu" / "13_metrics_during_load.raw"
TOKEN = (b'data: {"id":"cmpl-1","object":"text_completion","model":"m","choices":[{"index":0,'
         b'"text":"a","finish_reason":"length"}]}\n\ndata: [DONE]\n\n')


def metrics_page() -> str:
    text = FIXTURE.read_bytes().partition(b"\r\n\r\n")[2].decode()
    return re.sub(r"^(vllm:num_requests_running\{[^}]*\}) \S+", r"\1 0.0", text, flags=re.M)


async def start_engine() -> tuple[web.AppRunner, str, dict]:
    page = metrics_page()
    counts = {"metrics": 0, "probes": 0}

    async def metrics(request: web.Request) -> web.Response:
        counts["metrics"] += 1
        return web.Response(text=page, content_type="text/plain")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        counts["probes"] += 1
        await request.read()
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        await resp.write(TOKEN)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}", counts



async def measure(engine_url: str, counts: dict, streams: int, seconds: float, extra: list[str]) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "node_probe.cli", "--engine-url", engine_url,
           "--listen", f"127.0.0.1:{port}", "--node-id", "bench", "--gpu-interval-s", "0",
           "--log-level", "WARNING", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=ROOT)
    beats = 0
    results = 0
    channels = []
    tasks = []
    try:
        line = await asyncio.to_thread(proc.stdout.readline)
        assert b"listening" in line, line

        async def read(call) -> None:
            nonlocal beats, results
            async for msg in call:
                kind = msg.WhichOneof("msg")
                if kind == "heartbeat":
                    beats += 1
                elif kind == "inference_result":
                    results += 1

        for i in range(streams):
            ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            channels.append(ch)
            call = probe_pb2_grpc.NodeProbeStub(ch).Watch()
            await call.write(probe_pb2.ControlMessage(hello=probe_pb2.Hello(control_plane_id=f"cp-{i}")))
            tasks.append(asyncio.create_task(read(call)))
        await asyncio.sleep(2.0)  # warm-up: connections, model discovery, first probes
        c0, b0, r0, m0, p0, t0 = (process_cpu_s(proc.pid), beats, results, counts["metrics"], counts["probes"],
                                  time.monotonic())
        await asyncio.sleep(seconds)
        c1, b1, r1, m1, p1, t1 = (process_cpu_s(proc.pid), beats, results, counts["metrics"], counts["probes"],
                                  time.monotonic())
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in channels:
            await ch.close(grace=None)
        proc.terminate()
        proc.wait(timeout=10)
    wall = t1 - t0
    cpu = c1 - c0
    hb = b1 - b0
    return {"cpu_pct": 100 * cpu / wall, "cpu_s": cpu, "wall_s": wall, "heartbeats": hb,
            "us_per_hb": 1e6 * cpu / hb if hb else float("nan"), "hb_per_s": hb / wall,
            "scrapes_per_s": (m1 - m0) / wall, "probes_per_s": (p1 - p0) / wall,
            "results": r1 - r0}


async def main(seconds: float, stream_counts: list[int]) -> None:
    runner, url, counts = await start_engine()
    quiet = ["--metrics-interval-ms", "3600000", "--probe-interval-s", "3600",
             "--probe-idle-interval-s", "3600"]
    print(f"agent CPU, {seconds:.0f} s per run, engine /metrics page {len(metrics_page()) / 1024:.0f} KB, "
          f"{os.cpu_count()} CPUs")
    print(f"{'config':<16} {'streams':>7} {'hb/s':>6} {'scrapes/s':>9} {'probes/s':>8} "
          f"{'CPU %':>6} {'us/heartbeat':>12}")
    try:
        for n in stream_counts:
            base = await measure(url, counts, n, seconds, quiet)
            full = await measure(url, counts, n, seconds, [])
            for name, r in (("heartbeats-only", base), ("defaults", full)):
                print(f"{name:<16} {n:>7} {r['hb_per_s']:>6.1f} {r['scrapes_per_s']:>9.1f} "
                      f"{r['probes_per_s']:>8.2f} {r['cpu_pct']:>6.2f} {r['us_per_hb']:>12.0f}", flush=True)
            extra = (full["cpu_s"] / full["wall_s"] - base["cpu_s"] / base["wall_s"])
            per_scrape = extra / full["scrapes_per_s"] * 1e6 if full["scrapes_per_s"] else float("nan")
            print(f"  -> scraping + stall check + probing: {100 * extra:.2f} % of a core "
                  f"(~{per_scrape:.0f} us per scrape incl. its share of probes)", flush=True)
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--streams", default="1,4", help="comma-separated stream counts (default 1,4)")
    a = ap.parse_args()
    asyncio.run(main(a.seconds, [int(x) for x in a.streams.split(",")]))
