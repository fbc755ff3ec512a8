"""Noise never ejects: a node failing 1 % of its real requests, at several volumes, through one or
three real Envoys, with the default ``lrs.traffic_ejection`` (the counts' significance test).

A fleet of 3 simulated engines and agents, its Envoy and ``--envoys - 1`` more; gpu-c answers 1 %
of user requests 500 (sim fault ``user_error``, rate 0.01) while its probes pass. Poisson arrivals
at each rate of ``--rates`` (requests/s over the whole cluster, split over the Envoys) for
``--seconds``; counted: gpu-c's ejections for real traffic and the user requests it served.

    .venv/bin/python benchmarks/lrs_noise.py [--envoys 1] [--rates 3,30,150] [--seconds 60]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from overload_rig import OpenLoop  # noqa: E402  # after the path insert above

from xds_server.testing import Fleet, StandaloneEnvoy  # noqa: E402  # after the path insert above

FAST = {"probation_clean_s": 1.0, "ramp_step_percent": 25, "ramp_step_s": 0.25}


async def _ejections(http: aiohttp.ClientSession, fleet: Fleet, node: str) -> int:
    async with http.get(f"http://127.0.0.1:{fleet.admin_port}/events", params={"limit": "10000"}) as r:
        events = (await r.json())["events"]
    return sum(1 for e in events if e["node"] == node and e.get("to") == "UNHEALTHY"
               and e["reason"].startswith("real traffic"))


async def _served(http: aiohttp.ClientSession, url: str) -> int:
    """User requests the engine has served (probes and replays carry the probe header)."""
    async with http.get(f"{url}/sim/stats") as r:
        return (await r.json())["requests_by_kind"]["user"]


async def run(a: argparse.Namespace) -> None:
    fleet = Fleet(n_nodes=3, health=FAST)
    fleet.start()
    extra = [StandaloneEnvoy(fleet.xds_port, node_id=f"envoy-{i}") for i in range(2, a.envoys + 1)]
    try:
        for e in extra:
            await e.start()
        async with aiohttp.ClientSession() as http:
            await fleet.wait_all_routed(http)
            await asyncio.sleep(3.0)
            bad = fleet.node("gpu-c")
            async with http.post(f"{bad.engine_url}/sim/fault", json={"mode": "user_error", "rate": 0.01}) as r:
                r.raise_for_status()
            urls = [fleet.url, *(e.url for e in extra)]
            print(f"{a.envoys} Envoy(s), gpu-c failing 1 % of user requests, {a.seconds:g} s per rate")
            print(f"{'cluster rps':>11} {'per node':>8} {'gpu-c served':>12} {'ejections':>9}")
            for rate in (float(x) for x in a.rates.split(",")):
                before_ej = await _ejections(http, fleet, "gpu-c")
                before_served = await _served(http, bad.engine_url)
                stop = asyncio.Event()
                loads = [OpenLoop(u, rate / len(urls), max_tokens=2, timeout_s=10.0, seed=i + 1)
                         for i, u in enumerate(urls)]
                tasks = [asyncio.create_task(load.run(stop)) for load in loads]
                await asyncio.sleep(a.seconds)
                stop.set()
                await asyncio.gather(*tasks)
                served = await _served(http, bad.engine_url)
                ej = await _ejections(http, fleet, "gpu-c") - before_ej
                print(f"{rate:>11g} {rate / 3:>8.1f} {served - before_served:>12} {ej:>9}")
    finally:
        for e in extra:
            e.stop()
        fleet.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envoys", type=int, default=1, help="real Envoys sending the load (default 1)")
    ap.add_argument("--rates", default="3,30,150", help="cluster requests/s, comma-separated (default 3,30,150)")
    ap.add_argument("--seconds", type=float, default=60.0, help="per rate (default 60)")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
