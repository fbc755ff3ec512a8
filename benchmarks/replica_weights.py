"""Do two replicas agree on endpoint weights with the seed score's RTT term on? (issue 14 item 4)

    .venv/bin/python benchmarks/replica_weights.py --seconds 30 --concurrency 4

Starts the two-replica fleet of tests/integration/test_split_replicas_envoy.py (its ``Split``:
engines gpu-a1/a2, their agents, replicas cp-a1/cp-a2 of cluster pool-a, real Envoy) with the
default ``health.score.rtt_weight`` 0.7, puts a load on pool-a through Envoy and samples both
replicas' ``/nodes`` every 0.2 s (after 2 s of load): each node's weight, EWMA RTT and EWMA TTFT.

Reports how often the replicas' weights differ, and, recomputing the score factor as
``xds_server.policy.cluster_routing.cluster_routing`` does (slack, min factor, step from the defaults; the
GPU term is equal on both and left out) from the sampled values, how often they would differ if
the score used: the RTT each replica measured (the recomputation of what is published), that RTT
in coarse buckets (bucket floor), those buckets with hysteresis (a replica keeps its bucket until
the RTT leaves it by a margin), or the agent-reported probe TTFT, which both replicas receive.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402 - after the sys.path setup

from xds_server.config import HealthConfig  # noqa: E402 - after the sys.path setup
from xds_server.testing import LoadGenerator, wait_for  # noqa: E402 - after the sys.path setup

NODES = ("gpu-a1", "gpu-a2")


def _split_module():
    """The split-replicas test module (its ``Split`` fleet), loaded from its file."""
    path = ROOT / "tests/integration/test_split_replicas_envoy.py"
    spec = importlib.util.spec_from_file_location("split_replicas", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


async def sample(seconds: float, concurrency: int) -> list[dict[str, dict[str, tuple[float, float, float]]]]:
    """Samples: replica -> node -> (weight, EWMA RTT ms, EWMA TTFT ms)."""
    m = _split_module()
    m.HEALTH = {**m.HEALTH, "score_rtt_weight": HealthConfig().score.rtt_weight}
    with tempfile.TemporaryDirectory(prefix="replica-weights-") as d:
        s = m.Split(Path(d), m.ADS_DELTA)
        try:
            s.start()
            out = []
            async with aiohttp.ClientSession() as http:
                await wait_for(lambda: s.all_routed(http), timeout_s=30)
                load = LoadGenerator(s.url, concurrency=concurrency)
                await load.start()
                try:
                    await asyncio.sleep(2.0)
                    end = time.monotonic() + seconds
                    while time.monotonic() < end:
                        row = {}
                        for cp in s.cps[:2]:
                            async with http.get(f"{cp.admin}/nodes") as r:
                                data = await r.json()
                            nodes = data["nodes"] if isinstance(data, dict) else data
                            row[cp.replica] = {n["id"]: (n["weight"], n["ewma_rtt_ms"], n["ewma_ttft_ms"])
                                               for n in nodes if n["id"] in NODES}
                        out.append(row)
                        await asyncio.sleep(0.2)
                finally:
                    await load.stop()
            return out
        finally:
            s.stop()


def factors(scores: dict[str, float], h: HealthConfig) -> dict[str, float]:
    """Quantized score factors as the policy computes them (lower score is better)."""
    best = min(scores.values())
    out = {}
    for k, v in scores.items():
        f = min(1.0, max(h.score.min_factor, (best + h.score.slack) / (v + h.score.slack)))
        out[k] = max(h.score.min_factor, round(f / h.score.step) * h.score.step)
    return out


def analyse(samples: list[dict], h: HealthConfig) -> list[tuple[str, float]]:
    """(what, share of samples where the two replicas' weights or score factors differ)."""
    reps = sorted(samples[0])

    def share(term) -> float:
        """``term(replica, node, sample) -> ms`` in the score's RTT place."""
        diff = 0
        for row in samples:
            a, b = (factors({n: h.score.rtt_weight * term(r, n, v) for n, v in row[r].items()}, h) for r in reps)
            diff += a != b
        return diff / len(samples)

    def hysteresis(width: float, margin: float):
        held: dict[tuple[str, str], int] = {}

        def term(r: str, n: str, v: tuple) -> float:
            cur = held.get((r, n))
            if cur is None or v[1] < cur * width - margin or v[1] >= (cur + 1) * width + margin:
                cur = math.floor(v[1] / width)
            held[(r, n)] = cur
            return width * cur
        return term

    observed = sum({n: v[0] for n, v in row[reps[0]].items()} != {n: v[0] for n, v in row[reps[1]].items()}
                   for row in samples) / len(samples)
    out = [("published weights (observed)", observed),
           ("each replica's RTT (recomputed)", share(lambda r, n, v: v[1]))]
    out += [(f"RTT in {b} ms buckets", share(lambda r, n, v, b=b: b * math.floor(v[1] / b))) for b in (5, 10, 25, 50)]
    out += [(f"RTT in {b} ms buckets, hysteresis {m} ms", share(hysteresis(b, m)))
            for b, m in ((5, 2), (10, 3), (25, 5))]
    out.append(("agent-reported probe TTFT (both replicas receive it)", share(lambda r, n, v: v[2])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    samples = asyncio.run(sample(args.seconds, args.concurrency))
    h = HealthConfig()
    reps = sorted(samples[0])
    rtt = [row[r][n][1] for row in samples for r in reps for n in NODES]
    d_rtt = [abs(row[reps[0]][n][1] - row[reps[1]][n][1]) for row in samples for n in NODES]
    d_ttft = [abs(row[reps[0]][n][2] - row[reps[1]][n][2]) for row in samples for n in NODES]
    print(f"{len(samples)} samples of both replicas; EWMA RTT {min(rtt):.1f}-{max(rtt):.1f} ms; replicas' "
          f"|difference|: RTT median {statistics.median(d_rtt):.2f} ms (max {max(d_rtt):.1f}), TTFT median "
          f"{statistics.median(d_ttft):.3f} ms (max {max(d_ttft):.1f})")
    print("| score term | samples where the replicas' weights differ |\n|---|---|")
    for what, share in analyse(samples, h):
        print(f"| {what} | {share:.0%} |")


if __name__ == "__main__":
    main()
