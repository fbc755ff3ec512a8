"""CPU of the control core through a mass silence that comes in waves (fail-static's entry check).

Usage: python benchmarks/fail_static_waves.py [--nodes N] [--silent K] [--spread-s S] [--repeats R]

One control plane in this process on a virtual clock (its core, the health model, in-memory probe
sources: no I/O), N nodes HEALTHY with heartbeats every 100 ms. Then K of them go silent one after
another over S seconds, evenly, so that more than half are silent but never ``need`` (more than
``fail_static.fraction`` of N) within ``fail_static.window`` (300 ms) of each other: fail-static
must stay off and the silent nodes are ejected. The rest keep heartbeating. Prints the process
CPU from the first silence to S + 1 s after it, the fail-static walks run
(``cluster_routing.fail_static`` calls), whether fail-static entered, and the ejections; best of R.
Run it on two trees side by side with ``PYTHONPATH`` (from a directory outside both).
"""
from __future__ import annotations

import argparse
import random
import time
from typing import Any

from xds_server.config import parse_config
from xds_server.health import model as hm
from xds_server.policy import cluster_routing
from xds_server.probing.memory import InMemoryProbes
from xds_server.process.clock import ManualClock
from xds_server.server import ControlPlane

STEP_S = 0.01


def run(nodes: int, silent: int, spread_s: float) -> dict:
    cfg = {
        "xds": {"listen": "127.0.0.1:0", "coalesce_window_ms": 0, "warmup_timeout_ms": 5000},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"failure_detector": "count", "ramp_start_percent": 100.0},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.{1 + i // 60000}:{1024 + i % 60000}",
             "probe_address": f"127.0.0.1:{9001 + i % 50000}"} for i in range(nodes)]}],
    }
    clock, probes = ManualClock(), InMemoryProbes()
    cp = ControlPlane(parse_config(cfg), clock=clock, probe_sources=probes)
    cp.open()
    ids = list(cp.core.node_cfg)
    for _ in range(20):
        for nid in ids:
            probes[nid].heartbeat()
            probes[nid].probe(ttft_ms=20.0)
        clock.advance(0.1)
    assert {nh.state for nh in cp.health.values()} == {hm.NodeState.HEALTHY}
    order = random.Random(1).sample(ids, len(ids))
    goes_silent_at = {nid: i * spread_s / silent for i, nid in enumerate(order[:silent])}
    walks = 0
    walk = cluster_routing.fail_static

    def counted(*args: Any, **kwargs: Any) -> Any:  # a counting wrapper, any signature
        nonlocal walks
        walks += 1
        return walk(*args, **kwargs)

    cluster_routing.fail_static = counted  # the core calls it through the module
    entered = False
    try:
        steps = round((spread_s + 1.0) / STEP_S)
        c0 = time.process_time()
        for k in range(steps):
            t = k * STEP_S
            for i, nid in enumerate(ids):  # each live node heartbeats every 100 ms, staggered
                if i % 10 == k % 10 and goes_silent_at.get(nid, float("inf")) > t:
                    probes[nid].heartbeat()
            clock.advance(STEP_S)
            entered = entered or cp.core.fail_static.active
        cpu = time.process_time() - c0
    finally:
        cluster_routing.fail_static = walk
    out = sum(1 for nh in cp.health.values() if nh.state is hm.NodeState.UNHEALTHY)
    return {"cpu_s": cpu, "walks": walks, "entered": entered, "unhealthy": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--silent", type=int, default=1600)
    ap.add_argument("--spread-s", type=float, default=1.2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs = [run(args.nodes, args.silent, args.spread_s) for _ in range(args.repeats)]
    best = min(runs, key=lambda r: r["cpu_s"])
    every = ", ".join(f"{r['cpu_s']:.2f}" for r in runs)
    print(f"{args.nodes} nodes, {args.silent} silent over {args.spread_s:g} s: CPU {best['cpu_s']:.2f} s "
          f"(best of {args.repeats}; all {every}), "
          f"{best['walks']} fail-static walks, entered {best['entered']}, {best['unhealthy']} UNHEALTHY")


if __name__ == "__main__":
    main()
