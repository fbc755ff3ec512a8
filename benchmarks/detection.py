"""Detection time with the real Envoy: fault injected -> control plane ejects -> Envoy excludes.

Usage: python benchmarks/detection.py [--runs N] [--fault freeze|hang] [--probe-interval-s S]

One fleet (3 simulated nodes, agents, xds-server, Envoy) under a steady load of 4 concurrent
non-streaming requests; each run injects the fault on one node (round robin), waits until
Envoy's /clusters excludes it, heals it, and waits until Envoy routes to it again. Prints each
run and the median / p90 / max of both detection times, plus failed requests.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp

from xds_server.demo import FaultTimeline, wait_routed, watch_exclusion
from xds_server.testing import Fleet, LoadGenerator


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def main(runs: int, fault: str, probe_interval_s: float) -> None:
    fleet = Fleet(n_nodes=3, probe_interval_s=probe_interval_s, per_try_timeout_s=1.0)
    await asyncio.to_thread(fleet.start)
    cp_ms: list[float] = []
    envoy_ms: list[float] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            await fleet.wait_all_routed(http)
            load = LoadGenerator(fleet.url, concurrency=4, max_duration_s=600)
            await load.start()
            for i in range(runs):
                node = fleet.nodes[i % len(fleet.nodes)]
                tl = FaultTimeline(fault, node.node_id)
                t0 = time.monotonic()
                if fault == "freeze":
                    node.engine.freeze()
                    node.agent.freeze()
                else:
                    await fleet.set_fault(http, node.node_id, "hang")
                await watch_exclusion(fleet, http, tl, t0, timeout_s=10.0)
                if fault == "freeze":
                    node.agent.thaw()
                    node.engine.thaw()
                else:
                    await fleet.set_fault(http, node.node_id, "none")
                back = await wait_routed(fleet, http, node.node_id, timeout_s=30)
                if tl.cp_ejected_s is not None:
                    cp_ms.append(tl.cp_ejected_s * 1000)
                if tl.envoy_excluded_s is not None:
                    envoy_ms.append(tl.envoy_excluded_s * 1000)
                print(f"run {i + 1:>2} {node.node_id}: control plane {tl.cp_ejected_s and tl.cp_ejected_s * 1000:.0f} ms, "
                      f"Envoy {tl.envoy_excluded_s and tl.envoy_excluded_s * 1000:.0f} ms ({tl.envoy_status}), "
                      f"routed again {back:.1f} s after heal", flush=True)
                await asyncio.sleep(0.5)
            await load.stop()
            total = load.totals()
    finally:
        await asyncio.to_thread(fleet.stop)
    for name, xs in (("control plane ejected", cp_ms), ("Envoy excluded", envoy_ms)):
        if xs:
            print(f"{name}: n={len(xs)} median {statistics.median(xs):.0f} ms, p90 {_q(xs, 0.9):.0f} ms, "
                  f"max {max(xs):.0f} ms")
    print(f"requests: {total.ok} ok, {total.failed} failed {dict(total.failures) if total.failed else ''}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--fault", choices=["freeze", "hang"], default="freeze")
    ap.add_argument("--probe-interval-s", type=float, default=1.0)
    a = ap.parse_args()
    asyncio.run(main(a.runs, a.fault, a.probe_interval_s))
