"""Issue 22, "done when" item 3: half of a cluster's capacity frozen under a steady open-loop load
the other half cannot carry, with overload shedding (``lrs.shed.enabled: true``) and without, side
by side, as figures for benchmarks/RESULTS.md (tests/integration/test_overload_envoy.py asserts
the behaviour with protection on).

A fleet of ``--nodes`` simulated engines, each decoding at most ``--max-num-seqs`` requests at once
(the rest wait FIFO, as vLLM's), their agents, the control plane and one real Envoy. An open-loop
client (Poisson arrivals at ``--rate`` rps, streamed completions of ``--max-tokens`` tokens at
``--token-ms`` per token) runs ``--warm`` s on the whole cluster (the "unloaded" TTFT), then half
the engines freeze (sim fault ``hang``: tokens stop, ``/metrics`` stays up, the agents see a
stall and the nodes are ejected) and the load goes on for ``--duration`` s. Per mode: the
survivors' waiting (max and p95 of the samples, from their own ``/metrics`` every 0.2 s), admitted
TTFT p50/p99 against the unloaded p99, the shed share against the commanded drop (the control
plane's ``/clusters`` ``traffic.shed_percent`` at each request's send time), status counts and
errors (admitted streams cut or timed out). ``--sweep`` first measures TTFT at several rates on the
whole cluster (the knee).

    .venv/bin/python benchmarks/overload_shed.py [--nodes 4] [--max-num-seqs 2] [--rate 30]
        [--duration 30] [--queue-warning 50 --queue-critical 100] [--sweep 10,20,30,40]
        [--capacity-rps C]

The bare excess is ``1 - C / offered``, ``C`` what the survivors complete when saturated: the
"no shed" run's completions (its queues never empty), or ``--capacity-rps``. The shed share is
also given after the first 10 s of the fault (the controller's settling).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from overload_rig import OpenLoop, Watch, pct, summary  # noqa: E402  # after the path insert above

from xds_server.testing import Fleet, wait_for  # noqa: E402  # after the path insert above

FAST = {"probation": {"clean": "10m", "ramp_step_percent": 25, "ramp_step": "250ms"}}


def _fleet(a: argparse.Namespace, shed: bool) -> Fleet:
    return Fleet(n_nodes=a.nodes, token_interval_ms=a.token_ms, per_try_timeout_s=None,
                 per_try_idle_timeout_s=a.idle_timeout,
                 engine_args=["--max-num-seqs", str(a.max_num_seqs)],
                 health={**FAST, "load": {"queue_warning": a.queue_warning, "queue_critical": a.queue_critical},
                         **json.loads(a.health)},
                 config_options={"lrs": {"shed": {"enabled": shed, **json.loads(a.shed)}}},
                 cluster_options=json.loads(a.cluster),
                 agent_args=[a.agent_args.split()] * a.nodes if a.agent_args else [])


async def _phase(fleet: Fleet, http: aiohttp.ClientSession, rate: float, seconds: float, a: argparse.Namespace,
                 watch: Watch | None = None, seed: int = 1) -> OpenLoop:
    load = OpenLoop(fleet.url, rate, max_tokens=a.max_tokens, timeout_s=a.timeout, seed=seed, watch=watch)
    stop = asyncio.Event()
    task = asyncio.create_task(load.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await task
    return load


async def sweep(a: argparse.Namespace, rates: list[float]) -> list[dict]:
    """TTFT at each rate on the whole cluster (no fault, no shedding): where the knee is."""
    fleet = _fleet(a, shed=False).start()
    rows = []
    try:
        async with aiohttp.ClientSession() as http:
            await fleet.wait_all_routed(http)
            for rate in rates:
                s = summary((await _phase(fleet, http, rate, a.sweep_s, a)).shots)
                rows.append({"rate": rate, **s})
                print(f"rate {rate:g} rps: TTFT p50 {s['ttft_p50_ms']:.0f} ms p99 {s['ttft_p99_ms']:.0f} ms, "
                      f"{dict(s['status'])}", flush=True)
                await asyncio.sleep(1.0)
    finally:
        fleet.stop()
    return rows


async def one(a: argparse.Namespace, shed: bool) -> dict:
    fleet = _fleet(a, shed).start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            await fleet.wait_all_routed(http)

            async def healthy() -> bool:
                return all(v["state"] == "HEALTHY" for v in (await fleet.cp_nodes(http)).values())
            await wait_for(healthy, 30, what="all HEALTHY")
            frozen = [n.node_id for n in fleet.nodes[: a.nodes // 2]]
            survivors = [n.node_id for n in fleet.nodes[a.nodes // 2:]]
            watch = Watch({n.node_id: n.engine_url for n in fleet.nodes}, f"http://127.0.0.1:{fleet.admin_port}")
            stop_watch = asyncio.Event()
            wtask = asyncio.create_task(watch.run(http, stop_watch))
            load = OpenLoop(fleet.url, a.rate, max_tokens=a.max_tokens, timeout_s=a.timeout, watch=watch)
            stop = asyncio.Event()
            ltask = asyncio.create_task(load.run(stop))
            t_start = time.monotonic()
            await asyncio.sleep(a.warm)
            t_freeze = time.monotonic()
            for nid in frozen:
                await fleet.set_fault(http, nid, "hang")
            states: dict[str, set[str]] = {n: set() for n in survivors}
            while time.monotonic() - t_freeze < a.duration:
                for nid, v in (await fleet.cp_nodes(http)).items():
                    if nid in states:
                        states[nid].add(v["state"])
                await asyncio.sleep(0.5)
            t_end = time.monotonic()
            stop.set()
            await ltask
            stop_watch.set()
            await wtask
            for nid in frozen:
                await fleet.set_fault(http, nid, "none")
        unloaded = summary(load.between(t_start + 1.0, t_freeze - 1.0))
        timeline = []
        for k in range(int(t_end - t_freeze) + 1):
            lo = t_freeze + k
            shots = load.between(lo, lo + 1.0)
            w = watch.waiting_between(lo, lo + 1.0, survivors)
            d = [p for t, p in watch.drops if lo <= t < lo + 1.0]
            timeline.append((k, max(w, default=-1), max(d, default=-1), sum(x.status == 429 for x in shots),
                             len(shots)))
        # the overload phase counts from when the frozen nodes are out (the agents' stall
        # detection, ~1.5 s) to the end
        over = load.between(t_freeze + a.settle, t_end)
        s = summary(over)
        late = load.between(t_freeze + 10.0, t_end)  # after the first 10 s of the fault
        done = sum(1 for x in load.shots if x.done_t is not None and t_freeze + a.settle <= x.done_t < t_end)
        waits = watch.waiting_between(t_freeze + a.settle, t_end, survivors)
        drops = [p for t, p in watch.drops if t >= t_freeze + a.settle]
        return {"mode": "shed" if shed else "no shed", "unloaded": unloaded, "overload": s,
                "offered_rps": len(over) / max(1e-9, t_end - t_freeze - a.settle),
                "completed_rps": done / max(1e-9, t_end - t_freeze - a.settle),
                "shed_after_10s": summary(late)["shed_share"],
                "ttft_after_10s_p50_p99_ms": (summary(late)["ttft_p50_ms"], summary(late)["ttft_p99_ms"]),
                "survivors_waiting_max": max(waits, default=float("nan")),
                "survivors_waiting_p95": pct(waits, 95),
                "drop_max": max(drops, default=0.0), "survivor_states": {k: sorted(v) for k, v in states.items()},
                "timeline (s, survivors' waiting max, drop max %, 429s, sent)": timeline,
                "shed_reasons": [(round(t - t_freeze, 1), why) for t, why in watch.reasons],
                "frozen_errors": sum(1 for x in load.between(t_freeze, t_freeze + a.settle) if x.end != "done")}
    finally:
        fleet.stop()


def _row(r: dict, capacity: float | None) -> str:
    u, s = r["unloaded"], r["overload"]
    st = s["status"]
    other = sum(v for k, v in st.items() if k not in ("200", "429+RA", "429", "503"))
    ratio = s["ttft_p99_ms"] / u["ttft_p99_ms"] if u["ttft_p99_ms"] else float("nan")
    load = f"{100 * r['offered_rps'] / capacity:.0f} %" if capacity else "?"
    bare = f"{max(0.0, 100 * (1 - capacity / r['offered_rps'])):.1f}" if capacity and r["offered_rps"] else "?"
    return (f"| {r['mode']} | {r['offered_rps']:.1f} ({load}) | {bare} | {s['shed_share']:.1f} / "
            f"{r['shed_after_10s']:.1f} / {s['commanded']:.1f} | {r['survivors_waiting_max']:.0f} / "
            f"{r['survivors_waiting_p95']:.0f} | {u['ttft_p50_ms']:.0f} / {u['ttft_p99_ms']:.0f} | "
            f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} ({ratio:.1f}x) | {r['completed_rps']:.1f} | "
            f"{st.get('429+RA', 0)} ({st.get('429', 0)} without) | {st.get('503', 0)} | {other} | {s['errors']} |")


HEADER = ("| mode | offered rps (of capacity) | bare excess (%) | shed: all / after 10 s / commanded (%) | "
          "survivors' waiting max / p95 | unloaded TTFT p50 / p99 (ms) | admitted TTFT p50 / p99 (ms) | "
          "completed rps | 429 + Retry-After | 503 | other | errors |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--token-ms", type=float, default=25.0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rate", type=float, default=30.0, help="open-loop arrivals, rps")
    p.add_argument("--warm", type=float, default=8.0, help="whole-cluster phase before the freeze, s")
    p.add_argument("--duration", type=float, default=30.0, help="load after the freeze, s")
    p.add_argument("--settle", type=float, default=3.0, help="s after the freeze not counted (ejection)")
    p.add_argument("--timeout", type=float, default=15.0, help="client timeout per request, s")
    p.add_argument("--idle-timeout", type=float, default=10.0, help="Envoy's per-try idle timeout, s")
    p.add_argument("--queue-warning", type=float, default=50.0)
    p.add_argument("--queue-critical", type=float, default=100.0)
    p.add_argument("--shed", default="{}", help="more lrs.shed keys, JSON ('{\"step_percent\": 10}')")
    p.add_argument("--cluster", default="{}", help="more clusters[0] keys, JSON ('{\"max_requests\": 32}')")
    p.add_argument("--agent-args", default="",
                   help="more node-probe arguments, every agent ('--probe-idle-interval-s 3')")
    p.add_argument("--health", default="{}", help="more health sections, JSON ('{\"probes\": {...}}')")
    p.add_argument("--modes", default="shed,no shed")
    p.add_argument("--sweep", default="", help="rates (rps, comma-separated) to measure TTFT at first")
    p.add_argument("--sweep-s", type=float, default=6.0)
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--capacity-rps", type=float, default=0.0,
                   help="what the survivors complete when saturated, rps, for the bare excess (default: the "
                        "'no shed' run's completions, when it ran)")
    a = p.parse_args()
    out: dict = {"args": vars(a)}
    if a.sweep:
        out["sweep"] = await sweep(a, [float(x) for x in a.sweep.split(",")])
    rows = []
    for mode in a.modes.split(","):
        r = await one(a, shed=mode.strip() == "shed")
        rows.append(r)
        print(json.dumps(r, default=str), flush=True)
    out["runs"] = rows
    saturated = [r["completed_rps"] for r in rows if r["mode"] == "no shed"]
    capacity = a.capacity_rps or (saturated[0] if saturated else None)
    print(HEADER)
    for r in rows:
        print(_row(r, capacity))
    if a.json:
        Path(a.json).write_text(json.dumps(out, default=str, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
