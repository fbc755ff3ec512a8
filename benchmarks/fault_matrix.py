"""The fault matrix (issue 14 item 6) with full counts, printed as the table in
benchmarks/RESULTS.md. One rig: 3 simulated engines (10 ms/token) with agents, xds-server with a
state file, the real Envoy, ``sentinel-relay`` in front; mixed traffic (non-streaming and SSE
completions, a few in flight) through Envoy, and through the relay too for the engine kill.
The faults are the coroutines of ``xds_server.testing`` that ``tests/faults/`` runs with small
counts. ``replica_kill`` runs on a second rig, started after the first is stopped, with two
control-plane replicas (docs/replicas.md); the dial-in rows (``cpu_burners``, ``agent_loop_block``,
``replica_kill``) are meant for ``--agents dial-in``, and run either way.

    .venv/bin/python benchmarks/fault_matrix.py [--cp-kills 5] [--sigstop-s 5] [--agent-kills 3]
        [--engine-kills 5] [--envoy-restarts 3] [--fast-readers 100] [--changes 20]
        [--churn 5000] [--burn-s 30] [--block-s 0.5 3] [--replica-kills 3]
        [--api-type GRPC|DELTA_GRPC] [--agents dial|dial-in] [--only FAULT ...] [--json FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from xds_server.testing import (
    FaultRig,
    ads_stream_churn,
    agent_kill_restart,
    agent_loop_block,
    cp_kill_restart,
    cp_sigstop,
    cpu_burners,
    engine_kill_restart,
    envoy_restart,
    format_table,
    replica_kill,
    slow_ads_reader,
)

FAULTS = ("cp_kill cp_sigstop agent_kill engine_kill envoy_restart slow_reader churn cpu_burners agent_loop_block "
          "replica_kill").split()
ON_REPLICAS = {"replica_kill"}  # run on the rig with two control-plane replicas


def make_plan(a: argparse.Namespace) -> list[tuple[str, Callable[..., Any], dict]]:
    """(name, fault coroutine, its keyword arguments) in the matrix's order, ``--only`` applied."""
    plan = [
        ("cp_kill", cp_kill_restart, {"times": a.cp_kills}),
        ("cp_sigstop", cp_sigstop, {"stop_s": a.sigstop_s}),
        ("agent_kill", agent_kill_restart, {"times": a.agent_kills}),
        ("engine_kill", engine_kill_restart, {"times": a.engine_kills, "stream_tokens": 100}),
        ("envoy_restart", envoy_restart, {"times": a.envoy_restarts}),
        ("slow_reader", slow_ads_reader, {"fast": a.fast_readers, "changes": a.changes}),
        ("churn", ads_stream_churn, {"streams": a.churn}),
        ("cpu_burners", cpu_burners, {"burn_s": a.burn_s}),
        ("agent_loop_block", agent_loop_block, {"block_s": tuple(a.block_s)}),
        ("replica_kill", replica_kill, {"times": a.replica_kills}),
    ]
    assert [name for name, _, _ in plan] == FAULTS
    if a.only:
        unknown = set(a.only) - set(FAULTS)
        if unknown:
            raise SystemExit(f"--only: unknown fault(s) {sorted(unknown)}")
        plan = [p for p in plan if p[0] in a.only]
    return plan


async def main(plan: list, rig: FaultRig) -> tuple[list, dict]:
    rows: list = []
    infos: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for name, fn, kw in plan:
            t0 = time.monotonic()
            r, info = await fn(rig, http, **kw)
            info["wall_s"] = round(time.monotonic() - t0, 1)
            rows += r
            infos[name] = info
            print(name, json.dumps(info, default=str), flush=True)
    return rows, infos


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp-kills", type=int, default=5)
    ap.add_argument("--sigstop-s", type=float, default=5.0)
    ap.add_argument("--agent-kills", type=int, default=3)
    ap.add_argument("--engine-kills", type=int, default=5)
    ap.add_argument("--envoy-restarts", type=int, default=3)
    ap.add_argument("--fast-readers", type=int, default=100)
    ap.add_argument("--changes", type=int, default=20)
    ap.add_argument("--churn", type=int, default=5000)
    ap.add_argument("--burn-s", type=float, default=30.0,
                    help="cpu_burners: seconds two busy-loop processes run beside the fleet under traffic")
    ap.add_argument("--block-s", type=float, nargs="+", default=[0.5, 3.0], metavar="S",
                    help="agent_loop_block: one block of the first agent's event loop per value, in order (s; "
                    "the default checks one under the 3 s silence bound and one at it)")
    ap.add_argument("--replica-kills", type=int, default=3,
                    help="replica_kill: kill -9 + restart of the replica Envoy is on, this many times")
    ap.add_argument("--only", nargs="+", default=None, metavar="FAULT", help=f"run only these: {' '.join(FAULTS)}")
    ap.add_argument("--liveness", choices=("heartbeat", "transport"), default="heartbeat",
                    help="probe.liveness of the control plane (issue 24)")
    ap.add_argument("--agents", choices=("dial", "dial-in"), default="dial",
                    help="dial: the control plane dials each agent (probe_address); dial-in: each agent dials "
                    "the control plane and the server's keepalive PINGs are its liveness")
    ap.add_argument("--json", default=None, help="also write the rows and details here")
    ap.add_argument("--api-type", choices=("GRPC", "DELTA_GRPC"), default="GRPC",
                    help="Envoy's ADS flavour: GRPC (state of the world, default) or DELTA_GRPC")
    args = ap.parse_args()
    steps = make_plan(args)
    rows, infos = [], {}
    for replicas in (1, 2):   # one rig at a time: the second only for the replica rows
        todo = [s for s in steps if (s[0] in ON_REPLICAS) == (replicas == 2)]
        if not todo:
            continue
        rig = FaultRig(api_type=args.api_type, agents=args.agents, replicas=replicas,
                       config_options={"probe": {"liveness": args.liveness}}).start()
        try:
            r, i = asyncio.run(main(todo, rig))
        finally:
            rig.stop()
        rows += r
        infos.update(i)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [
            {"fault": r.fault, "path": r.path, "times": r.repeats, "requests_ok": r.stats.requests_ok,
             "requests_failed": dict(r.stats.requests_failed), "streams_ok": r.stats.streams_ok,
             "streams_cut": dict(r.stats.streams_cut), "rescued": r.rescued, "refused": r.stats.refused}
            for r in rows], "details": infos}, indent=1, default=str))
