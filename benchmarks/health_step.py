"""CPU cost of the pure health model per observation (the model's share of a heartbeat's cost).

Usage: python benchmarks/health_step.py [--seconds S] [--repeats R]

Drives one node through ``NodeSim`` on a virtual clock for S virtual seconds in steady state
(HEALTHY: heartbeats every 100 ms, a good probe and a ping every second, plus the Ticks the model
asks for), R times, and prints the best wall time per observation. No I/O, one core.
"""
from __future__ import annotations

import argparse
import time

from xds_server.config import HealthConfig
from xds_server.health.sim import NodeSim


def run(seconds: float) -> tuple[float, int]:
    """(wall seconds, observations applied) for ``seconds`` of virtual time after a 5 s warm-up."""
    sim = NodeSim(cfg=HealthConfig())
    sim.run_until(5.0)
    count = 0
    apply = sim.apply

    def counted(obs, at=None):
        nonlocal count
        count += 1
        return apply(obs, at)

    sim.apply = counted  # type: ignore[method-assign] - counting wrapper
    t0 = time.perf_counter()
    sim.run_until(5.0 + seconds)
    return time.perf_counter() - t0, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300.0, help="virtual seconds per run")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    best, n = min(run(args.seconds) for _ in range(args.repeats))
    print(f"{n} observations in {args.seconds:g} virtual s: best {best * 1000:.1f} ms, "
          f"{best / n * 1e6:.1f} us per observation (best of {args.repeats})")


if __name__ == "__main__":
    main()
