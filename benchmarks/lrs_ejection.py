"""Issue 22: fleet-wide passive ejection (LRS) against Envoy's own outlier detection alone, on the
same traffic, as figures for benchmarks/RESULTS.md (tests/integration/test_lrs_envoy.py asserts
the behaviour).

A fleet of ``--nodes`` simulated engines, three real Envoys (the fleet's and two more), one
closed-loop client per Envoy (``--pause`` s between requests). One node answers HTTP 500 to every
real request (sim fault ``user_error``) while its probes pass. Run ``lrs``: the control plane sums
every Envoy's load reports and ejects the node (``lrs.traffic_ejection`` with the defaults:
``min_requests`` 20 in 10 s). Run ``envoy``: ``lrs.traffic_ejection.enabled: false``, so only each
Envoy's outlier detection (consecutive_5xx 5, base_ejection_time 10 s, as the cluster publishes)
acts. Reported per run: seconds from the fault to the control plane's ejection, or to the first
and the last Envoy ejecting the node; 500s the bad node served in ``--duration`` s (its own count
of user requests; Envoy retried each elsewhere, so clients saw none of them).

    .venv/bin/python benchmarks/lrs_ejection.py [--runs 3] [--duration 30] [--pause 0.2]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from xds_server.testing import Fleet, LoadGenerator, StandaloneEnvoy, wait_for

FAST = {"probation_clean_s": 600.0, "ramp_step_percent": 25, "ramp_step_s": 0.25}


async def _ejections(http: aiohttp.ClientSession, admin_url: str) -> int:
    flt = r"cluster\.llm\.outlier_detection\.ejections_enforced_total"
    async with http.get(f"{admin_url}/stats", params={"filter": flt}) as r:
        text = await r.text()
    return sum(int(line.rsplit(": ", 1)[1]) for line in text.strip().splitlines() if ": " in line)


async def one(mode: str, nodes: int, duration_s: float, pause_s: float) -> dict:
    fleet = Fleet(n_nodes=nodes, health=FAST, config_options={
        "lrs": {"traffic_ejection": {"enabled": mode == "lrs"}}}).start()
    extra = [StandaloneEnvoy(fleet.xds_port, node_id=f"envoy-{i}") for i in (2, 3)]
    try:
        async with aiohttp.ClientSession() as http:
            for e in extra:
                await e.start()
            await fleet.wait_all_routed(http)

            async def healthy() -> bool:
                return all(v["state"] == "HEALTHY" for v in (await fleet.cp_nodes(http)).values())
            await wait_for(healthy, 30, what="all HEALTHY")
            admins = [f"http://127.0.0.1:{fleet.envoy_admin_port}", *(e.admin_url for e in extra)]
            gens = [LoadGenerator(u, concurrency=1, max_tokens=2, pause_s=pause_s)
                    for u in (fleet.url, *(e.url for e in extra))]
            for g in gens:
                await g.start()
            await asyncio.sleep(2.0)
            bad = fleet.nodes[-1]
            async with http.get(f"{bad.engine_url}/sim/stats") as r:
                before = (await r.json())["requests_by_kind"]["user"]
            await fleet.set_fault(http, bad.node_id, "user_error")
            t0 = time.monotonic()
            cp_s = None
            envoy_s: dict[int, float] = {}
            while time.monotonic() - t0 < duration_s:
                now = time.monotonic() - t0
                if cp_s is None and (await fleet.cp_nodes(http))[bad.node_id]["state"] == "UNHEALTHY":
                    cp_s = now
                for i, a in enumerate(admins):
                    if i not in envoy_s and await _ejections(http, a) > 0:
                        envoy_s[i] = now
                await asyncio.sleep(0.1)
            async with http.get(f"{bad.engine_url}/sim/stats") as r:
                served_500 = (await r.json())["requests_by_kind"]["user"] - before
            for g in gens:
                await g.stop()
            failed = sum(g.totals().failed for g in gens)
            ok = sum(g.totals().ok for g in gens)
        return {"mode": mode, "cp_ejected_s": cp_s, "envoy_first_s": min(envoy_s.values(), default=None),
                "envoy_last_s": max(envoy_s.values()) if len(envoy_s) == 3 else None,
                "envoys_ejected": len(envoy_s), "errors_served": served_500, "client_ok": ok,
                "client_failed": failed}
    finally:
        for e in extra:
            e.stop()
        fleet.stop()


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--pause", type=float, default=0.2)
    a = ap.parse_args()
    print("| run | mode | control plane ejects (s) | first / last Envoy ejects (s) | Envoys ejecting | "
          "500s served | client ok / failed |\n|---|---|---:|---:|---:|---:|---:|")
    for i in range(a.runs):
        for mode in ("lrs", "envoy"):
            r = await one(mode, a.nodes, a.duration, a.pause)
            print(f"| {i + 1} | {mode} | {_f(r['cp_ejected_s'])} | {_f(r['envoy_first_s'])} / "
                  f"{_f(r['envoy_last_s'])} | {r['envoys_ejected']} of 3 | {r['errors_served']} | "
                  f"{r['client_ok']} / {r['client_failed']} |", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
