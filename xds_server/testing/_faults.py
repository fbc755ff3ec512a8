"""The fault matrix over a :class:`~xds_server.testing._fault_rig.FaultRig`
under mixed traffic: each fault a coroutine that strikes, waits for recovery by polling (no
fixed sleeps beyond the fault's own duration) and returns
:class:`~xds_server.testing._fault_rig.FaultRow` values plus a dict of details.
``tests/faults/`` runs each with small counts and asserts the goals; ``benchmarks/fault_matrix.py``
runs them with larger counts and prints the table. The xDS faults (slow reader, stream churn)
are in :mod:`xds_server.testing._ads_faults`.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from xds_server.envoy.bootstrap import find_envoy
from xds_server.process.cancellation import cancel_and_wait
from xds_server.testing._envoy import envoy_process
from xds_server.testing._fault_rig import FaultRig, FaultRow, _loads, _paths, _warm, prometheus_value
from xds_server.testing._fleet import Fleet, restart_control_plane
from xds_server.testing._traffic import TrafficLoad
from xds_server.testing._wait import wait_for

__all__ = ["agent_kill_restart", "cp_kill_restart", "cp_sigstop", "engine_kill_restart", "envoy_restart"]

async def cp_kill_restart(rig: FaultRig, http: aiohttp.ClientSession, times: int = 5,
                          check_ejection: bool = True, **load_kw: Any) -> tuple[list[FaultRow], dict]:
    """kill -9 the control plane and start it again, ``times`` times under load; each restart
    waits until Envoy is re-synced on the new process. With ``check_ejection`` a node is ejected
    first (its engine answers errors) and the first restart must resume it UNHEALTHY from the
    state file (a fresh start would show it WARMING, then route it at its first good probe);
    its engine is healed after that restart. Returns the row and ``{"restart_s": [...],
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
            await wait_for(lambda: _saved_state(fleet, victim) == "UNHEALTHY", timeout_s=5.0,
                           what=f"{victim}'s ejection written to the state file")
        for k in range(times):
            t0 = time.monotonic()
            await restart_control_plane(fleet, down_s=0.0, kill=True)
            if k == 0 and check_ejection:
                # The engine still fails, so a restart that forgot the ejection shows the node
                # WARMING (failures are not counted there); one that kept it, UNHEALTHY.
                nodes = await wait_for(lambda: _nodes_if_heard(fleet, http, victim), timeout_s=10.0,
                                       what=f"{victim} heard by the restarted control plane")
                info["ejection_kept"] = nodes[victim]["state"] == "UNHEALTHY"
                info["victim_routed_during_restart"] = (await fleet.envoy_hosts(http)).get(victim) == "HEALTHY"
                await fleet.set_fault(http, victim, "none")
            await wait_for(lambda: rig.envoy_synced(http), timeout_s=20.0, what="Envoy re-synced")
            info["restart_s"].append(round(time.monotonic() - t0, 2))
    await rig.heal(http)
    rows = [FaultRow("control plane kill -9 + restart", p, times, ld.totals(),
                     notes=f"restart to Envoy re-synced {min(info['restart_s'])}-{max(info['restart_s'])} s; "
                           f"ejection kept across restart: {info['ejection_kept']}")
            for p, ld in zip(_paths(rig, loads), loads, strict=True)]
    return rows, info


def _saved_state(fleet: Fleet, node: str) -> str | None:
    """``node``'s state in the fleet's state file (``state.path``), None when absent."""
    path = Path(fleet.config_dict()["state"]["path"])
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return json.loads(path.read_text())["nodes"][node]["state"]
    return None


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
    showed per node while it ran), ``"ejections"`` and ``"fail_static_episodes"`` (the control
    plane's counters over the fault: its own pause looks like every heartbeat stopping at once)
    and ``"events"`` (its events from the stop on, "node kind from->to: reason", to say why)."""
    fleet = rig.fleet
    assert fleet is not None and fleet.control_plane is not None
    seen: dict[str, set[str]] = {}
    counters0 = await _cp_counters(rig, http)
    wall0 = time.time()
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
    counters1 = await _cp_counters(rig, http)
    info = {"envoy_states_seen": {k: sorted(v) for k, v in seen.items()}, "back_s": round(back_s, 2),
            **{k: int(counters1[k] - counters0[k]) for k in counters0}, "events": await _cp_events(rig, http, wall0)}
    rows = [FaultRow(f"control plane SIGSTOP {stop_s:g} s", p, 1, ld.totals(),
                     notes=f"Envoy host states seen: {info['envoy_states_seen']}; ejections "
                           f"{info['ejections']}, fail-static episodes {info['fail_static_episodes']}")
            for p, ld in zip(_paths(rig, loads), loads, strict=True)]
    return rows, info


async def _cp_events(rig: FaultRig, http: aiohttp.ClientSession, since_wall_s: float) -> list[str]:
    """The control plane's events since ``since_wall_s`` (unix s) as "node kind from->to: reason"."""
    assert rig.fleet is not None
    async with http.get(f"http://127.0.0.1:{rig.fleet.admin_port}/events", params={"limit": "200"}) as r:
        events = (await r.json())["events"]
    return [f"{e['node']} {e['kind']} {e.get('from') or ''}->{e.get('to') or ''}: {e['reason'][:120]}"
            for e in events if e["time"] >= since_wall_s]


async def _cp_counters(rig: FaultRig, http: aiohttp.ClientSession) -> dict[str, float]:
    """The control plane's ejections and fail-static episodes so far (from /metrics)."""
    assert rig.fleet is not None
    async with http.get(f"http://127.0.0.1:{rig.fleet.admin_port}/metrics") as r:
        text = await r.text()
    return {"ejections": prometheus_value(text, "sentinel_node_ejections_total"),
            "fail_static_episodes": prometheus_value(text, "sentinel_health_events_total", kind="fail_static_on")}


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
        await cancel_and_wait(task)


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
            for p, ld in zip(_paths(rig, loads), loads, strict=True)]
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
    control plane's states of the node from the kill to full weight, ``"weights"``: the
    distinct Envoy weights seen while it was in PROBATION, and ``"full_weight"``: its Envoy
    weight once healed."""
    fleet = rig.fleet
    assert fleet is not None
    info: dict = {"states": [], "weights": []}
    rescued0 = await rig.rescued(http)
    async with _loads(rig, relay=True, **load_kw) as loads:
        direct = loads[0]
        await _warm(loads)
        for _ in range(times):
            address = await _victim(rig, http, direct)
            node = next(n for n in fleet.nodes if n.address == address)
            assert node.engine is not None
            states: list[str] = []
            weights: list[int] = []
            os.killpg(node.engine.pid, signal.SIGKILL)
            await wait_for(functools.partial(_state, fleet, http, node.node_id, "UNHEALTHY"), timeout_s=10.0,
                           what=f"{node.node_id} ejected after its engine died")
            states.append("UNHEALTHY")
            await asyncio.to_thread(node.engine.start)
            await wait_for(_recovery(fleet, http, node.node_id, states, weights), timeout_s=30.0, step_s=0.02,
                           what=f"{node.node_id} back to HEALTHY")
            info["states"].append(states)
            info["weights"].append(weights)
            await rig.heal(http)
            info.setdefault("full_weight", []).append((await fleet.envoy_weights(http)).get(node.node_id))
    info["rescued"] = int(await rig.rescued(http) - rescued0)
    rows = [FaultRow("engine kill -9 + restart", p, times, ld.totals(),
                     rescued=info["rescued"] if p != "Envoy" else None,
                     notes=f"states after the kill: {' -> '.join(info['states'][0])}")
            for p, ld in zip(_paths(rig, loads), loads, strict=True)]
    return rows, info


def _recovery(fleet: Fleet, http: aiohttp.ClientSession, node_id: str, states: list[str],
              weights: list[int]) -> Callable[[], Awaitable[bool]]:
    """A poll for :func:`wait_for`: True once ``node_id`` is HEALTHY; appends each new state to
    ``states`` and each distinct weight Envoy routes it with while PROBATION to ``weights``."""
    async def back() -> bool:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError):
            st = (await fleet.cp_nodes(http))[node_id]["state"]
            if st != states[-1]:
                states.append(st)
            if st == "PROBATION":  # a weight Envoy routes with, read while PROBATION before and after
                w = await _routed_weight(fleet, http, node_id)
                if (await fleet.cp_nodes(http))[node_id]["state"] == "PROBATION" and w is not None \
                        and w not in weights:
                    weights.append(w)
            return st == "HEALTHY"
        return False
    return back


async def _routed_weight(fleet: Fleet, http: aiohttp.ClientSession, node_id: str) -> int | None:
    """The weight Envoy routes ``node_id`` with now; None while Envoy does not route it (an
    UNHEALTHY endpoint keeps its full weight in EDS)."""
    hosts, weights = await fleet.envoy_hosts(http), await fleet.envoy_weights(http)
    return weights.get(node_id) if hosts.get(node_id) == "HEALTHY" else None


async def _victim(rig: FaultRig, http: aiohttp.ClientSession, direct: TrafficLoad, timeout_s: float = 10.0) -> str:
    """An engine address with a stream in flight from both paths: one of Envoy's clients (its
    upstream header) and one of the relay's (the relay's own count, ``sentinel_relay_in_flight``:
    its client sees only the header of a stream's first attempt, and a stream about to finish
    was often counted there while none ran on the engine at the kill). Envoy's client is read again
    after the relay's answer: its stream may have ended while the relay was asked (CI once killed
    an engine with no Envoy stream left on it)."""
    async def both() -> str | None:
        for addr, n in list(direct.in_flight.items()):
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                if (n > 0 and addr != "?" and await rig.relay_in_flight(http, addr) >= 1
                        and direct.in_flight.get(addr, 0) > 0):
                    return addr
        return None
    return await wait_for(both, timeout_s=timeout_s, step_s=0.005, what="an engine streaming to both paths")


async def envoy_restart(rig: FaultRig, http: aiohttp.ClientSession, times: int = 1,
                        **load_kw: Any) -> tuple[list[FaultRow], dict]:
    """Restart Envoy as an operator would: drain it gracefully (``POST /drain_listeners?graceful``:
    every response from now carries ``Connection: close``, the listeners close after Envoy's
    1 s drain time), wait until the listener is closed (``listener_manager.listener_stopped``: a
    stop while it still accepts resets connections that carry a request), let the requests in
    flight finish and the clients' connections close
    (``downstream_rq_active`` and ``downstream_cx_active`` 0; connections never used again are
    waited for at most 3 s), stop it, start a new Envoy on the same bootstrap and wait until it
    routes every node. Clients' connects refused in between are retried (nothing was sent), and
    so are connects the closing listener reset before any response (the kernel's backlog had
    completed them, Envoy never accepted them: ``TrafficLoad(resets_as_refused=True)``; seen once
    in a suite on two workers). Returns the row and ``{"down_s": [...]}``."""
    fleet = rig.fleet
    assert fleet is not None and fleet.envoy is not None and fleet.workdir is not None
    admin = f"http://127.0.0.1:{fleet.envoy_admin_port}"
    down: list[float] = []
    async with _loads(rig, resets_as_refused=True, **load_kw) as loads:
        await _warm(loads)
        for _ in range(times):
            t0 = time.monotonic()
            async with http.post(f"{admin}/drain_listeners", params={"graceful": ""}) as r:
                r.raise_for_status()
            await wait_for(functools.partial(_envoy_idle, http, admin, t0), timeout_s=15.0,
                           what="Envoy's listener closed and its requests in flight finished")
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
            for p, ld in zip(_paths(rig, loads), loads, strict=True)]
    return rows, {"down_s": down}


async def _envoy_idle(http: aiohttp.ClientSession, admin: str, t0: float) -> bool:
    """Whether the draining Envoy (admin API ``admin``, drain begun at ``t0``, monotonic s) has
    stopped its listener and finished its requests (its idle connections: given 3 s at most)."""
    async with http.get(f"{admin}/stats",
                        params={"filter": r"downstream_(rq|cx)_active$|listener_stopped$"}) as r:
        text = await r.text()
    stat = {line.split(": ")[0]: int(line.rsplit(": ", 1)[1]) for line in text.strip().splitlines()}
    if stat.get("listener_manager.listener_stopped", 0) < 1:
        return False   # still accepting: a stop now resets the connections it accepts
    idle_cx = stat.get("http.llm_ingress.downstream_cx_active", 0) == 0 or time.monotonic() - t0 > 3.0
    return stat.get("http.llm_ingress.downstream_rq_active", 0) == 0 and idle_cx


async def _listening(url: str) -> bool:
    host, port = url.rsplit("/", 1)[-1].split(":")
    try:
        _, w = await asyncio.open_connection(host, int(port))
    except OSError:
        return False
    w.close()
    return True
