"""Agents dial every control-plane replica: one real agent process holding a stream to each of two
``xds-server`` processes, a real simulated engine. A replica killed with SIGKILL takes nothing from
the other: the node stays HEALTHY there throughout, its stream never ends, and the agent dials the
dead replica again with back-off until it is back, when the restarted replica routes the node too.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import yaml

from xds_server.testing import ManagedProcess, free_port, wait_for

PY = sys.executable


async def _node(http: aiohttp.ClientSession, admin: int) -> dict | None:
    try:
        async with http.get(f"http://127.0.0.1:{admin}/nodes/gpu-a") as r:
            return await r.json() if r.status == 200 else None
    except aiohttp.ClientError:
        return None


async def test_a_replica_killed_takes_nothing_from_the_other_and_the_agent_dials_it_again(tmp_path: Path):
    engine, xds, admin = free_port(), [free_port(), free_port()], [free_port(), free_port()]
    procs: list[ManagedProcess] = []

    def replica(i: int) -> ManagedProcess:
        cfg = tmp_path / f"xds-{i}.yaml"
        cfg.write_text(yaml.safe_dump({
            "xds": {"listen": f"127.0.0.1:{xds[i]}", "replica_id": f"cp-{i}"},
            "admin": {"listen": f"127.0.0.1:{admin[i]}"},
            "health": {"probation": {"ramp_start_percent": 100, "ramp_step": "100ms"}},
            "clusters": [{"name": "llm", "nodes": [{"id": "gpu-a", "address": f"127.0.0.1:{engine}"}]}]}))
        return ManagedProcess(f"cp-{i}", [PY, "-m", "xds_server.cli", "serve", str(cfg)], tmp_path / f"cp-{i}.log",
                              ready_pattern="admin listening").start()

    try:
        procs.append(ManagedProcess("sim", [PY, "-m", "node_probe.cli", "sim-engine", "--port", str(engine)],
                                    tmp_path / "sim.log", ready_pattern="listening on").start())
        procs += [replica(0), replica(1)]
        procs.append(ManagedProcess("agent", [
            PY, "-m", "node_probe.cli", "--engine-url", f"http://127.0.0.1:{engine}", "--node-id", "gpu-a",
            "--control-plane", f"127.0.0.1:{xds[0]},127.0.0.1:{xds[1]}", "--probe-interval-s", "0.3",
            "--gpu-interval-s", "0"], tmp_path / "agent.log", ready_pattern="dialling").start())
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            for a in admin:
                await wait_for(lambda a=a: _healthy(http, a), timeout_s=20, what=f"gpu-a HEALTHY on :{a}")
            survivor = await _node(http, admin[1])
            assert survivor is not None
            os.kill(procs[1].pid, signal.SIGKILL)   # replica cp-0, no goodbye
            states = set()
            for _ in range(30):  # 3 s watching the survivor
                n = await _node(http, admin[1])
                assert n is not None
                states.add(n["state"])
                await asyncio.sleep(0.1)
            assert states == {"HEALTHY"}, states
            procs[1] = replica(0)   # back: the agent's back-off finds it
            await wait_for(lambda: _healthy(http, admin[0]), timeout_s=20, what="gpu-a HEALTHY on the restarted")
            after = await _node(http, admin[1])
            assert after is not None and after["state"] == "HEALTHY"
    finally:
        for p in reversed(procs):
            p.stop()


async def _healthy(http: aiohttp.ClientSession, admin: int) -> bool:
    n = await _node(http, admin)
    return n is not None and n["state"] == "HEALTHY"
