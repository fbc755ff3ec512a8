"""Issue 22: how long two control-plane replicas disagree on a fleet-wide ejection (LRS), as
figures for benchmarks/RESULTS.md (tests/integration/test_lrs_replicas.py asserts the exact sums).

Two xds-server replicas (cp-1, cp-2) watching the same ``--nodes`` simulated engines; three real
Envoys: one listing cp-1 only, one cp-2 only, one both (cp-2 first), so each replica holds at
least one Envoy's LRS stream; one closed-loop client per Envoy (``--pause`` s between requests).
One node answers HTTP 500 to every real request (sim fault ``user_error``) while its probes
pass. Mode ``peers``: ``lrs.peers`` names the other replica, so each sums all three Envoys; mode
``none``: no peers, each replica judges from the Envoys whose LRS stream it holds. Reported per
run: seconds from the fault to each replica's ejection (its ``/events`` transition to UNHEALTHY,
wall clock of one machine) and the gap between the two (``-``: not ejected within ``--duration``).

    .venv/bin/python benchmarks/lrs_replicas.py [--runs 3] [--duration 15] [--pause 0.2]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from xds_server.envoy.bootstrap import find_envoy, render_bootstrap, write_bootstrap
from xds_server.testing import Fleet, LoadGenerator, ManagedProcess, StandaloneEnvoy, free_port, wait_for
from xds_server.testing._envoy import envoy_process

FAST = {"probation_clean_s": 600.0, "ramp_step_percent": 25, "ramp_step_s": 0.25}


async def _ejected_at(http: aiohttp.ClientSession, admin: str, node: str) -> float | None:
    """Wall time of the replica's first transition of ``node`` to UNHEALTHY, or None."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with http.get(f"{admin}/events", params={"limit": "500"}) as r:
            events = (await r.json())["events"]
        times = [e["time"] for e in events if e["node"] == node and e["to"] == "UNHEALTHY"]
        return min(times) if times else None
    return None


async def one(mode: str, nodes: int, duration_s: float, pause_s: float) -> dict:
    p2, a2 = free_port(), free_port()
    lrs1 = {"peers": [f"127.0.0.1:{p2}"]} if mode == "peers" else {}
    fleet = Fleet(n_nodes=nodes, health=FAST, xds_options={"replica_id": "cp-1"},
                  config_options={"lrs": lrs1}).start()
    r1 = f"127.0.0.1:{fleet.xds_port}"
    cfg2 = fleet.config_dict()
    cfg2.update(xds={"listen": f"127.0.0.1:{p2}", "replica_id": "cp-2"}, admin={"listen": f"127.0.0.1:{a2}"},
                lrs={"peers": [r1]} if mode == "peers" else {})
    assert fleet.workdir is not None
    (fleet.workdir / "cp-2.yaml").write_text(yaml.safe_dump(cfg2, sort_keys=False))
    cp2 = ManagedProcess("cp-2", [sys.executable, "-m", "xds_server.cli", "serve", "--config",
                                  str(fleet.workdir / "cp-2.yaml")], fleet.workdir / "cp-2.log",
                         ready_pattern="admin listening")
    envoy2 = StandaloneEnvoy(p2, node_id="envoy-2")
    tmp = tempfile.TemporaryDirectory(prefix="xds-envoy3-")
    port3, admin3 = free_port(), free_port()
    boot3 = write_bootstrap(Path(tmp.name) / "envoy.yaml", render_bootstrap(
        xds_replicas=(f"127.0.0.1:{p2}", r1), listener_port=port3, admin_port=admin3, cluster="llm",
        node_id="envoy-3"))
    envoy3 = envoy_process(find_envoy(), boot3, Path(tmp.name), concurrency=1)
    admins = {"cp-1": f"http://127.0.0.1:{fleet.admin_port}", "cp-2": f"http://127.0.0.1:{a2}"}
    try:
        cp2.start(30.0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            await envoy2.start()
            envoy3.start()
            await fleet.wait_all_routed(http)

            async def healthy() -> bool:
                for a in admins.values():
                    async with http.get(f"{a}/nodes") as r:
                        if not all(v["state"] == "HEALTHY" for v in (await r.json())["nodes"]):
                            return False
                return True
            await wait_for(healthy, 40, what="every node HEALTHY on both replicas")
            gens = [LoadGenerator(u, concurrency=1, max_tokens=2, pause_s=pause_s)
                    for u in (fleet.url, envoy2.url, f"http://127.0.0.1:{port3}")]
            for g in gens:
                await g.start()
            await asyncio.sleep(2.0)
            bad = fleet.nodes[-1]
            await fleet.set_fault(http, bad.node_id, "user_error")
            t0 = time.time()
            at: dict[str, float | None] = dict.fromkeys(admins)
            while time.time() - t0 < duration_s and None in at.values():
                for r, a in admins.items():
                    if at[r] is None:
                        at[r] = await _ejected_at(http, a, bad.node_id)
                await asyncio.sleep(0.1)
            for g in gens:
                await g.stop()
            streams = {}
            for r, a in admins.items():
                async with http.get(f"{a}/metrics") as resp:
                    text = await resp.text()
                streams[r] = next((int(float(line.split()[-1])) for line in text.splitlines()
                                   if line.startswith("sentinel_lrs_streams ")), 0)
        rel = {r: None if t is None else round(t - t0, 2) for r, t in at.items()}
        t1, t2 = at["cp-1"], at["cp-2"]
        gap = None if t1 is None or t2 is None else round(abs(t1 - t2), 3)
        return {"mode": mode, **{f"{r}_ejected_s": v for r, v in rel.items()}, "gap_s": gap, "lrs_streams": streams}
    finally:
        envoy3.stop()
        tmp.cleanup()
        envoy2.stop()
        cp2.stop()
        fleet.stop()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--duration", type=float, default=15.0, help="s after the fault")
    ap.add_argument("--pause", type=float, default=0.2, help="s between one client's requests")
    ap.add_argument("--modes", default="peers,none")
    a = ap.parse_args()
    print("| run | mode | cp-1 ejects (s) | cp-2 ejects (s) | gap (s) | LRS streams cp-1 / cp-2 |")
    print("|---|---|---:|---:|---:|---:|")
    for run in range(1, a.runs + 1):
        for mode in a.modes.split(","):
            r = await one(mode, a.nodes, a.duration, a.pause)
            cell = ["-" if r[k] is None else f"{r[k]}" for k in ("cp-1_ejected_s", "cp-2_ejected_s", "gap_s")]
            print(f"| {run} | {mode} | {' | '.join(cell)} | {r['lrs_streams']['cp-1']} / {r['lrs_streams']['cp-2']} |",
                  flush=True)


if __name__ == "__main__":
    asyncio.run(main())
