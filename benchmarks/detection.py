"""Detection time with the real Envoy: fault injected -> control plane ejects -> Envoy excludes.

Usage: python benchmarks/detection.py [--runs N] [--fault freeze|hang|prefill] [--probe-interval-s S]
           [--detector phi|count] [--cpu-burners K] [--quiet-s S] [--nodes N] [--prefill-ms MS]
           [--agents dial dial-in]

``--fault prefill`` is the contrast (issue 11): each run puts one node's engine into a long
chunked prefill (the sim's ``prefill`` mode, ``--prefill-ms``, default 5,500 ms: KV usage rising,
token counters frozen, requests queued behind it) and counts false ejections (the node entering
UNHEALTHY or PROBATION) and the time from the prefill's end until the published assignment has
it at full weight again.

``--cpu-burners K`` starts K busy-loop processes for the whole run (the machine has 2 cores, so
the control plane, agents, engines and Envoy all compete for CPU). ``--busy-cp`` pins the
control plane and the burners to CPU 0 and everything else to CPU 1: the control plane's own
CPU is saturated while the agents (remote hosts in production) are not starved. ``--quiet-s S`` first runs
S seconds of load with no fault and counts false ejections (any transition to UNHEALTHY).

One fleet (3 simulated nodes, agents, xds-server, Envoy) under a steady load of 4 concurrent
non-streaming requests; each run injects the fault on one node (round robin), waits until
Envoy's /clusters excludes it, heals it, and waits until Envoy routes to it again. Prints each
run and the median / p90 / max of both detection times, plus failed requests.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time

import aiohttp

from xds_server.demo import FaultTimeline, node_events, wait_routed, watch_exclusion
from xds_server.testing import Fleet, LoadGenerator


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _burn() -> None:
    while True:
        pass


async def _false_ejections(fleet: Fleet, http: aiohttp.ClientSession) -> list[dict]:
    async with http.get(f"http://127.0.0.1:{fleet.admin_port}/events?limit=10000") as r:
        evs = (await r.json())["events"]
    return [e for e in evs if e.get("to") == "UNHEALTHY" or e["kind"] == "outlier_ejected"]


async def _prefill_run(fleet: Fleet, http: aiohttp.ClientSession, node_id: str, prefill_ms: float
                       ) -> tuple[int, float | None, set[str]]:
    """One long prefill on ``node_id``: (false ejections, s from its end to full weight in the
    published assignment, states the node went through)."""
    async with http.get(f"http://127.0.0.1:{fleet.admin_port}/events?limit=10000") as r:
        before = len((await r.json())["events"])
    t0 = time.monotonic()
    end = t0 + prefill_ms / 1000.0
    await fleet.set_fault(http, node_id, "prefill", prefill_ms=prefill_ms)
    states: set[str] = set()
    back: float | None = None
    while time.monotonic() < end + 15.0:
        states.add((await fleet.cp_nodes(http))[node_id]["state"])
        if time.monotonic() > end:
            # the published assignment (what Envoy gets over EDS): Envoy's own passive outlier
            # detection may also have ejected the node for user requests that hit the 1 s
            # per-try timeout while queued behind the prefill, which is Envoy's call, not ours
            v = (await fleet.cp_nodes(http))[node_id]
            if v["weight"] == 100 and v["eds_health_status"] == "HEALTHY":
                back = time.monotonic() - end
                break
        await asyncio.sleep(0.05)
    async with http.get(f"http://127.0.0.1:{fleet.admin_port}/events?limit=10000") as r:
        evs = (await r.json())["events"][before:]
    false = [e for e in evs if e.get("node") == node_id and e.get("to") in ("UNHEALTHY", "PROBATION")]
    return len(false), back, states


async def main(runs: int, fault: str, probe_interval_s: float, detector: str, burners: int,
               quiet_s: float, nodes: int, hold_s: float = 1.0, busy_cp: bool = False,
               prefill_ms: float = 5500.0, agents: str = "dial") -> None:
    health = {"failure_detector": detector, "probation_clean_s": 1.0, "ramp_step_percent": 50, "ramp_step_s": 0.2}
    if fault == "prefill":  # "full weight" = 100: the seed score would move weights with RTT noise
        health.update(score_rtt_weight=0.0, score_gpu_weight=0.0)
    fleet = Fleet(n_nodes=nodes, probe_interval_s=probe_interval_s, per_try_timeout_s=1.0, health=health,
                  agents=agents)
    print(f"== agents: {agents} ==", flush=True)
    procs = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(burners)]
    await asyncio.to_thread(fleet.start)
    for p in procs:
        p.start()
    if busy_cp:
        import os
        os.sched_setaffinity(fleet.control_plane.pid, {0})
        for p in procs:
            os.sched_setaffinity(p.pid, {0})
        for mp in fleet.procs:
            if mp is not fleet.control_plane:
                os.sched_setaffinity(mp.pid, {1})
    cp_ms: list[float] = []
    envoy_ms: list[float] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            await fleet.wait_all_routed(http)
            await asyncio.sleep(2.0)
            load = LoadGenerator(fleet.url, concurrency=4, max_duration_s=900)
            await load.start()
            if quiet_s:
                before = len(await _false_ejections(fleet, http))
                await asyncio.sleep(quiet_s)
                false = (await _false_ejections(fleet, http))[before:]
                async with http.get(f"http://127.0.0.1:{fleet.admin_port}/events?limit=10000") as r:
                    fs = [e for e in (await r.json())["events"] if e["kind"] == "fail_static_on"]
                print(f"quiet {quiet_s:.0f} s under load with {burners} CPU burner(s)"
                      f"{' on the control plane CPU' if busy_cp else ''}, "
                      f"detector {detector}: {len(false)} false ejection(s) {[e['reason'][:90] for e in false]}; "
                      f"fail-static entered {len(fs)} time(s)", flush=True)
            prefill_false = 0
            prefill_back: list[float] = []
            for i in range(runs if fault == "prefill" else 0):
                node = fleet.nodes[i % len(fleet.nodes)]
                n_false, back_s, states = await _prefill_run(fleet, http, node.node_id, prefill_ms)
                prefill_false += n_false
                if back_s is not None:
                    prefill_back.append(back_s * 1000)
                print(f"run {i + 1:>2} {node.node_id}: prefill {prefill_ms:.0f} ms, states {sorted(states)}, "
                      f"false ejections {n_false}, full weight published "
                      f"{'never' if back_s is None else f'{back_s * 1000:.0f} ms'} after it ended", flush=True)
                await asyncio.sleep(0.5)
            busy_reads = 0
            for i in range(runs if fault != "prefill" else 0):
                node = fleet.nodes[i % len(fleet.nodes)]
                tl = FaultTimeline(fault, node.node_id)
                wall0 = time.time()
                t0 = time.monotonic()
                if fault == "freeze":
                    node.engine.freeze()
                    node.agent.freeze()
                else:
                    await fleet.set_fault(http, node.node_id, "hang")
                await watch_exclusion(fleet, http, tl, t0, timeout_s=10.0)
                # a hang must never read as busy (issue 25 item 8): transitions that called it so
                busy = [e for e in await node_events(fleet, http, node.node_id, wall0)
                        if e["kind"] == "transition" and e["reason"].startswith("busy")]
                busy_reads += len(busy)
                await asyncio.sleep(hold_s)  # a real outage, not a blip the count rule would forgive
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
                print(f"run {i + 1:>2} {node.node_id}: "
                      f"control plane {tl.cp_ejected_s and tl.cp_ejected_s * 1000:.0f} ms, "
                      f"Envoy {tl.envoy_excluded_s and tl.envoy_excluded_s * 1000:.0f} ms ({tl.envoy_status}), "
                      f"routed again {back if back is None else round(back, 1)} s after heal, "
                      f"shown busy {len(busy)}", flush=True)
                await asyncio.sleep(0.5)
            await load.stop()
            total = load.totals()
    finally:
        for p in procs:
            p.kill()
        await asyncio.to_thread(fleet.stop)
    if fault == "prefill":
        print(f"long prefills: {runs} runs, false ejections {prefill_false}")
    else:
        print(f"faults read as busy before the ejection: {busy_reads} transition(s) in {runs} runs")
    for name, xs in (("control plane ejected", cp_ms), ("Envoy excluded", envoy_ms),
                     ("full weight after the prefill", prefill_back if fault == "prefill" else [])):
        if xs:
            print(f"{name}: n={len(xs)} median {statistics.median(xs):.0f} ms, p90 {_q(xs, 0.9):.0f} ms, "
                  f"p99 {_q(xs, 0.99):.0f} ms, max {max(xs):.0f} ms")
    print(f"requests: {total.ok} ok, {total.failed} failed {dict(total.failures) if total.failed else ''}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--fault", choices=["freeze", "hang", "prefill"], default="freeze")
    ap.add_argument("--prefill-ms", type=float, default=5500.0, help="length of each long prefill (--fault prefill)")
    ap.add_argument("--probe-interval-s", type=float, default=1.0)
    ap.add_argument("--detector", choices=["phi", "count"], default="phi")
    ap.add_argument("--cpu-burners", type=int, default=0)
    ap.add_argument("--quiet-s", type=float, default=0.0)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--hold-s", type=float, default=1.0, help="how long each fault lasts after Envoy excluded it")
    ap.add_argument("--busy-cp", action="store_true")
    ap.add_argument("--agents", nargs="+", choices=["dial", "dial-in"], default=["dial"],
                    help="how agents meet the control plane; several: one after another in this run "
                    "(dial: heartbeats on the stream we dial; dial-in: the agent dials us, our PINGs)")
    a = ap.parse_args()
    for mode in a.agents:
        asyncio.run(main(a.runs, a.fault, a.probe_interval_s, a.detector, a.cpu_burners, a.quiet_s, a.nodes,
                         a.hold_s, a.busy_cp, a.prefill_ms, mode))
