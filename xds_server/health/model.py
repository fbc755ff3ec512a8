"""First health model: pure per-node state machine driven by observations and a time argument.

Shape (the interface the full model of the health issue replaces)::

    nh = initial(node_id, now_s)
    nh, events = step(nh, observation, now_s, cfg)
    routing = route(nh, capacity, cfg)          # -> Routing(weight, health_status)

No I/O, no clock reads: ``now_s`` is the caller's monotonic clock in seconds. Thresholds come
from :class:`xds_server.config.HealthConfig` (defaults and their seed sources are documented
there).

States used here: COLD (no heartbeat and no good probe yet: not routed, failures not counted),
HEALTHY, DEGRADED (routed with weight x ``degraded_weight_factor``), UNHEALTHY (ejected).
WARMING, PROBATION and DRAINING exist in :class:`NodeState` for the full model.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Union

from xds_server.config import HealthConfig

__all__ = [
    "EngineFatalKind",
    "Event",
    "HeartbeatObserved",
    "NodeHealth",
    "NodeState",
    "Observation",
    "PingObserved",
    "ProbeObserved",
    "Routing",
    "StreamClosed",
    "Tick",
    "initial",
    "misses_at",
    "route",
    "step",
]


class NodeState(str, enum.Enum):
    """Per-node health state (DESIGN.md section 4)."""

    COLD = "COLD"
    WARMING = "WARMING"
    HEALTHY = "HEALTHY"
    DEGRADED = "DEGRADED"
    UNHEALTHY = "UNHEALTHY"
    PROBATION = "PROBATION"
    DRAINING = "DRAINING"


class EngineFatalKind(str, enum.Enum):
    """Probe outcome classes as seen by the health model."""

    OK = "OK"
    TIMEOUT = "TIMEOUT"
    CONNECT = "CONNECT"
    HTTP_STATUS = "HTTP_STATUS"
    ENGINE_FATAL = "ENGINE_FATAL"
    BAD_OUTPUT = "BAD_OUTPUT"


# ---- observations -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeartbeatObserved:
    """A heartbeat arrived. ``engine_state`` is the agent's view: COLD, WARMING, READY, FAILED."""

    engine_state: str = "READY"


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed; used to count heartbeats that did not arrive."""


@dataclass(frozen=True, slots=True)
class StreamClosed:
    """The probe stream to the agent ended or could not be opened (counts as one miss at once)."""

    detail: str = ""


@dataclass(frozen=True, slots=True)
class PingObserved:
    """A Pong came back; ``rtt_ms`` measured on the control plane's monotonic clock."""

    rtt_ms: float


@dataclass(frozen=True, slots=True)
class ProbeObserved:
    """A micro-inference result. ``ttft_ms`` is meaningful when ``kind`` is OK."""

    kind: EngineFatalKind
    ttft_ms: float = 0.0
    http_status: int = 0
    detail: str = ""


Observation = Union[HeartbeatObserved, Tick, StreamClosed, PingObserved, ProbeObserved]


# ---- state --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """Everything the model knows about one node. Times in seconds (caller's monotonic clock)."""

    node_id: str
    state: NodeState = NodeState.COLD
    reason: str = "no data yet"
    since_s: float = 0.0
    last_heartbeat_s: float | None = None
    consecutive_misses: int = 0
    stream_closed: bool = False
    consecutive_probe_failures: int = 0
    consecutive_good_probes: int = 0
    ewma_rtt_ms: float | None = None
    last_rtt_ms: float | None = None
    last_ttft_ms: float | None = None
    last_probe_kind: EngineFatalKind | None = None
    engine_state: str = "COLD"
    probes_seen: int = 0
    ejected_by: str | None = None  # "heartbeat" | "probe" | "engine" while UNHEALTHY


@dataclass(frozen=True, slots=True)
class Event:
    """One state transition with the reason and the numbers that caused it."""

    at_s: float
    node_id: str
    from_state: NodeState
    to_state: NodeState
    reason: str


@dataclass(frozen=True, slots=True)
class Routing:
    """What Envoy gets for a node: ``weight`` >= 1 and an EDS health status name."""

    weight: int
    health_status: str  # "HEALTHY" | "UNHEALTHY" | "DRAINING"


def initial(node_id: str, now_s: float) -> NodeHealth:
    """A node with no data yet (COLD)."""
    return NodeHealth(node_id=node_id, since_s=now_s)


def misses_at(last_heartbeat_s: float, now_s: float, cfg: HealthConfig) -> int:
    """Heartbeats missed by ``now_s`` since the one that arrived at ``last_heartbeat_s``.

    One miss per heartbeat not arrived within interval + grace (seed 000): with 100 ms / 80 ms,
    misses are counted at +180 ms, +280 ms, +380 ms, ... after the last arrival.
    """
    interval = cfg.heartbeat_interval_ms / 1000.0
    grace = cfg.heartbeat_grace_ms / 1000.0
    gap = now_s - last_heartbeat_s - grace + 1e-9  # tolerate float error at exact boundaries
    if gap < interval:
        return 0
    return int(math.floor(gap / interval))


def _to(nh: NodeHealth, state: NodeState, reason: str, now_s: float, events: list[Event]) -> NodeHealth:
    if nh.state is state:
        return replace(nh, reason=reason) if nh.reason != reason else nh
    events.append(Event(now_s, nh.node_id, nh.state, state, reason))
    return replace(
        nh, state=state, reason=reason, since_s=now_s, consecutive_good_probes=0, ejected_by=None
    )


def _probe_is_good(nh: NodeHealth) -> bool:
    return nh.last_probe_kind is EngineFatalKind.OK


def step(
    nh: NodeHealth, obs: Observation, now_s: float, cfg: HealthConfig
) -> tuple[NodeHealth, list[Event]]:
    """Apply one observation at ``now_s``; return the new health and the transitions it caused.

    Rules (thresholds from ``cfg``):
    - ``consecutive_misses`` missed heartbeats (or a closed stream plus misses) -> UNHEALTHY.
    - ``probe_failures_to_eject`` consecutive probe failures (timeout, connect, HTTP error,
      bad output, or TTFT >= ``ttft_timeout_ms``) -> UNHEALTHY; one ENGINE_FATAL -> UNHEALTHY.
    - one failure, or TTFT in [``ttft_healthy_ms``, ``ttft_timeout_ms``) -> DEGRADED.
    - COLD -> HEALTHY on the first good probe while heartbeats flow; failures are not counted
      while COLD (startup grace).
    - DEGRADED or UNHEALTHY -> HEALTHY after ``good_probes_to_recover`` consecutive good probes
      (TTFT < ``ttft_healthy_ms``) while heartbeats flow.
    - agent reports engine FAILED -> UNHEALTHY.
    """
    events: list[Event] = []
    if isinstance(obs, HeartbeatObserved):
        nh = replace(
            nh, last_heartbeat_s=now_s, consecutive_misses=0, stream_closed=False,
            engine_state=obs.engine_state,
        )
        if obs.engine_state == "FAILED" and nh.state is not NodeState.UNHEALTHY:
            nh = replace(_to(nh, NodeState.UNHEALTHY, "agent reports engine FAILED", now_s, events),
                         ejected_by="engine")
        elif nh.state is NodeState.UNHEALTHY and nh.ejected_by == "heartbeat":
            # Heartbeats are back; recovery still needs good probes (counted from now).
            nh = replace(nh, reason="heartbeats resumed; waiting for good probes")
        return nh, events

    if isinstance(obs, (Tick, StreamClosed)):
        if nh.last_heartbeat_s is None:
            return nh, events
        closed = nh.stream_closed or isinstance(obs, StreamClosed)
        # A closed stream counts as one miss at once, on top of the heartbeats not arrived.
        misses = misses_at(nh.last_heartbeat_s, now_s, cfg) + (1 if closed else 0)
        misses = max(misses, nh.consecutive_misses)
        nh = replace(nh, consecutive_misses=misses, stream_closed=closed)
        if (
            misses >= cfg.consecutive_misses
            and nh.state is not NodeState.COLD
            and not (nh.state is NodeState.UNHEALTHY and nh.ejected_by == "heartbeat")
        ):
            gap_ms = (now_s - nh.last_heartbeat_s) * 1000.0
            detail = f"; stream closed: {obs.detail}" if isinstance(obs, StreamClosed) and obs.detail else ""
            nh = _to(
                nh, NodeState.UNHEALTHY,
                f"heartbeat: {misses} consecutive misses (last heartbeat {gap_ms:.0f} ms ago){detail}",
                now_s, events,
            )
            nh = replace(nh, ejected_by="heartbeat")
        return nh, events

    if isinstance(obs, PingObserved):
        a = cfg.rtt_ewma_alpha
        ewma = obs.rtt_ms if nh.ewma_rtt_ms is None else a * obs.rtt_ms + (1 - a) * nh.ewma_rtt_ms
        return replace(nh, ewma_rtt_ms=ewma, last_rtt_ms=obs.rtt_ms), events

    if isinstance(obs, ProbeObserved):
        return _on_probe(nh, obs, now_s, cfg, events), events

    raise TypeError(f"unknown observation {obs!r}")


def _on_probe(
    nh: NodeHealth, obs: ProbeObserved, now_s: float, cfg: HealthConfig, events: list[Event]
) -> NodeHealth:
    kind = obs.kind
    if kind is EngineFatalKind.OK and obs.ttft_ms >= cfg.ttft_timeout_ms:
        kind = EngineFatalKind.TIMEOUT
    nh = replace(
        nh, last_probe_kind=kind, probes_seen=nh.probes_seen + 1,
        last_ttft_ms=obs.ttft_ms if obs.kind is EngineFatalKind.OK else nh.last_ttft_ms,
    )
    heartbeats_flow = nh.last_heartbeat_s is not None and nh.consecutive_misses < cfg.consecutive_misses

    if kind is EngineFatalKind.OK:
        nh = replace(nh, consecutive_probe_failures=0)
        if obs.ttft_ms < cfg.ttft_healthy_ms:
            good = nh.consecutive_good_probes + 1
            nh = replace(nh, consecutive_good_probes=good)
            if nh.state is NodeState.COLD:
                if heartbeats_flow:
                    nh = _to(nh, NodeState.HEALTHY, f"first good probe (TTFT {obs.ttft_ms:.0f} ms)", now_s, events)
            elif nh.state in (NodeState.DEGRADED, NodeState.UNHEALTHY):
                if heartbeats_flow and good >= cfg.good_probes_to_recover:
                    nh = _to(
                        nh, NodeState.HEALTHY,
                        f"{good} consecutive good probes (last TTFT {obs.ttft_ms:.0f} ms)", now_s, events,
                    )
            return nh
        # Slow but answering: degraded tier.
        nh = replace(nh, consecutive_good_probes=0)
        if nh.state in (NodeState.HEALTHY, NodeState.COLD) and heartbeats_flow:
            nh = _to(
                nh, NodeState.DEGRADED,
                f"probe TTFT {obs.ttft_ms:.0f} ms >= {cfg.ttft_healthy_ms:.0f} ms", now_s, events,
            )
        return nh

    # A failure.
    if nh.state is NodeState.COLD:
        return replace(nh, consecutive_good_probes=0)  # startup grace: not counted
    failures = nh.consecutive_probe_failures + 1
    nh = replace(nh, consecutive_probe_failures=failures, consecutive_good_probes=0)
    what = _describe_failure(kind, obs, cfg)
    if kind is EngineFatalKind.ENGINE_FATAL:
        nh = _to(nh, NodeState.UNHEALTHY, f"engine fatal error: {what}", now_s, events)
        return replace(nh, ejected_by="engine")
    if failures >= cfg.probe_failures_to_eject:
        if nh.state is NodeState.UNHEALTHY:
            return nh
        nh = _to(nh, NodeState.UNHEALTHY, f"probe: {failures} consecutive failures, last {what}", now_s, events)
        return replace(nh, ejected_by="probe")
    if nh.state is NodeState.HEALTHY:
        return _to(nh, NodeState.DEGRADED, f"probe failure: {what}", now_s, events)
    return nh


def _describe_failure(kind: EngineFatalKind, obs: ProbeObserved, cfg: HealthConfig) -> str:
    if kind is EngineFatalKind.TIMEOUT:
        if obs.kind is EngineFatalKind.OK:
            return f"inference timeout (TTFT {obs.ttft_ms:.0f} ms >= {cfg.ttft_timeout_ms:.0f} ms)"
        return f"inference timeout (no token within {cfg.ttft_timeout_ms:.0f} ms)"
    if kind is EngineFatalKind.HTTP_STATUS:
        return f"HTTP {obs.http_status}" + (f": {obs.detail[:120]}" if obs.detail else "")
    return f"{kind.value}" + (f": {obs.detail[:120]}" if obs.detail else "")


_FULL = 100  # full weight per unit of capacity, so a 1 % ramp step is representable


def route(nh: NodeHealth, capacity: int, cfg: HealthConfig) -> Routing:
    """Map a node's health to its EDS weight and health_status.

    Full weight is ``capacity x 100``. DEGRADED keeps ``degraded_weight_factor`` of it (seed 001:
    cut by 70 %). Weight is never the way to eject (Envoy NACKs weight 0): ejected and COLD nodes
    keep their full weight and get health_status UNHEALTHY, so Envoy keeps their stats.
    """
    full = capacity * _FULL
    if nh.state is NodeState.HEALTHY:
        return Routing(full, "HEALTHY")
    if nh.state is NodeState.DEGRADED:
        return Routing(max(1, int(round(full * cfg.degraded_weight_factor))), "HEALTHY")
    if nh.state is NodeState.DRAINING:
        return Routing(full, "DRAINING")
    return Routing(full, "UNHEALTHY")
