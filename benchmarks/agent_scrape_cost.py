"""What the agent's /metrics scraping costs the engine's API server.

Usage: python benchmarks/agent_scrape_cost.py --url http://127.0.0.1:8000 --pid API_SERVER_PID
       [--seconds 20] [--hz 0,10,4]

For each rate, GETs URL/metrics at that rate for the given time and prints the CPU the engine
process used meanwhile (user + system from /proc/PID/stat; 0 Hz is the baseline). Run it against
an idle engine (e.g. scripts/real_vllm/start.sh) with nothing else talking to it.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp

from xds_server.testing import process_cpu_s


async def run(url: str, pid: int, hz: float, seconds: float) -> tuple[float, int]:
    async with aiohttp.ClientSession() as s:
        c0, t0, n = process_cpu_s(pid), time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            if hz:
                async with s.get(url.rstrip("/") + "/metrics") as r:
                    await r.read()
                n += 1
                await asyncio.sleep(max(0.0, t0 + n / hz - time.monotonic()))
            else:
                await asyncio.sleep(0.5)
        return 100 * (process_cpu_s(pid) - c0) / (time.monotonic() - t0), n


async def main(url: str, pid: int, seconds: float, rates: list[float]) -> None:
    for hz in rates:
        pct, n = await run(url, pid, hz, seconds)
        print(f"/metrics at {hz:>4g} Hz: engine process CPU {pct:.2f} % of a core ({n} scrapes)", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--hz", default="0,10,4")
    a = ap.parse_args()
    asyncio.run(main(a.url, a.pid, a.seconds, [float(x) for x in a.hz.split(",")]))
