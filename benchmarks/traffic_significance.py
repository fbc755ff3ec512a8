"""How many real requests the fleet-wide traffic judgement needs before it ejects a failing node,
per failure rate, with the default ``lrs.traffic_ejection`` settings (pure: the policy function
itself, no processes).

Each trial: a node failing each request with probability ``rate`` among two clean peers (200
requests each in the window); after every request the verdict is asked; the count at the first
ejection is recorded (none within ``--max-requests``: never). Prints one row per rate: median,
p90 and max requests to ejection, and the share of trials never ejected.

Usage: python benchmarks/traffic_significance.py [--trials 2000] [--max-requests 3000] [--seed 1]
"""
from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import replace

from xds_server.config import TrafficEjectionConfig
from xds_server.health import model as hm
from xds_server.policy.traffic_ejection import Evidence, traffic_verdicts

RATES = (0.01, 0.02, 0.05, 0.2, 0.35, 0.5, 1.0)


def requests_to_ejection(rate: float, rng: random.Random, cfg: TrafficEjectionConfig, max_requests: int) -> int | None:
    """Requests the node served when it was first ejected, or None."""
    healthy = {n: replace(hm.initial(n, 0.0), state=hm.NodeState.HEALTHY) for n in ("a", "b", "x")}
    peers = [(n, healthy[n], Evidence(200, 0, 3, 10.0)) for n in ("a", "b")]
    bad = 0
    for n in range(1, max_requests + 1):
        bad += rng.random() < rate
        if n >= cfg.min_requests and bad:
            v = traffic_verdicts([*peers, ("x", healthy["x"], Evidence(n - bad, bad, 3, 10.0))], cfg, 50.0)
            if v.eject:
                return n
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--max-requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--confidence-p", type=float, default=None, help="default: the config's")
    args = ap.parse_args()
    cfg = TrafficEjectionConfig(**({} if args.confidence_p is None else {"confidence_p": args.confidence_p}))
    rng = random.Random(args.seed)
    print(f"confidence_p {cfg.confidence_p:g}, tolerance {cfg.tolerance:g}, min_requests {cfg.min_requests}; "
          f"{args.trials} trials, up to {args.max_requests} requests")
    print(f"{'failure rate':>12} {'median':>7} {'p90':>6} {'max':>6} {'never ejected':>14}")
    for rate in RATES:
        got = [requests_to_ejection(rate, rng, cfg, args.max_requests) for _ in range(args.trials)]
        hit = sorted(g for g in got if g is not None)
        never = 1 - len(hit) / len(got)  # printed to 0.01 %: one trial in 2,000 is 0.05 %
        if hit:
            p90 = hit[min(len(hit) - 1, int(0.9 * len(hit)))]
            print(f"{rate * 100:>11g}% {statistics.median(hit):>7.0f} {p90:>6} {hit[-1]:>6} {never * 100:>13.2f}%")
        else:
            print(f"{rate * 100:>11g}% {'-':>7} {'-':>6} {'-':>6} {never * 100:>13.2f}%")


if __name__ == "__main__":
    main()
