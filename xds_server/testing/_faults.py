"""The fault matrix (issue 14 item 6) over a local fleet under mixed traffic: each fault a
coroutine that strikes, waits for recovery by polling (no fixed sleeps beyond the fault's own
duration) and returns :class:`FaultRow` values; :class:`FaultRig` is the fleet (3 engines,
agents, xds-server with a state file, a real Envoy) with ``sentinel-relay`` in front.
``tests/faults/`` runs each with small counts and asserts the goals; ``benchmarks/fault_matrix.py``
runs them with larger counts and prints :func:`format_table`. The xDS faults (slow reader,
stream churn) are in :mod:`xds_server.testing._ads_faults`.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from xds_server.testing._envoy import envoy_process
from xds_server.envoy_bootstrap import find_envoy
from xds_server.testing._fleet import Fleet, restart_control_plane
from xds_server.testing._process import ManagedProcess, free_port
from xds_server.testing._traffic import TrafficLoad, TrafficStats
from xds_server.testing._wait import wait_for

__all__ = ["FaultRig", "FaultRow", "format_table", "cp_kill_restart", "cp_sigstop", "agent_kill_restart",
           "engine_kill_restart", "envoy_restart", "prometheus_value"]

TOKEN = "fault-matrix"
#: Health settings of the rig: a 1.5 s half-open period and a 2-step ramp (defaults: 60 s,
#: 1 %/s) so a node's recovery fits in a test; probes every 0.3 s.
FAST_HEALTH = {"probation_clean_s": 1.5, "ramp_step_percent": 50, "ramp_step_s": 0.2}


@dataclass
class FaultRow:
    """One line of the matrix: what the clients on one path saw across ``repeats`` faults."""

    fault: str
    path: str                     # "Envoy" or "relay -> Envoy"
    repeats: int
    stats: TrafficStats
    rescued: int | None = None    # relay rescues that resumed a stream (relay path only)
    notes: str = ""


def format_table(rows: list[FaultRow]) -> str:
    """The matrix as a Markdown table."""
    out = ["| fault | path | times | requests ok / failed | streams whole / cut | rescued | "
           "refused connects (retried) | notes |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        s = r.stats
        fails = f"{s.failed}" + (f" ({dict(s.requests_failed)})" if s.failed else "")
        cuts = f"{s.cut}" + (f" ({dict(s.streams_cut)})" if s.cut else "")
        out.append(f"| {r.fault} | {r.path} | {r.repeats} | {s.requests_ok} / {fails} | {s.streams_ok} / {cuts} | "
                   f"{'-' if r.rescued is None else r.rescued} | {s.refused} | {r.notes} |")
    return "\n".join(out)


def prometheus_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` in a text exposition."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and want <= set(head.partition("{")[2].rstrip("}").split(",")):
            total += float(value)
    return total


@dataclass
class FaultRig:
    """A fleet for the matrix and ``sentinel-relay`` in front of its Envoy. Start with
    :meth:`start` (blocking, a few seconds), always :meth:`stop`."""

    n_nodes: int = 3
    token_interval_ms: float = 10.0
    fleet: Fleet | None = None
    relay: ManagedProcess | None = None
    relay_port: int = 0
    relay_admin_port: int = 0
    _tmp: Any = field(default=None, repr=False)

    def start(self) -> "FaultRig":
        """Start the fleet and the relay; waits until Envoy routes to every node."""
        self._tmp = tempfile.TemporaryDirectory(prefix="xds-faults-")
        wd = Path(self._tmp.name)
        self.fleet = Fleet(
            n_nodes=self.n_nodes, workdir=wd, probe_interval_s=0.3, token_interval_ms=self.token_interval_ms,
            health=FAST_HEALTH, per_try_timeout_s=None, per_try_idle_timeout_s=2.0,
            admin_options={"token": TOKEN},
            config_options={"state": {"path": str(wd / "state.json"), "write_interval_s": 0.2}})
        try:
            self.fleet.start()
            asyncio.run(self._routed())
            self.relay_port, self.relay_admin_port = free_port(), free_port()
            self.relay = ManagedProcess("relay", [
                sys.executable, "-m", "sentinel_relay.cli", "--listen", f"127.0.0.1:{self.relay_port}",
                "--upstream", self.fleet.url, "--routing-feed", f"127.0.0.1:{self.fleet.xds_port}",
                "--admin-listen", f"127.0.0.1:{self.relay_admin_port}", "--ping-interval-s", "0.1",
                "--log-level", "WARNING"], wd / "relay.log", ready_pattern="ready").start()
        except BaseException:
            self.stop()
            raise
        return self

    async def _routed(self) -> None:
        assert self.fleet is not None
        async with aiohttp.ClientSession() as s:
            await self.fleet.wait_all_routed(s)

    def stop(self) -> None:
        """Stop the relay and the fleet (always safe to call)."""
        if self.relay is not None:
            self.relay.stop()
        if self.fleet is not None:
            self.fleet.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    @property
    def relay_url(self) -> str:
        """Base URL of the relay."""
        return f"http://127.0.0.1:{self.relay_port}"

    def load(self, relay: bool = False, **kw: Any) -> TrafficLoad:
        """A (not started) mixed load against Envoy, or the relay when ``relay``."""
        assert self.fleet is not None
        return TrafficLoad(self.relay_url if relay else self.fleet.url, **kw)

    async def heal(self, http: aiohttp.ClientSession, timeout_s: float = 30.0) -> None:
        """Restart dead engines and agents, thaw frozen ones, wait until Envoy routes all nodes
        at full weight."""
        assert self.fleet is not None
        for n in self.fleet.nodes:
            for p in (n.engine, n.agent):
                if p is not None and not p.alive():
                    await asyncio.to_thread(p.start)
                elif p is not None and p.frozen:
                    p.thaw()
        await self.fleet.wait_all_routed(http, timeout_s=timeout_s)
        await wait_for(lambda: self._full_weight(http), timeout_s=timeout_s, step_s=0.05,
                       what="every node back at full weight")

    async def _full_weight(self, http: aiohttp.ClientSession) -> bool:
        assert self.fleet is not None
        nodes = await self.fleet.cp_nodes(http)
        return all(v["state"] == "HEALTHY" for v in nodes.values())

    async def envoy_synced(self, http: aiohttp.ClientSession) -> bool:
        """True when the control plane has an Envoy stream that asked for CDS and EDS and ACKed
        everything sent to it."""
        assert self.fleet is not None
        try:
            async with http.get(f"http://127.0.0.1:{self.fleet.admin_port}/xds/clients") as r:
                clients = (await r.json())["clients"]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return False
        return any(c["node_id"].startswith("envoy-") and len(c["types"]) == 2 and all(
            t["acked_nonce"] == t["last_nonce"] for t in c["types"].values()) for c in clients)

    async def rescued(self, http: aiohttp.ClientSession) -> float:
        """The relay's resumed rescues so far (``sentinel_relay_rescues_total{outcome="resumed"}``)."""
        async with http.get(f"http://127.0.0.1:{self.relay_admin_port}/metrics") as r:
            return prometheus_value(await r.text(), "sentinel_relay_rescues_total", outcome="resumed")


@contextlib.asynccontextmanager
async def _loads(rig: FaultRig, relay: bool = False, **kw: Any):
    loads = [await rig.load(**kw).start()]
    if relay:
        loads.append(await rig.load(relay=True, **kw).start())
    try:
        yield loads
    finally:
        for ld in loads:
            await ld.stop()


async def _warm(loads: list[TrafficLoad], timeout_s: float = 5.0) -> None:
    """Wait until every load has a finished request and a finished stream (traffic flows)."""
    await wait_for(lambda: all(ld.totals().requests_ok and ld.totals().streams_ok for ld in loads),
                   timeout_s=timeout_s, what="traffic flowing")


def _paths(rig: FaultRig, loads: list[TrafficLoad]) -> list[str]:
    return ["Envoy" if ld.base == rig.fleet.url else "relay -> Envoy" for ld in loads]  # type: ignore[union-attr]


async def cp_kill_restart(rig: FaultRig, http: aiohttp.ClientSession, times: int = 5,
                          check_ejection: bool = True, **load_kw: Any) -> tuple[list[FaultRow], dict]:
    """kill -9 the control plane and start it again, ``times`` times under load; each restart
    waits until Envoy is re-synced on the new process. With ``check_ejection`` a node is ejected
    first (engine errors), its engine healed, and the first restart must resume it UNHEALTHY
    (state file) instead of routing it again. Returns the row and ``{"restart_s": [...],
    "ejection_kept": bool | None, "victim_routed_during_restart": bool}``."""
    fleet = rig.fleet
    assert fleet is not None
    info: dict = {"restart_s": [], "ejection_kept": None, "victim_routed_during_restart": False}
    victim = fleet.nodes[-1].node_id
    async with _loads(rig, **load_kw) as loads:
        await _warm(loads)
        if check_ejection:
            await fleet.set_fault(http, victim, "error")
            await wait_for(lambda: _state(fleet, http, victim, "UNHEALTHY"), timeout_s=10.0,
                           what=f"{victim} ejected")
            await fleet.set_fault(http, victim, "none")
            # the next state write (state.write_interval_s, 0.2 s) holds the ejection
            await asyncio.sleep(0.5)
        for k in range(times):
            t0 = time.monotonic()
            await restart_control_plane(fleet, down_s=0.0, kill=True)
            if k == 0 and check_ejection:
                nodes = await wait_for(lambda: _nodes_if_heard(fleet, http, victim), timeout_s=10.0,
                                       what=f"{victim} heard by the restarted control plane")
                info["ejection_kept"] = nodes[victim]["state"] == "UNHEALTHY"
                info["victim_routed_during_restart"] = (await fleet.envoy_hosts(http)).get(victim) == "HEALTHY"
            await wait_for(lambda: rig.envoy_synced(http), timeout_s=20.0, what="Envoy re-synced")
            info["restart_s"].append(round(time.monotonic() - t0, 2))
    await rig.heal(http)
    rows = [FaultRow("control plane kill -9 + restart", p, times, ld.totals(),
                     notes=f"restart to Envoy re-synced {min(info['restart_s'])}-{max(info['restart_s'])} s; "
                           f"ejection kept across restart: {info['ejection_kept']}")
            for p, ld in zip(_paths(rig, loads), loads)]
    return rows, info


async def _state(fleet: Fleet, http: aiohttp.ClientSession, node: str, state: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError):
        return (await fleet.cp_nodes(http))[node]["state"] == state
    return False


async def _nodes_if_heard(fleet: Fleet, http: aiohttp.ClientSession, node: str) -> dict | None:
    """The restarted control plane's /nodes once ``node`` has left COLD (its first heartbeat,
    where a saved state is resumed)."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError):
        nodes = await fleet.cp_nodes(http)
        if nodes[node]["state"] != "COLD":
            return nodes
    return None


async def cp_sigstop(rig: FaultRig, http: aiohttp.ClientSession, stop_s: float = 5.0,
                     **load_kw: Any) -> tuple[list[FaultRow], dict]:
    """SIGSTOP the control plane for ``stop_s`` seconds, SIGCONT, wait until every node is
    HEALTHY and Envoy re-synced. Returns the row and ``{"envoy_states_seen": {...}}`` (what Envoy
    showed per node while it ran)."""
    fleet = rig.fleet
    assert fleet is not None and fleet.control_plane is not None
    seen: dict[str, set[str]] = {}
    async with _loads(rig, **load_kw) as loads, _watch_envoy(fleet, http, seen):
        await _warm(loads)
        fleet.control_plane.freeze()
        try:
            await asyncio.sleep(stop_s)
        finally:
            fleet.control_plane.thaw()
        t0 = time.monotonic()
        await wait_for(lambda: rig.envoy_synced(http), timeout_s=20.0, what="Envoy re-synced")
        await rig.heal(http)
        back_s = time.monotonic() - t0
    info = {"envoy_states_seen": {k: sorted(v) for k, v in seen.items()}, "back_s": round(back_s, 2)}
    rows = [FaultRow(f"control plane SIGSTOP {stop_s:g} s", p, 1, ld.totals(),
                     notes=f"Envoy host states seen: {info['envoy_states_seen']}")
            for p, ld in zip(_paths(rig, loads), loads)]
    return rows, info


@contextlib.asynccontextmanager
async def _watch_envoy(fleet: Fleet, http: aiohttp.ClientSession, seen: dict[str, set[str]]):
    """Record every host status Envoy shows (node -> statuses) while the block runs."""
    async def watch() -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                for node, st in (await fleet.envoy_hosts(http)).items():
                    seen.setdefault(node, set()).add(st)
            await asyncio.sleep(0.05)
    task = asyncio.create_task(watch())
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def agent_kill_restart(rig: FaultRig, http: aiohttp.ClientSession, times: int = 1,
                             **load_kw: Any) -> tuple[list[FaultRow], dict]:
    """kill -9 one node's agent (node_probe), wait until Envoy stops routing the node, start the
    agent again and wait until the node is back at full weight; ``times`` times."""
    fleet = rig.fleet
    assert fleet is not None
    node = fleet.nodes[0]
    excluded: list[float] = []
    async with _loads(rig, **load_kw) as loads:
        await _warm(loads)
        for _ in range(times):
            assert node.agent is not None
            t0 = time.monotonic()
            os.killpg(node.agent.pid, signal.SIGKILL)
            await wait_for(lambda: _envoy_status(fleet, http, node.node_id, lambda s: s != "HEALTHY"),
                           timeout_s=10.0, what=f"{node.node_id} excluded after its agent died")
            excluded.append(round(time.monotonic() - t0, 2))
            await rig.heal(http)
    rows = [FaultRow("agent kill -9 + restart", p, times, ld.totals(),
                     notes=f"node excluded by Envoy after {min(excluded)}-{max(excluded)} s")
            for p, ld in zip(_paths(rig, loads), loads)]
    return rows, {"excluded_s": excluded}


async def _envoy_status(fleet: Fleet, http: aiohttp.ClientSession, node: str, pred: Any) -> bool:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
        return bool(pred((await fleet.envoy_hosts(http)).get(node)))
    return False


async def engine_kill_restart(rig: FaultRig, http: aiohttp.ClientSession, times: int = 1,
                              **load_kw: Any) -> tuple[list[FaultRow], dict]:
    """kill -9 an engine that has streams in flight from both paths (Envoy alone and the relay),
    start it again and follow its recovery to full weight; ``times`` times. Returns the rows
    (one per path; the relay's with its resumed rescues) and ``{"states": [[...], ...]}``: the
    control plane's states of the node from the kill to full weight, and ``"weights"``: the
    distinct Envoy weights seen while it came back."""
    fleet = rig.fleet
    assert fleet is not None
    info: dict = {"states": [], "weights": []}
    rescued0 = await rig.rescued(http)
    async with _loads(rig, relay=True, **load_kw) as loads:
        direct, relayed = loads
        await _warm(loads)
        for _ in range(times):
            address = await _victim(direct, relayed)
            node = next(n for n in fleet.nodes if n.address == address)
            assert node.engine is not None
            states: list[str] = []
            weights: list[int] = []
            os.killpg(node.engine.pid, signal.SIGKILL)
            await wait_for(lambda: _state(fleet, http, node.node_id, "UNHEALTHY"), timeout_s=10.0,
                           what=f"{node.node_id} ejected after its engine died")
            states.append("UNHEALTHY")
            await asyncio.to_thread(node.engine.start)

            async def back() -> bool:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError):
                    st = (await fleet.cp_nodes(http))[node.node_id]["state"]
                    if st != states[-1]:
                        states.append(st)
                    w = (await fleet.envoy_weights(http)).get(node.node_id)
                    if st == "PROBATION" and w is not None and w not in weights:
                        weights.append(w)
                    return st == "HEALTHY"
                return False
            await wait_for(back, timeout_s=30.0, step_s=0.02, what=f"{node.node_id} back to HEALTHY")
            info["states"].append(states)
            info["weights"].append(weights)
            await rig.heal(http)
    info["rescued"] = int(await rig.rescued(http) - rescued0)
    rows = [FaultRow("engine kill -9 + restart", p, times, ld.totals(),
                     rescued=info["rescued"] if p != "Envoy" else None,
                     notes=f"states after the kill: {' -> '.join(info['states'][0])}")
            for p, ld in zip(_paths(rig, loads), loads)]
    return rows, info


async def _victim(direct: TrafficLoad, relayed: TrafficLoad, timeout_s: float = 10.0) -> str:
    """An engine address with a stream in flight from both loads (the relay's client sees
    Envoy's upstream header of the first attempt)."""
    def both() -> str | None:
        for addr, n in direct.in_flight.items():
            if n > 0 and addr != "?" and relayed.in_flight.get(addr, 0) > 0:
                return addr
        return None
    return await wait_for(both, timeout_s=timeout_s, step_s=0.005, what="an engine streaming to both paths")


async def envoy_restart(rig: FaultRig, http: aiohttp.ClientSession, times: int = 1,
                        **load_kw: Any) -> tuple[list[FaultRow], dict]:
    """Restart Envoy as an operator would: stop its listeners (``POST /drain_listeners``), let
    the requests in flight finish (``downstream_rq_active`` 0, bounded), stop it, start a new
    Envoy on the same bootstrap and wait until it routes every node. Clients' connects refused
    in between are retried (nothing was sent). Returns the row and ``{"down_s": [...]}``."""
    fleet = rig.fleet
    assert fleet is not None and fleet.envoy is not None and fleet.workdir is not None
    admin = f"http://127.0.0.1:{fleet.envoy_admin_port}"
    down: list[float] = []
    async with _loads(rig, **load_kw) as loads:
        await _warm(loads)
        for _ in range(times):
            t0 = time.monotonic()
            async with http.post(f"{admin}/drain_listeners") as r:
                r.raise_for_status()

            async def idle() -> bool:
                async with http.get(f"{admin}/stats", params={"filter": r"downstream_rq_active$"}) as r:
                    text = await r.text()
                return all(line.rsplit(": ", 1)[1] == "0" for line in text.strip().splitlines()
                           if line.startswith("http.llm_ingress."))
            await wait_for(idle, timeout_s=15.0, what="Envoy's requests in flight finished")
            old = fleet.envoy
            await asyncio.to_thread(old.stop)
            new = envoy_process(find_envoy(fleet.envoy_binary), fleet.workdir / "envoy.yaml", fleet.workdir,
                                concurrency=2)
            fleet.procs[fleet.procs.index(old)] = new
            fleet.envoy = new
            await asyncio.to_thread(new.start)
            await fleet.wait_all_routed(http, timeout_s=20.0)
            await wait_for(lambda: _listening(fleet.url), timeout_s=10.0, what="Envoy's listener up")
            down.append(round(time.monotonic() - t0, 2))
    rows = [FaultRow("Envoy restart (drain, stop, start)", p, times, ld.totals(),
                     notes=f"drain to routing again {min(down)}-{max(down)} s")
            for p, ld in zip(_paths(rig, loads), loads)]
    return rows, {"down_s": down}


async def _listening(url: str) -> bool:
    host, port = url.rsplit("/", 1)[-1].split(":")
    try:
        _, w = await asyncio.open_connection(host, int(port))
    except OSError:
        return False
    w.close()
    return True
