"""What a fault did to the fleet, as the fault matrix's dial-in rows count it: :class:`FleetWatch`
polls Envoy's host states and each control-plane replica's ``/nodes`` while a fault runs;
:func:`cp_counters` and :func:`cp_events` read a replica's ``/metrics`` and ``/events``.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import aiohttp

from xds_server.process.cancellation import cancel_and_wait
from xds_server.testing._fault_rig import prometheus_value
from xds_server.testing._fleet import Fleet

__all__ = ["FleetWatch", "counters_delta", "cp_counters", "cp_events", "left_healthy"]

ENVOY = "envoy"


class FleetWatch:
    """Every ``step_s`` seconds: Envoy's status of each node (``"HEALTHY"`` or why it is excluded),
    and for each admin port in ``admin_ports`` the node's state (source ``"cp:PORT"``) and whether
    its agent's probe stream is open there (source ``"stream:PORT"``: ``"open"`` / ``"closed"``).
    A replica that does not answer is skipped that round. Each change is kept with its time
    (``time.monotonic`` s) in ``changes[(source, node)]``; run it with :meth:`running`."""

    def __init__(self, fleet: Fleet, http: aiohttp.ClientSession, admin_ports: list[int],
                 step_s: float = 0.05) -> None:
        self.fleet, self.http, self.admin_ports, self.step_s = fleet, http, admin_ports, step_s
        self.changes: dict[tuple[str, str], list[tuple[float, str]]] = {}

    def _saw(self, source: str, node: str, value: str, now: float) -> None:
        seq = self.changes.setdefault((source, node), [])
        if not seq or seq[-1][1] != value:
            seq.append((now, value))

    async def poll(self) -> None:
        """One round: Envoy, then each replica."""
        with contextlib.suppress(TimeoutError, aiohttp.ClientError, KeyError, ValueError):
            hosts = await self.fleet.envoy_hosts(self.http)
            now = time.monotonic()
            for node, status in hosts.items():
                self._saw(ENVOY, node, status, now)
        for port in self.admin_ports:
            with contextlib.suppress(TimeoutError, aiohttp.ClientError, KeyError, ValueError):
                async with self.http.get(f"http://127.0.0.1:{port}/nodes",
                                         timeout=aiohttp.ClientTimeout(total=2)) as r:
                    nodes = (await r.json())["nodes"]
                now = time.monotonic()
                for n in nodes:
                    self._saw(f"cp:{port}", n["id"], n["state"], now)
                    self._saw(f"stream:{port}", n["id"], "open" if n["probe_stream_connected"] else "closed", now)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[FleetWatch]:
        """Poll in a task while the block runs (one round first, so every source has a value)."""
        await self.poll()

        async def loop() -> None:
            while True:
                await asyncio.sleep(self.step_s)
                await self.poll()
        task = asyncio.create_task(loop())
        try:
            yield self
        finally:
            await cancel_and_wait(task)

    def seen(self, source: str) -> dict[str, list[str]]:
        """Node -> the values ``source`` showed, in order, consecutive repeats merged."""
        return {node: [v for _, v in seq] for (src, node), seq in sorted(self.changes.items()) if src == source}

    def during(self, source: str, t0: float, t1: float) -> dict[str, list[str]]:
        """Node -> the values ``source`` showed from ``t0`` to ``t1`` (monotonic s), in order: the
        one in effect at ``t0`` first (a node not seen by then starts with its first value)."""
        out: dict[str, list[str]] = {}
        for (src, node), seq in sorted(self.changes.items()):
            if src != source:
                continue
            before = [v for t, v in seq if t <= t0][-1:]
            vals = before + [v for t, v in seq if t0 < t <= t1]
            out[node] = vals or [seq[0][1]]
        return out

    def first(self, source: str, node: str, pred: Callable[[str], bool], after_s: float = 0.0) -> float | None:
        """When (monotonic s) ``source`` first showed a value of ``node`` for which ``pred`` holds,
        at or after ``after_s``; None if it never did."""
        for t, v in self.changes.get((source, node), []):
            if t >= after_s and pred(v):
                return t
        return None

    def left(self, source: str, value: str) -> list[str]:
        """The nodes whose ``source`` showed something other than ``value`` after showing ``value``."""
        return sorted(node for node, vals in self.seen(source).items()
                      if value in vals and any(v != value for v in vals[vals.index(value):]))


async def cp_counters(http: aiohttp.ClientSession, admin_port: int) -> dict[str, float]:
    """A replica's counters so far (from its /metrics): ``ejections``, ``fail_static_episodes`` and
    the dial-in transport drops by verdict (``drops_node``, ``drops_redialled``, ``drops_burst``)."""
    async with http.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
        text = await r.text()
    out = {"ejections": prometheus_value(text, "sentinel_node_ejections_total"),
           "fail_static_episodes": prometheus_value(text, "sentinel_health_events_total", kind="fail_static_on")}
    for verdict in ("node", "redialled", "burst"):
        out[f"drops_{verdict}"] = prometheus_value(text, "sentinel_agent_transport_drops_total", verdict=verdict)
    return out


def counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """``after - before`` per counter, as whole numbers."""
    return {k: int(after[k] - before[k]) for k in before}


async def cp_events(http: aiohttp.ClientSession, admin_port: int, since_wall_s: float) -> list[dict]:
    """A replica's health events since ``since_wall_s`` (unix s), oldest first: state transitions
    (kind ``transition``) and the cluster policy's (``outlier_ejected``, ``outlier_returned``,
    ``held_back``, ``fail_static_on``, ``fail_static_off``: a node ejected by policy keeps its
    state), each ``{"t": seconds after since_wall_s, "node", "kind", "from", "to", "reason"}``
    (reason clipped to 120 characters)."""
    async with http.get(f"http://127.0.0.1:{admin_port}/events", params={"limit": "500"}) as r:
        events = (await r.json())["events"]
    return [{"t": round(e["time"] - since_wall_s, 3), "node": e["node"], "kind": e["kind"],
             "from": e.get("from"), "to": e.get("to"), "reason": e["reason"][:120]}
            for e in events if e["time"] >= since_wall_s]


def left_healthy(events: list[dict]) -> list[str]:
    """The nodes that ``events`` (:func:`cp_events`) show leaving HEALTHY or ejected by policy."""
    return sorted({e["node"] for e in events
                   if (e["kind"] == "transition" and e["from"] == "HEALTHY") or e["kind"] == "outlier_ejected"})
