"""The fault matrix's control-plane replica fault (:func:`replica_kill`), on a
:class:`~xds_server.testing._fault_rig.FaultRig` started with ``replicas=2`` (docs/replicas.md:
every agent meets both replicas, Envoy's ``xds_cluster`` lists both, its one ADS stream is on one).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import Any

import aiohttp

from xds_server.testing._fault_rig import FaultRig, FaultRow, _loads, _paths, _warm
from xds_server.testing._fleet import Fleet, restart_control_plane
from xds_server.testing._fleet_watch import ENVOY, FleetWatch, counters_delta, cp_counters, cp_events, left_healthy
from xds_server.testing._wait import wait_for

__all__ = ["replica_kill"]


async def replica_kill(rig: FaultRig, http: aiohttp.ClientSession, times: int = 1, down_s: float = 2.0,
                       **load_kw: Any) -> tuple[list[FaultRow], dict]:
    """kill -9 the control-plane replica that Envoy's ADS stream is on, under mixed traffic, leave
    the other alone for ``down_s`` seconds, start the killed one again (same config, ports and
    state file: :func:`~xds_server.testing._fleet.restart_control_plane`); ``times`` times. After
    each kill: until Envoy's stream is on the survivor with everything ACKed; after each restart:
    until every agent's stream is open on the restarted replica (its ``/nodes``
    ``probe_stream_connected``) and it holds every node HEALTHY (20 s each, AssertionError).

    Expected: no failed request; the survivor keeps every node HEALTHY (no transition, no
    ejection); Envoy routes every node throughout; every agent dials the restarted replica again
    (within its back-off, at most 5 s). Returns the row and ``{"kills": [{"victim": "cp-N",
    "envoy_moved_s" (from the kill to Envoy's stream ACKed on the survivor), "restarted_s" (from
    the kill to the restarted replica's admin up), "agents_back_s" (from then to every agent's stream open
    on it), "healthy_s" (to every node HEALTHY on it), "survivor_states": {node: [states]},
    "survivor": {its counters over the kill, :func:`cp_counters`}, "survivor_events",
    "restarted_events": [its health events from its start, :func:`cp_events`]}],
    "envoy_states_seen": {node: [statuses]}, "unrouted": [nodes Envoy stopped routing],
    "survivor_left_healthy": [nodes]}``. Raises ValueError on a rig with fewer than 2 replicas."""
    fleet = rig.fleet
    assert fleet is not None
    if fleet.replicas < 2:
        raise ValueError("replica_kill needs a rig with replicas=2 or more")
    await rig.heal(http)
    for port in fleet.admin_ports:   # each replica judges on its own: both at every node HEALTHY first
        await wait_for(functools.partial(_all_nodes, fleet, http, port, _healthy), timeout_s=20.0,
                       what=f"every node HEALTHY on the replica with admin port {port}")
    kills: list[dict] = []
    watch = FleetWatch(fleet, http, fleet.admin_ports)
    async with _loads(rig, **load_kw) as loads, watch.running():
        await _warm(loads)
        for _ in range(times):
            kills.append(await _kill_once(rig, http, watch, down_s))
        await rig.heal(http)
    info: dict = {"kills": kills, "envoy_states_seen": watch.seen(ENVOY), "unrouted": watch.left(ENVOY, "HEALTHY"),
                  "survivor_left_healthy": sorted({n for k in kills for n, states in k["survivor_states"].items()
                                                   if states != ["HEALTHY"]}
                                                  | {n for k in kills for n in left_healthy(k["survivor_events"])})}
    moved = [k["envoy_moved_s"] for k in kills]
    back = [k["agents_back_s"] for k in kills]
    rows = [FaultRow("control-plane replica kill -9 + restart", p, times, ld.totals(),
                     notes=f"Envoy on the survivor after {min(moved)}-{max(moved)} s; agents back on the "
                           f"restarted replica {min(back)}-{max(back)} s after it started; survivor: nodes left "
                           f"HEALTHY {len(info['survivor_left_healthy'])}, ejections "
                           f"{sum(k['survivor']['ejections'] for k in kills)}; unrouted by Envoy "
                           f"{len(info['unrouted'])}")
            for p, ld in zip(_paths(rig, loads), loads, strict=True)]
    return rows, info


async def _kill_once(rig: FaultRig, http: aiohttp.ClientSession, watch: FleetWatch, down_s: float) -> dict:
    """One kill and restart of the replica Envoy is on; a dict of :func:`replica_kill`'s ``kills``."""
    fleet = rig.fleet
    assert fleet is not None
    victim = fleet.admin_ports.index(await wait_for(lambda: _envoy_replica(rig, http), timeout_s=20.0,
                                                    what="Envoy synced on a replica"))
    survivor = next(i for i in range(fleet.replicas) if i != victim)
    sport, vport = fleet.admin_ports[survivor], fleet.admin_ports[victim]
    c0 = await cp_counters(http, sport)
    wall0, t0 = time.time(), time.monotonic()
    restart = asyncio.create_task(restart_control_plane(fleet, down_s=down_s, kill=True, replica=victim))
    try:
        await wait_for(lambda: rig.envoy_synced(http, sport), timeout_s=20.0, what="Envoy synced on the survivor")
        moved = time.monotonic() - t0
    finally:
        await restart
    t1 = time.monotonic()
    await wait_for(lambda: _all_nodes(fleet, http, vport, lambda n: n["probe_stream_connected"]), timeout_s=20.0,
                   what="every agent's stream open on the restarted replica")
    back = time.monotonic() - t1
    await wait_for(lambda: _all_nodes(fleet, http, vport, _healthy), timeout_s=20.0,
                   what="every node HEALTHY on the restarted replica")
    healthy = time.monotonic() - t1
    await watch.poll()
    return {"victim": f"cp-{victim}", "envoy_moved_s": round(moved, 3), "restarted_s": round(t1 - t0, 3),
            "agents_back_s": round(back, 3), "healthy_s": round(healthy, 3),
            "survivor_states": watch.during(f"cp:{sport}", t0, time.monotonic()),
            "survivor": counters_delta(c0, await cp_counters(http, sport)),
            "survivor_events": await cp_events(http, sport, wall0),
            "restarted_events": await cp_events(http, vport, wall0)}


async def _envoy_replica(rig: FaultRig, http: aiohttp.ClientSession) -> int | None:
    """The admin port of the replica Envoy's ADS stream is on, ACKed; None while none."""
    assert rig.fleet is not None
    for port in rig.fleet.admin_ports:
        if await rig.envoy_synced(http, port):
            return port
    return None


def _healthy(node: dict) -> bool:
    return node["state"] == "HEALTHY"


async def _all_nodes(fleet: Fleet, http: aiohttp.ClientSession, admin_port: int, pred: Any) -> bool:
    """Whether ``pred`` holds for every node's ``/nodes`` entry on the replica at ``admin_port``."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError, KeyError, ValueError):
        async with http.get(f"http://127.0.0.1:{admin_port}/nodes") as r:
            nodes = (await r.json())["nodes"]
        return len(nodes) == len(fleet.nodes) and all(pred(n) for n in nodes)
    return False
