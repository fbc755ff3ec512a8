"""The shift's latency gate on equal engines while the machine is busy: how many windows fail on
latency, with the noise floor (the source nodes' own spread) and, recomputed from the same
windows, without it.

A fleet of 4 equal simulated engines (priorities 0, 0, 1, 1) behind the real Envoy, a closed-loop
load, ``--burners`` busy-looping processes beside them; a gated shift to priority 1 with the seed's
latency gate (+15 %) and error gates loosened so short windows decide (20 requests, z 1, 5 %),
``--step`` % every ``--every`` s, for ``--windows`` decisions (resumed after a pause or rollback).
Per window: the target's probe TTFT over the source's (``latency_increase``), the source nodes'
own spread (``latency_noise``), the gate's verdict.

    .venv/bin/python benchmarks/shift_latency_noise.py [--windows 20] [--every 2] [--burners 2]
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import tempfile
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from xds_server.testing import Fleet, LoadGenerator

TOKEN = "bench-token"


def _burn() -> None:
    while True:
        pass


async def run(a: argparse.Namespace) -> None:
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(a.burners)]
    with tempfile.TemporaryDirectory() as d:
        fleet = Fleet(n_nodes=4, node_options=[{"priority": p} for p in (0, 0, 1, 1)],
                      probe_interval_s=0.3, health={"ramp_start_percent": 100.0},
                      cluster_options={"outlier_detection": {"enabled": False}},
                      admin_options={"token": TOKEN},
                      config_options={"shift": {"min_requests": 20, "wilson_z": 1.0, "max_error_ratio": 0.05,
                                                "state_path": f"{d}/s.json"},
                                      "lrs": {"interval_s": 0.5, "traffic_ejection": {"enabled": False}}})
        fleet.start()
        load = LoadGenerator(fleet.url, concurrency=a.concurrency, max_tokens=2)
        try:
            for b in burners:
                b.start()
            async with aiohttp.ClientSession() as http:
                await fleet.wait_all_routed(http)
                await load.start()
                base = f"http://127.0.0.1:{fleet.admin_port}/clusters/llm/shift"
                auth = {"Authorization": f"Bearer {TOKEN}"}
                async with http.post(base, json={"to": 1, "step_percent": a.step, "every_s": a.every}, headers=auth):
                    pass
                seen: list[dict] = []
                last = None
                while len(seen) < a.windows:
                    await asyncio.sleep(0.2)
                    async with http.get(base) as r:
                        v = await r.json()
                    g = v.get("last_gate")
                    if g and (v.get("window_start_wall_s"), g) != last:
                        last = (v.get("window_start_wall_s"), g)
                        seen.append(g)
                    if v["phase"] in ("paused", "done", "cancelled"):
                        async with http.post(f"{base}/cancel", headers=auth):
                            pass
                        async with http.post(base, json={"to": 1, "step_percent": a.step, "every_s": a.every},
                                             headers=auth):
                            pass
        finally:
            await load.stop()
            for b in burners:
                b.kill()
            fleet.stop()
    gate = 0.15
    fails = sum(1 for g in seen if g["latency_gate"] == "fail")
    bare = sum(1 for g in seen if g["latency_increase"] is not None and g["latency_increase"] >= gate)
    incs = sorted(g["latency_increase"] for g in seen if g["latency_increase"] is not None)
    noise = sorted(g["latency_noise"] for g in seen if g.get("latency_noise") is not None)
    print(f"{len(seen)} windows, {a.burners} burners: latency fails with the noise floor {fails}, "
          f"without it (recomputed) {bare}")
    if incs:
        print(f"latency increase min {incs[0]:+.1%} median {incs[len(incs) // 2]:+.1%} max {incs[-1]:+.1%}; "
              f"noise median {noise[len(noise) // 2]:.1%} max {noise[-1]:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--every", type=float, default=2.0, help="window per step, s (default 2)")
    ap.add_argument("--step", type=float, default=5.0, help="percent per step (default 5)")
    ap.add_argument("--burners", type=int, default=2, help="busy-looping processes (default 2)")
    ap.add_argument("--concurrency", type=int, default=4)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
