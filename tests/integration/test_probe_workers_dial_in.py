"""Probe workers accept the agents that dial in: `xds-server serve` with probe.workers = 2 and
probe.dial_in.listen, real agent processes (two listed nodes, four that register themselves, one
that claims a cluster nobody serves), a real simulated engine. Every worker listens on the agents'
port (SO_REUSEPORT) and the main process does not; the agents' streams are held by the workers;
a claim is judged and refused by the main process as in one process; a worker killed with SIGKILL
loses no node (its agents dial again and another worker takes them); a frozen agent is still
caught within a few hundred ms afterwards."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path

import aiohttp
import yaml

from xds_server.testing import ManagedProcess, free_port, wait_for

PY = sys.executable
LISTED = ["gpu-a", "gpu-b"]
REGISTERING = ["reg-1", "reg-2", "reg-3", "reg-4"]
ALL = LISTED + REGISTERING


def tcp_sockets(port: int) -> tuple[set[int], set[int]]:
    """(inodes of the sockets listening on ``port``, inodes of the connections accepted on it),
    from /proc/net/tcp and tcp6."""
    listening, accepted = set(), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) != port:
                continue
            (listening if f[3] == "0A" else accepted if f[3] == "01" else set()).add(int(f[9]))
    return listening, accepted


def owners(inodes: set[int], pids: list[int]) -> dict[int, int]:
    """pid -> how many of ``inodes`` it holds open."""
    out = {}
    for pid in pids:
        n = 0
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
            except OSError:
                continue
            n += bool(m and int(m[1]) in inodes)
        out[pid] = n
    return out


def workers_of(cp_pid: int) -> list[int]:
    """The pids of the probe workers whose parent is ``cp_pid``."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            stat, argv = (d / "stat").read_text(), (d / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == cp_pid and b"xds_server.probing.workers._worker" in argv:
            out.append(int(d.name))
    return sorted(out)


async def nodes(http: aiohttp.ClientSession, admin: int) -> dict[str, dict]:
    try:
        async with http.get(f"http://127.0.0.1:{admin}/nodes") as r:
            return {n["id"]: n for n in (await r.json())["nodes"]} if r.status == 200 else {}
    except aiohttp.ClientError:
        return {}


async def metric(http: aiohttp.ClientSession, admin: int, pattern: str) -> float:
    async with http.get(f"http://127.0.0.1:{admin}/metrics") as r:
        assert r.status == 200, r.status
        text = await r.text()
    return sum(float(m[1]) for m in re.finditer(rf"^{pattern} (\S+)$", text, re.M))


async def test_workers_hold_the_agents_streams_and_a_killed_worker_loses_no_node(tmp_path: Path):
    engine, xds, admin, agents_port = free_port(), free_port(), free_port(), free_port()
    cfg = tmp_path / "xds.yaml"
    cfg.write_text(yaml.safe_dump({
        "xds": {"listen": f"127.0.0.1:{xds}"}, "admin": {"listen": f"127.0.0.1:{admin}"},
        # The PING deadline at 400 ms, not 100: this test is about the hand-over. With 100 ms the
        # suite's load (three workers on two cores) once cut a surviving worker's stream 0.8 s after
        # the kill, both ends of it late at once: a verdict on the machine, not on the hand-over.
        # The 100 ms deadline is timed where it is the subject (the dial-in tests, the benchmarks).
        "probe": {"workers": 2, "dial_in": {"listen": f"127.0.0.1:{agents_port}", "ping_timeout": "400ms"},
                  "worker_report_interval": "200ms"},
        "health": {"probation": {"ramp_start_percent": 100, "ramp_step": "100ms"}},
        "clusters": [{"name": "llm", "discovery": {"agents": {"allow": ["*"]}},
                      "nodes": [{"id": n, "address": f"127.0.0.1:{free_port()}"} for n in LISTED]}]}))
    procs: list[ManagedProcess] = []

    def agent(node: str, *extra: str) -> ManagedProcess:
        return ManagedProcess(node, [
            PY, "-m", "node_probe.cli", "--engine-url", f"http://127.0.0.1:{engine}", "--node-id", node,
            "--control-plane", f"127.0.0.1:{agents_port}", "--probe-interval-s", "0.5", "--gpu-interval-s", "0",
            *extra], tmp_path / f"{node}.log", ready_pattern="dialling").start()

    try:
        procs.append(ManagedProcess("sim", [PY, "-m", "node_probe.cli", "sim-engine", "--port", str(engine)],
                                    tmp_path / "sim.log", ready_pattern="listening on").start())
        cp = ManagedProcess("cp", [PY, "-m", "xds_server.cli", "serve", str(cfg)], tmp_path / "cp.log",
                            ready_pattern="admin listening").start()
        procs.append(cp)
        # The agents start once both workers listen: an agent whose first dials are refused backs
        # off (up to 5 s, started over only by a stream held 10 s), and one that re-dials 5 s after
        # the kill below is rightly judged silent (measured: 9 refused dials, back 4.9 s later).
        await wait_for(lambda: len(tcp_sockets(agents_port)[0]) == 2, timeout_s=20, what="both workers listening")
        by_node = {n: agent(n) for n in LISTED}
        by_node.update({n: agent(n, "--cluster", "llm", "--serving-address", f"127.0.0.1:{free_port()}")
                        for n in REGISTERING})
        procs += by_node.values()
        procs.append(agent("stray", "--cluster", "nobody-serves-this", "--serving-address", "127.0.0.1:1"))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            async def all_healthy() -> bool:
                ns = await nodes(http, admin)
                return sorted(ns) == sorted(ALL) and all(
                    n["state"] == "HEALTHY" and n["probe_stream_connected"] for n in ns.values())

            await wait_for(all_healthy, timeout_s=30, what="every node HEALTHY with its stream")
            workers = workers_of(cp.pid)
            assert len(workers) == 2, workers
            listening, accepted = tcp_sockets(agents_port)
            assert owners(listening, [cp.pid, *workers]) == {cp.pid: 0, workers[0]: 1, workers[1]: 1}
            held = owners(accepted, [cp.pid, *workers])
            # the stray agent's connection stays open while it dials again after each refusal (a
            # channel per dial: the last one's close may not have reached the worker yet)
            assert held[cp.pid] == 0 and len(ALL) <= held[workers[0]] + held[workers[1]] <= len(ALL) + 2, held
            refused = r'sentinel_access_refused_total\{[^}]*reason="agent_claim"[^}]*\}'
            await wait_for(lambda: _at_least(http, admin, refused, 1), timeout_s=10, what="the stray claim refused")
            assert await metric(http, admin, r'sentinel_discovery_nodes\{cluster="llm",source="agents"\}') == 4
            assert "stray" not in await nodes(http, admin)

            # the worker holding the most streams is killed: its agents dial again, no node leaves HEALTHY
            busiest = max(workers, key=lambda p: held[p])
            ejected_before = await metric(http, admin, r"sentinel_node_ejections_total\{[^}]*\}")
            os.kill(busiest, signal.SIGKILL)
            seen: set[str] = set()
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3.0:
                seen |= {n["state"] for n in (await nodes(http, admin)).values()}
                await asyncio.sleep(0.05)
            assert seen == {"HEALTHY"}, seen
            await wait_for(all_healthy, timeout_s=10, what="every stream back after the worker's death")
            assert await metric(http, admin, r"sentinel_node_ejections_total\{[^}]*\}") == ejected_before
            assert await metric(http, admin, r'sentinel_probe_worker_restarts_total\{[^}]*\}') == 1
            after = workers_of(cp.pid)
            assert len(after) == 2 and busiest not in after, after
            assert sum(owners(tcp_sockets(agents_port)[1], after).values()) in (len(ALL), len(ALL) + 1)

            # detection still works on the worker that took the nodes over
            victim = by_node[REGISTERING[0]]
            os.kill(victim.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                await wait_for(lambda: _state_is(http, admin, REGISTERING[0], "UNHEALTHY"), timeout_s=5,
                               what="the frozen agent's node UNHEALTHY")
                assert time.monotonic() - t0 < 1.5
                others = await nodes(http, admin)
                assert all(others[n]["state"] == "HEALTHY" for n in ALL if n != REGISTERING[0]), others
            finally:
                os.kill(victim.pid, signal.SIGCONT)
    finally:
        for p in reversed(procs):
            p.stop()


async def _at_least(http: aiohttp.ClientSession, admin: int, pattern: str, n: float) -> bool:
    return await metric(http, admin, pattern) >= n


async def _state_is(http: aiohttp.ClientSession, admin: int, node: str, state: str) -> bool:
    return (await nodes(http, admin)).get(node, {}).get("state") == state
