"""Issue 23: the share of real requests Envoy routes to a shift's target at each step, against the
commanded share, as figures for benchmarks/RESULTS.md.

A fleet of 4 simulated engines (priorities 0, 0, 1, 1) behind the real Envoy (2 workers), a
closed-loop load (``--concurrency`` workers, 1-token completions); a gated shift to priority 1 with
``--step`` % every ``--every`` s (gates loosened so seconds-long windows pass: 20 requests, z 1,
5 % errors). Per step, the answers counted per node (``x-served-by``) over the middle of the window
(after 0.4 s for Envoy to apply the update); the target's share is the sum over gpu-c and gpu-d.

    .venv/bin/python benchmarks/shift_share.py [--step 10] [--every 3] [--concurrency 6] [--lb LEAST_REQUEST]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from xds_server.testing import Fleet, LoadGenerator

TOKEN = "bench-token"


async def run(a: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as d:
        fleet = Fleet(n_nodes=4, node_options=[{"priority": p} for p in (0, 0, 1, 1)],
                      health={"ramp_start_percent": 100.0},
                      cluster_options={"outlier_detection": {"enabled": False}, "lb_policy": a.lb},
                      admin_options={"token": TOKEN},
                      config_options={"shift": {"min_requests": 20, "wilson_z": 1.0, "max_error_ratio": 0.05,
                                                "max_latency_increase": 3.0, "state_path": f"{d}/s.json"},
                                      "lrs": {"interval_s": 0.5, "traffic_ejection": {"enabled": False}}})
        fleet.start()
        try:
            async with aiohttp.ClientSession() as http:
                await fleet.wait_all_routed(http)
                load = LoadGenerator(fleet.url, concurrency=a.concurrency, max_tokens=1)
                await load.start()
                url = f"http://127.0.0.1:{fleet.admin_port}/clusters/llm/shift"
                async with http.post(url, json={"to": 1, "step_percent": a.step, "every_s": a.every},
                                     headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                    assert r.status == 200, await r.text()
                t0 = time.monotonic()
                print("| commanded % | routed % (target) | answers | step began at (s) |")
                print("|---|---|---|---|")
                k = 0
                while True:
                    async with http.get(url) as r:
                        v = await r.json()
                    if v["phase"] == "done":
                        break
                    share = v["share_percent"]
                    began = time.monotonic() - t0
                    await asyncio.sleep(0.4)
                    ph = load.phase(f"s{k}")
                    await asyncio.sleep(max(0.2, a.every - 0.9))
                    load.phase(f"gap{k}")
                    total = sum(ph.ok_by_node.values())
                    got = 100.0 * (ph.ok_by_node["gpu-c"] + ph.ok_by_node["gpu-d"]) / max(1, total)
                    print(f"| {share:g} | {got:.1f} | {total} | {began:.2f} |")
                    while (await (await http.get(url)).json())["share_percent"] == share:
                        await asyncio.sleep(0.05)
                        if time.monotonic() - t0 > 20 * a.every * 100 / a.step:
                            raise SystemExit("the shift stopped advancing")
                    k += 1
                await load.stop()
                print(f"failures: {dict(load.totals().failures)}")
        finally:
            fleet.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", type=float, default=10.0, help="percent per step (default 10)")
    ap.add_argument("--every", type=float, default=3.0, help="window per step, s (default 3)")
    ap.add_argument("--concurrency", type=int, default=6, help="load workers (default 6)")
    ap.add_argument("--lb", choices=("LEAST_REQUEST", "ROUND_ROBIN"), default="LEAST_REQUEST",
                    help="the cluster's lb_policy (default LEAST_REQUEST)")
    asyncio.run(run(ap.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
