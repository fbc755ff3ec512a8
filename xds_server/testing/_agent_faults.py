"""Faults of the fault matrix on the nodes' side of a dial-in fleet (each agent dials the control
plane; the server's HTTP/2 keepalive PINGs are its liveness): CPU burners beside everything
(:func:`cpu_burners`) and an agent whose Python event loop hangs while its process and gRPC's
C-core threads keep answering PINGs (:func:`agent_loop_block`). Each runs on a
:class:`~xds_server.testing._fault_rig.FaultRig` under mixed traffic through Envoy and returns its
:class:`~xds_server.testing._fault_rig.FaultRow` values and a dict of details, as the faults of
:mod:`xds_server.testing._faults`. They run in either ``agents`` mode; their expected outcomes
(the docstrings) are the dial-in mode's.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from typing import Any

import aiohttp

from xds_server.config import parse_config
from xds_server.probing.liveness import silent_after_s
from xds_server.testing._fault_rig import BLOCKABLE_AGENT, FaultRig, FaultRow, _loads, _paths, _warm
from xds_server.testing._fleet import Fleet
from xds_server.testing._fleet_watch import ENVOY, FleetWatch, counters_delta, cp_counters, cp_events, left_healthy
from xds_server.testing._proc_cpu import process_cpu_s
from xds_server.testing._process import ManagedProcess
from xds_server.testing._traffic import TrafficStats
from xds_server.testing._wait import wait_for

__all__ = ["agent_loop_block", "cpu_burners"]

BURNER = "while True: pass"
"""The busy loop each CPU burner runs (``python -c``)."""


async def cpu_burners(rig: FaultRig, http: aiohttp.ClientSession, burn_s: float = 30.0, burners: int = 2,
                      **load_kw: Any) -> tuple[list[FaultRow], dict]:
    """``burners`` busy-loop processes (``python -c 'while True: pass'``, each a
    :class:`~xds_server.testing._process.ManagedProcess`, stopped by its PID also on failure) run
    for ``burn_s`` seconds while mixed traffic flows through Envoy; on a 2-core host two of them
    leave the fleet, Envoy and the control plane a share of the cores. Afterwards the rig is healed
    (every node HEALTHY and routed at full weight; raises AssertionError if not within 30 s, or
    after ``health.outlier.ejection_max`` more when a node was outlier-ejected).

    Expected: no node leaves HEALTHY on the control plane, Envoy routes every host throughout, no
    failed request, no fail-static episode. Returns the row and ``{"burn_s", "burners",
    "burner_cpu_s": [CPU s each burner used], "load_avg_1m", "cp_states_seen": {node: [states in
    order]}, "envoy_states_seen": {node: [statuses]}, "left_healthy": [nodes], "unrouted": [nodes],
    "ejections", "fail_static_episodes", "drops_node", "drops_redialled", "drops_burst"`` (the
    control plane's counters over the fault: dial-in streams ended under it, by verdict), and
    ``"events"``: its health events from the first burner on, as :func:`cp_events`}``
    (``left_healthy``: nodes that left HEALTHY or were ejected by the cluster policy)."""
    fleet = rig.fleet
    assert fleet is not None and fleet.workdir is not None
    port = fleet.admin_port
    await rig.heal(http)   # every node HEALTHY first: a node still ramping up is not one that left
    c0 = await cp_counters(http, port)
    watch = FleetWatch(fleet, http, [port])
    procs: list[ManagedProcess] = []
    async with _loads(rig, **load_kw) as loads, watch.running():
        await _warm(loads)
        wall0 = time.time()
        try:
            for i in range(burners):
                procs.append(ManagedProcess(f"cpu-burner-{i}", [sys.executable, "-c", BURNER],
                                            fleet.workdir / f"cpu-burner-{i}.log").start())
            await asyncio.sleep(burn_s)
            used = [round(process_cpu_s(p.pid), 1) for p in procs]
            load_avg = os.getloadavg()[0]
        finally:
            for p in procs:
                p.stop(timeout_s=1.0)
        await _heal(rig, http, await cp_events(http, port, wall0))
    events = await cp_events(http, port, wall0)
    info: dict = {"burn_s": burn_s, "burners": burners, "burner_cpu_s": used, "load_avg_1m": round(load_avg, 2),
                  "cp_states_seen": watch.seen(f"cp:{port}"), "envoy_states_seen": watch.seen(ENVOY),
                  "left_healthy": sorted(set(left_healthy(events)) | set(watch.left(f"cp:{port}", "HEALTHY"))),
                  "unrouted": watch.left(ENVOY, "HEALTHY"),
                  **counters_delta(c0, await cp_counters(http, port)), "events": events}
    rows = [FaultRow(f"{burners} CPU burners {burn_s:g} s", p, 1, ld.totals(),
                     notes=f"nodes left HEALTHY: {len(info['left_healthy'])}, unrouted by Envoy: "
                           f"{len(info['unrouted'])}; ejections {info['ejections']}, fail-static episodes "
                           f"{info['fail_static_episodes']}; stream drops node/redialled/burst "
                           f"{info['drops_node']}/{info['drops_redialled']}/{info['drops_burst']}; "
                           f"burners used {sum(used):g} CPU s, load avg {info['load_avg_1m']}")
            for p, ld in zip(_paths(rig, loads), loads, strict=True)]
    return rows, info




def silence_bound_s(fleet: Fleet) -> float:
    """Seconds an agent's probe stream may go without a heartbeat before the control plane ends
    it (:func:`~xds_server.probing.liveness.silent_after_s` of the fleet's config; a dial-in
    stream is always judged by its transport: three ``probe.transport.telemetry_refresh``, at
    least ``probe.channel.silent_stream_redial``)."""
    probe = parse_config(fleet.config_dict()).probe
    if fleet.agents != "dial":
        probe = probe.model_copy(update={"liveness": "transport"})
    return silent_after_s(probe)


async def agent_loop_block(rig: FaultRig, http: aiohttp.ClientSession, block_s: tuple[float, ...] = (0.5, 3.0),
                           **load_kw: Any) -> tuple[list[FaultRow], dict]:
    """Block the first node's agent's Python event loop once per duration in ``block_s`` (s, in
    order) under mixed traffic: the rig runs that agent through
    :mod:`xds_server.testing._blockable_agent`, so a SIGUSR1 makes its main thread sleep while its
    process, its engine and gRPC's C-core threads (which answer the control plane's PINGs) run
    on. Each block is watched for ``max(block, bound) + 1.5`` s (bound: :func:`silence_bound_s`,
    3 s by default) and the rig healed after it.

    Expected in dial-in mode: a block well under the bound (0.5 s) changes nothing (the node stays
    HEALTHY and routed, its stream stays open, the agent does not dial again). The bound counts
    from the agent's last heartbeat, which came up to one telemetry refresh before the block: a
    block of ``bound - refresh`` or more may get the silent stream ended, the node judged by its
    silence (heartbeat misses count from then: UNHEALTHY after ``health.heartbeat.consecutive_misses``
    intervals unless the woken agent's new stream is heard first) and routed again after its
    half-open period; a block past the bound + those misses always does. No failed request
    through Envoy either way. Measured: a 0.5 s block keeps the stream, but its late samples change
    the node in about one block of five (7 of 32): the control plane's RTT ping (every second) is
    answered by the agent's loop, so one sent during the block measures it (EWMA RTT 60-110 ms
    against a 2 ms median: ``health.outlier`` ejects the node, 30 s, doubling at each repeat), and
    a probe in flight measures a TTFT of the block's length (DEGRADED until 3 good probes). The
    rig is then healed after the ejection (given up to ``outlier.ejection_max`` more).

    Returns one row per block (the traffic while it was watched and healed) and ``{"bound_s",
    "blocks": [{"block_s", "left_healthy_s" (from the signal to the control plane's transition away
    from HEALTHY or its outlier ejection, by its event time; None when neither), "to" (the state, or
    ``outlier_ejected``), "reason", "unrouted_s" (to Envoy
    no longer routing the node, polled every 50 ms), "healthy_again_s", "routed_again_s",
    "states": [control-plane states in order], "envoy_states", "events": [the node's health
    events, "T KIND FROM->TO: REASON"], "heal_s" (from the end of the watch to the rig healed),
    "stream_ends": [why the control plane ended the node's stream meanwhile, from its log],
    "stream_closed": bool (it ended one, or its /nodes showed none open), "agent_dials": streams
    the agent opened meanwhile}]}``.
    Raises ValueError when the first node's agent does not run :data:`BLOCKABLE_AGENT`."""
    fleet = rig.fleet
    assert fleet is not None
    node = fleet.nodes[0]
    if node.agent is None or BLOCKABLE_AGENT not in node.agent.argv:
        raise ValueError(f"{node.node_id}'s agent does not run {BLOCKABLE_AGENT}: nothing can block its loop")
    bound = silence_bound_s(fleet)
    await rig.heal(http)
    blocks: list[dict] = []
    phases = [f"block {i}" for i in range(len(block_s))]
    async with _loads(rig, **load_kw) as loads:
        for ld in loads:
            ld.phase(phases[0])
        await _warm(loads)
        for d, phase in zip(block_s, phases, strict=True):
            for ld in loads:
                ld.phase(phase)
            watch = FleetWatch(fleet, http, [fleet.admin_port])
            async with watch.running():
                blocks.append(await _block_once(rig, http, watch, d, bound))
    rows = []
    for i, (phase, b) in enumerate(zip(phases, blocks, strict=True)):
        for p, ld in zip(_paths(rig, loads), loads, strict=True):
            stats = TrafficStats()
            stats.add(ld.phases[phase])
            if i == 0:
                stats.add(ld.phases["start"])
            rows.append(FaultRow(f"agent event loop blocked {b['block_s']:g} s", p, 1, stats, notes=_block_note(b)))
    return rows, {"bound_s": bound, "blocks": blocks}


async def _block_once(rig: FaultRig, http: aiohttp.ClientSession, watch: FleetWatch, block_s: float,
                      bound_s: float) -> dict:
    """One block of ``block_s`` s on the first node's agent, watched by ``watch``; the dict of
    :func:`agent_loop_block`'s ``blocks``."""
    fleet = rig.fleet
    assert fleet is not None
    node = fleet.nodes[0]
    assert node.agent is not None
    nid, port = node.node_id, fleet.admin_port
    dials0, ends0 = _agent_dials(node.agent), len(_stream_ends(fleet, nid))
    rig.block_file.write_text(f"{block_s}")
    wall0, t0 = time.time(), time.monotonic()
    os.kill(node.agent.pid, signal.SIGUSR1)
    await asyncio.sleep(max(block_s, bound_s) + 1.5)
    t_healed = time.monotonic()
    await _heal(rig, http, await cp_events(http, port, wall0))
    await wait_for(lambda: _stream_open(fleet, http, nid), timeout_s=10.0, what=f"{nid}'s agent stream open")
    await watch.poll()
    events = [e for e in await cp_events(http, port, wall0) if e["node"] == nid]
    left = next((e for e in events if left_healthy([e])), None)
    back = next((e for e in events if left is not None and e["t"] >= left["t"] and (
        (e["kind"] == "transition" and e["to"] == "HEALTHY") or e["kind"] == "outlier_returned")), None)
    unrouted = watch.first(ENVOY, nid, lambda s: s != "HEALTHY", t0)
    routed = watch.first(ENVOY, nid, lambda s: s == "HEALTHY", unrouted) if unrouted is not None else None
    return {"block_s": block_s, "left_healthy_s": left["t"] if left else None,
            "to": (left["to"] or left["kind"]) if left else None,
            "reason": left["reason"] if left else None, "unrouted_s": _since(unrouted, t0),
            "healthy_again_s": back["t"] if back else None, "routed_again_s": _since(routed, t0),
            "states": watch.seen(f"cp:{port}").get(nid, []), "envoy_states": watch.seen(ENVOY).get(nid, []),
            "stream_ends": (ends := _stream_ends(fleet, nid)[ends0:]),
            "stream_closed": bool(ends) or "closed" in watch.seen(f"stream:{port}").get(nid, []),
            "agent_dials": _agent_dials(node.agent) - dials0, "heal_s": round(time.monotonic() - t_healed, 2),
            "events": [f"{e['t']} {e['kind']} {e['from'] or ''}->{e['to'] or ''}: {e['reason']}" for e in events]}


def _block_note(b: dict) -> str:
    """A row's notes for one block of :func:`agent_loop_block`'s ``blocks``."""
    parts = []
    if b["left_healthy_s"] is not None:
        parts.append(f"{b['to']} after {b['left_healthy_s']} s ({b['reason']}), back after {b['healthy_again_s']} s")
    if b["unrouted_s"] is not None:
        parts.append(f"Envoy stopped routing after {b['unrouted_s']} s, routed again after {b['routed_again_s']} s")
    if b["stream_closed"]:
        parts.append("stream ended by the control plane" + (f" ({b['stream_ends'][0]})" if b["stream_ends"] else ""))
    return "; ".join(parts or ["no state change, stream kept open"]) + f"; agent dialled again {b['agent_dials']} times"


async def _heal(rig: FaultRig, http: aiohttp.ClientSession, events: list[dict]) -> None:
    """:meth:`FaultRig.heal`, given 30 s, and ``health.outlier.ejection_max`` more when ``events``
    (:func:`cp_events`) have an outlier ejection: it holds the node out for
    ``health.outlier.ejection`` (30 s by default), doubling at each repeat."""
    assert rig.fleet is not None
    outlier = any(e["kind"] == "outlier_ejected" for e in events)
    extra_s = parse_config(rig.fleet.config_dict()).health.outlier.ejection_max.s if outlier else 0.0
    await rig.heal(http, timeout_s=30.0 + extra_s)


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


def _agent_dials(agent: ManagedProcess) -> int:
    """Streams the agent has opened to a control plane so far (its log's ``stream open`` lines)."""
    try:
        return agent.log_path.read_text(errors="replace").count(": stream open")
    except OSError:
        return 0


def _stream_ends(fleet: Fleet, node_id: str) -> list[str]:
    """Why the control plane (replica 0) ended ``node_id``'s probe streams so far, oldest first:
    its log's INFO lines ``agent stream of NODE closed: WHY`` (dial-in) or ``probe stream to NODE
    (ADDRESS) closed: WHY`` (dialled)."""
    assert fleet.control_plane is not None
    pattern = re.compile(rf"(?:agent stream of|probe stream to) {re.escape(node_id)}\b.*? closed: (.*?)"
                         r"(?: replica=\S+.*)?$")   # the line's fields follow its message
    try:
        text = fleet.control_plane.log_path.read_text(errors="replace")
    except OSError:
        return []
    return [m.group(1)[:120] for line in text.splitlines() if (m := pattern.search(line))]


async def _stream_open(fleet: Fleet, http: aiohttp.ClientSession, node_id: str) -> bool:
    try:
        return bool((await fleet.cp_nodes(http))[node_id]["probe_stream_connected"])
    except (TimeoutError, aiohttp.ClientError, KeyError, ValueError):
        return False
