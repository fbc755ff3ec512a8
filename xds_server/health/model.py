"""Per-node health state machine: pure, driven by observations and a time argument.

Shape::

    nh = initial(node_id, now_s)
    nh, events = step(nh, observation, now_s, cfg)
    nr = node_routing(nh, cfg)        # this node's own view: status, weight factor, soft block
    t = next_check_s(nh, cfg)         # when a Tick is next due (to arm one timer, no polling)

No I/O and no clock reads: ``now_s`` is the caller's monotonic clock in seconds. Every threshold
is a field of :class:`xds_server.config.HealthConfig` with its default and source documented
there (DESIGN.md section 4, seeds 000 and 001).

States (DESIGN.md section 4)::

    COLD ──heartbeat──► WARMING ──first good probe──► PROBATION (ramp from 1 %) ──100 %──► HEALTHY
                                                          ▲  any failure │                 │ ▲
                                                          │              ▼                 ▼ │ 3 good
    UNHEALTHY ◄── 3 missed heartbeats / phi suspicion / 2 probe failures / engine fatal ── DEGRADED
        └── clean period (60 s of good probes, RTT back at baseline; doubles after a failed
            probation, capped) ──► PROBATION

DRAINING is an operator override on top of any state: it is what Envoy sees until undrained,
while the underlying state keeps following observations.

Phi suspicion (see :mod:`xds_server.health.phi`) ejects a node as soon as its silence is
implausible given its own heartbeat history, before the count rule would. If a heartbeat then
arrives before the count rule fires, the suspicion was false: the node returns to the state it
had, without a probation (a false suspicion costs ~100 ms of traffic, not minutes). Disproved
suspicions are limited per minute (``phi_max_suspicions_per_min``) so a jittery node cannot flap.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Union

from xds_server.config import HealthConfig
from xds_server.health import phi as phimod

__all__ = [
    "DrainRequested",
    "EngineFatalKind",
    "FailStaticEnded",
    "Event",
    "HeartbeatObserved",
    "NodeHealth",
    "NodeRouting",
    "NodeState",
    "Observation",
    "PingObserved",
    "ProbeObserved",
    "Routing",
    "StreamClosed",
    "Tick",
    "initial",
    "misses_at",
    "next_check_s",
    "node_routing",
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
    """A heartbeat arrived, with the agent's telemetry summary.

    ``engine_state``: COLD, WARMING, READY or FAILED. Load fields are None when unknown (never
    read as 0). ``gpu_free_ratio`` is 0..1 (the least free GPU of the node). ``gpu_fatal`` names
    a fatal GPU event (e.g. "Xid 79"), empty when none.
    """

    engine_state: str = "READY"
    stalled: bool = False
    stall_detail: str = ""
    requests_running: float | None = None
    requests_waiting: float | None = None
    gpu_free_ratio: float | None = None
    gpu_fatal: str = ""


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: count heartbeats that did not arrive, advance ramps and clean periods."""


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


@dataclass(frozen=True, slots=True)
class FailStaticEnded:
    """Fleet-wide fail-static ended: heartbeat losses since ``burst_start_s`` were our own fault.

    A node ejected only for lost heartbeats during the episode, whose heartbeats flow again,
    returns to the state it had (no probation): the evidence against it was our network's.
    """

    burst_start_s: float


@dataclass(frozen=True, slots=True)
class DrainRequested:
    """Operator drain (``drain=True``) or undrain."""

    drain: bool
    reason: str = "operator"


Observation = Union[HeartbeatObserved, Tick, StreamClosed, PingObserved, ProbeObserved, DrainRequested,
                    FailStaticEnded]


# ---- state --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """Everything the model knows about one node. Times in seconds (caller's monotonic clock)."""

    node_id: str
    state: NodeState = NodeState.COLD
    reason: str = "no data yet"
    since_s: float = 0.0
    # heartbeats
    last_heartbeat_s: float | None = None
    consecutive_misses: int = 0
    stream_closed: bool = False
    arrivals: phimod.ArrivalStats | None = None
    suspected: bool = False                 # UNHEALTHY by phi suspicion, not yet by the count rule
    suspected_from: NodeState | None = None
    suspicion_clears: tuple[float, ...] = ()  # times of disproved suspicions (last minute)
    # RTT
    ewma_rtt_ms: float | None = None
    last_rtt_ms: float | None = None
    baseline_rtt_ms: float | None = None
    # probes
    consecutive_probe_failures: int = 0
    consecutive_good_probes: int = 0
    last_ttft_ms: float | None = None
    ewma_ttft_ms: float | None = None
    last_probe_kind: EngineFatalKind | None = None
    probes_seen: int = 0
    clean_since_s: float | None = None      # start of the current run of successful probes
    clean_probes: int = 0
    # engine and GPU
    engine_state: str = "COLD"
    stalled: bool = False
    stalled_since_s: float | None = None
    stall_counted: int = 0                  # timeouts already counted for the current stall
    requests_running: float | None = None
    requests_waiting: float | None = None
    gpu_free_ratio: float | None = None
    gpu_fatal: str = ""
    # ejection, probation, ramp
    ejected_by: str | None = None           # "heartbeat" | "phi" | "probe" | "engine" | "gpu"
    ejected_from: NodeState | None = None   # state before the current ejection
    forgive_since_s: float | None = None    # fail-static ended while this node was still silent:
    forgive_until_s: float = 0.0            # forgive its heartbeat ejection if heartbeats resume soon
    probation_clean_s: float = 0.0          # required clean period (0 = config default)
    ramp_percent: float = 0.0
    ramp_step_at_s: float = 0.0
    healthy_since_s: float | None = None
    # operator
    draining: bool = False
    drain_since_s: float | None = None

    @property
    def effective_state(self) -> NodeState:
        """The state Envoy's view follows: DRAINING overrides everything."""
        return NodeState.DRAINING if self.draining else self.state


@dataclass(frozen=True, slots=True)
class Event:
    """One state transition with the reason and the numbers that caused it."""

    at_s: float
    node_id: str
    from_state: NodeState
    to_state: NodeState
    reason: str


@dataclass(frozen=True, slots=True)
class NodeRouting:
    """A node's own routing view before cluster policy.

    ``status``: "HEALTHY" (routable), "UNHEALTHY" (not routed) or "DRAINING".
    ``factor``: share of full weight from the state (DEGRADED 0.3, PROBATION ramp %, queue
    warning), 0..1. ``soft_block``: a reason the node should not get new traffic that cluster
    policy may hold back under ``max_ejection_percent`` (GPU memory, queue), else "".
    ``hard``: not routed on hard evidence (never held back).
    """

    status: str
    factor: float
    soft_block: str = ""
    hard: bool = False


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


def _phi_delay_s(nh: NodeHealth, cfg: HealthConfig) -> float | None:
    """Silence after which phi convicts, or None when phi is off, untrained or rate-limited."""
    if cfg.failure_detector != "phi" or nh.arrivals is None or nh.arrivals.samples < cfg.phi_min_samples:
        return None
    if cfg.phi_max_suspicions_per_min and len(nh.suspicion_clears) >= cfg.phi_max_suspicions_per_min:
        return None  # 0 = unlimited
    ms = phimod.suspicion_delay_ms(nh.arrivals, cfg.phi_threshold, cfg.phi_min_std_ms,
                                   cfg.phi_acceptable_pause_ms)
    return ms / 1000.0


def next_check_s(nh: NodeHealth, cfg: HealthConfig) -> float | None:
    """Absolute time (caller's clock, s) at which a :class:`Tick` can change something.

    The earliest of: phi conviction, the next heartbeat-miss boundary, the next ramp step.
    None when nothing is pending (no heartbeat seen yet and no ramp).
    """
    cands: list[float] = []
    if nh.last_heartbeat_s is not None:
        interval = cfg.heartbeat_interval_ms / 1000.0
        grace = cfg.heartbeat_grace_ms / 1000.0
        counted = max(nh.consecutive_misses - (1 if nh.stream_closed else 0), 0)
        cands.append(nh.last_heartbeat_s + grace + interval * (counted + 1))
        if not nh.suspected and nh.state in _PHI_STATES:
            d = _phi_delay_s(nh, cfg)
            if d is not None:
                cands.append(nh.last_heartbeat_s + d)
    if nh.state is NodeState.PROBATION:
        cands.append(nh.ramp_step_at_s + cfg.ramp_step_s)
    if nh.stalled and nh.stalled_since_s is not None and nh.stall_counted == 1 and nh.state in _ROUTED:
        cands.append(nh.stalled_since_s + cfg.stall_confirm_ms / 1000.0)
    return min(cands) if cands else None


_ROUTED = (NodeState.HEALTHY, NodeState.DEGRADED, NodeState.PROBATION)
_PHI_STATES = _ROUTED


def _to(nh: NodeHealth, state: NodeState, reason: str, now_s: float, events: list[Event],
        **changes) -> NodeHealth:
    """Transition (or just update the reason when already in ``state``)."""
    if nh.state is state:
        return replace(nh, reason=reason, **changes)
    events.append(Event(now_s, nh.node_id, nh.state, state,
                        f"(while draining) {reason}" if nh.draining else reason))
    base = dict(state=state, reason=reason, since_s=now_s, consecutive_good_probes=0)
    if state is not NodeState.UNHEALTHY:
        base.update(ejected_by=None, suspected=False, suspected_from=None)
    if state is NodeState.HEALTHY:
        base.update(healthy_since_s=now_s)
    elif nh.state is NodeState.HEALTHY:
        base.update(healthy_since_s=None)
    base.update(changes)
    return replace(nh, **base)


def _required_clean_s(nh: NodeHealth, cfg: HealthConfig) -> float:
    return nh.probation_clean_s or cfg.probation_clean_s


def _eject(nh: NodeHealth, by: str, reason: str, now_s: float, cfg: HealthConfig,
           events: list[Event]) -> NodeHealth:
    """Move to UNHEALTHY. A failure in PROBATION doubles the next required clean period."""
    clean = _required_clean_s(nh, cfg)
    if nh.state is NodeState.PROBATION:
        clean = min(clean * 2.0, cfg.probation_clean_max_s)
        reason += f"; failed in PROBATION at {nh.ramp_percent:.0f} %, next clean period {clean:.0f} s"
    return _to(nh, NodeState.UNHEALTHY, reason, now_s, events, ejected_by=by, probation_clean_s=clean,
               clean_since_s=None, clean_probes=0, ramp_percent=0.0, suspected=False, suspected_from=None,
               ejected_from=nh.state)


def step(nh: NodeHealth, obs: Observation, now_s: float, cfg: HealthConfig) -> tuple[NodeHealth, list[Event]]:
    """Apply one observation at ``now_s``; return the new health and the transitions it caused.

    Rules (thresholds from ``cfg``; sources in :class:`~xds_server.config.HealthConfig`):
    heartbeats: ``consecutive_misses`` misses (a closed stream counts one at once) or a phi
    suspicion -> UNHEALTHY. Probes: TTFT < ``ttft_healthy_ms`` is good; up to
    ``ttft_timeout_ms`` or one failure -> DEGRADED; ``probe_failures_to_eject`` consecutive
    failures or one ENGINE_FATAL -> UNHEALTHY; DEGRADED -> HEALTHY after
    ``good_probes_to_recover`` good probes. A timeout or HTTP 429/503 while the engine is busy
    and its token counter advances is saturation, not death (DEGRADED only, field case fc07).
    A STALLED engine counts as one probe timeout, and as a second one if still stalled after
    ``stall_confirm_ms`` (fc06). COLD/WARMING: not routed, failures not counted.
    """
    events: list[Event] = []
    if isinstance(obs, DrainRequested):
        return _on_drain(nh, obs, now_s, events), events
    if isinstance(obs, FailStaticEnded):
        if nh.state is NodeState.UNHEALTHY and nh.consecutive_misses == 0 and not nh.stream_closed:
            nh = _forgive(nh, obs.burst_start_s, now_s, cfg, events)
        elif nh.state is NodeState.UNHEALTHY:
            # Still silent: forgive it too if its heartbeats resume within ten intervals.
            nh = replace(nh, forgive_since_s=obs.burst_start_s,
                         forgive_until_s=now_s + 10 * cfg.heartbeat_interval_ms / 1000.0)
        return nh, events
    if isinstance(obs, HeartbeatObserved):
        nh = _on_heartbeat(nh, obs, now_s, cfg, events)
    elif isinstance(obs, (Tick, StreamClosed)):
        nh = _on_silence(nh, obs, now_s, cfg, events)
    elif isinstance(obs, PingObserved):
        a = cfg.rtt_ewma_alpha
        ewma = obs.rtt_ms if nh.ewma_rtt_ms is None else a * obs.rtt_ms + (1 - a) * nh.ewma_rtt_ms
        baseline = nh.baseline_rtt_ms
        if nh.state is NodeState.HEALTHY:
            b = cfg.rtt_baseline_alpha
            baseline = ewma if baseline is None else b * ewma + (1 - b) * baseline
        nh = replace(nh, ewma_rtt_ms=ewma, last_rtt_ms=obs.rtt_ms, baseline_rtt_ms=baseline)
    elif isinstance(obs, ProbeObserved):
        nh = _on_probe(nh, obs, now_s, cfg, events)
    else:
        raise TypeError(f"unknown observation {obs!r}")
    nh = _advance(nh, now_s, cfg, events)
    return nh, events


def _forgive(nh: NodeHealth, burst_start_s: float, now_s: float, cfg: HealthConfig,
             events: list[Event]) -> NodeHealth:
    """Undo a heartbeat ejection that was part of a fleet-wide loss (see FailStaticEnded)."""
    nh = replace(nh, forgive_since_s=None, forgive_until_s=0.0)
    if (nh.ejected_by not in ("heartbeat", "phi") or nh.ejected_from not in _ROUTED
            or nh.since_s < burst_start_s):
        return nh
    back = nh.ejected_from
    assert back is not None
    extra = {"ramp_percent": cfg.ramp_start_percent, "ramp_step_at_s": now_s} if back is NodeState.PROBATION else {}
    return _to(nh, back, "heartbeat loss forgiven: it was part of a fleet-wide loss (fail-static), "
               "heartbeats flow again", now_s, events, **extra)


def _on_drain(nh: NodeHealth, obs: DrainRequested, now_s: float, events: list[Event]) -> NodeHealth:
    if obs.drain == nh.draining:
        return nh
    if obs.drain:
        events.append(Event(now_s, nh.node_id, nh.state, NodeState.DRAINING, f"drain requested: {obs.reason}"))
        return replace(nh, draining=True, drain_since_s=now_s)
    events.append(Event(now_s, nh.node_id, NodeState.DRAINING, nh.state, f"undrained: {obs.reason}"))
    return replace(nh, draining=False, drain_since_s=None)


def _on_heartbeat(nh: NodeHealth, hb: HeartbeatObserved, now_s: float, cfg: HealthConfig,
                  events: list[Event]) -> NodeHealth:
    arrivals = nh.arrivals
    if nh.last_heartbeat_s is not None and not nh.stream_closed:
        interval_ms = (now_s - nh.last_heartbeat_s) * 1000.0
        if arrivals is None:
            arrivals = phimod.ArrivalStats(cfg.heartbeat_interval_ms, cfg.phi_min_std_ms ** 2, 0)
        arrivals = phimod.update(arrivals, interval_ms, cfg.phi_alpha)
    gap_ms = None if nh.last_heartbeat_s is None else (now_s - nh.last_heartbeat_s) * 1000.0
    clears = tuple(t for t in nh.suspicion_clears if now_s - t < 60.0)
    was_suspected, back_to = nh.suspected, nh.suspected_from
    prev_engine = nh.engine_state
    stalled_since = nh.stalled_since_s
    stall_counted = nh.stall_counted
    if hb.stalled and not nh.stalled:
        stalled_since, stall_counted = now_s, 0
    elif not hb.stalled:
        stalled_since, stall_counted = None, 0
    nh = replace(
        nh, last_heartbeat_s=now_s, consecutive_misses=0, stream_closed=False, arrivals=arrivals,
        engine_state=hb.engine_state, requests_running=hb.requests_running,
        requests_waiting=hb.requests_waiting, gpu_free_ratio=hb.gpu_free_ratio, gpu_fatal=hb.gpu_fatal,
        stalled=hb.stalled, stalled_since_s=stalled_since, stall_counted=stall_counted,
        suspicion_clears=clears,
    )
    if was_suspected and nh.state is NodeState.UNHEALTHY and back_to is not None:
        nh = _to(nh, back_to, f"phi suspicion disproved: heartbeat arrived after {gap_ms:.0f} ms",
                 now_s, events, suspicion_clears=clears + (now_s,))
    if nh.forgive_since_s is not None:
        if now_s <= nh.forgive_until_s and nh.state is NodeState.UNHEALTHY:
            nh = _forgive(nh, nh.forgive_since_s, now_s, cfg, events)
        else:
            nh = replace(nh, forgive_since_s=None, forgive_until_s=0.0)
    if nh.state is NodeState.COLD:
        nh = _to(nh, NodeState.WARMING, f"first heartbeat (engine {hb.engine_state})", now_s, events)
    if hb.gpu_fatal and nh.state in _ROUTED:
        return _eject(nh, "gpu", f"GPU fatal event: {hb.gpu_fatal}", now_s, cfg, events)
    if hb.engine_state == "FAILED" and nh.state in _ROUTED:
        return _eject(nh, "engine", "agent reports engine FAILED", now_s, cfg, events)
    if hb.engine_state in ("COLD", "WARMING") and prev_engine == "READY" and nh.state in _ROUTED:
        return _to(nh, NodeState.WARMING, f"engine restarting (agent reports {hb.engine_state})", now_s, events,
                   consecutive_probe_failures=0, clean_since_s=None, clean_probes=0, ejected_by=None)
    if nh.state is NodeState.UNHEALTHY and nh.ejected_by in ("heartbeat", "phi"):
        nh = replace(nh, reason=f"heartbeats resumed; clean period {_required_clean_s(nh, cfg):.0f} s "
                                "of good probes before PROBATION")
    if hb.stalled and stall_counted == 0 and nh.state in _ROUTED:
        nh = replace(nh, stall_counted=1)
        nh = _failure(nh, EngineFatalKind.TIMEOUT, f"engine STALLED ({hb.stall_detail or 'tokens frozen'})",
                      now_s, cfg, events)
    return nh


def _on_silence(nh: NodeHealth, obs: Tick | StreamClosed, now_s: float, cfg: HealthConfig,
                events: list[Event]) -> NodeHealth:
    if nh.last_heartbeat_s is None:
        return nh
    closed = nh.stream_closed or isinstance(obs, StreamClosed)
    # A closed stream counts as one miss at once, on top of the heartbeats not arrived.
    misses = max(misses_at(nh.last_heartbeat_s, now_s, cfg) + (1 if closed else 0), nh.consecutive_misses)
    nh = replace(nh, consecutive_misses=misses, stream_closed=closed)
    gap_ms = (now_s - nh.last_heartbeat_s) * 1000.0
    if misses >= cfg.consecutive_misses:
        if nh.state in _ROUTED or (nh.state is NodeState.UNHEALTHY and nh.ejected_by not in ("heartbeat",)):
            detail = f"; stream closed: {obs.detail}" if isinstance(obs, StreamClosed) and obs.detail else ""
            reason = f"heartbeat: {misses} consecutive misses (last heartbeat {gap_ms:.0f} ms ago){detail}"
            if nh.state is NodeState.UNHEALTHY:  # already out (probe or phi): now proven by the count rule
                return replace(nh, ejected_by="heartbeat", suspected=False, suspected_from=None, reason=reason,
                               clean_since_s=None, clean_probes=0)
            return _eject(nh, "heartbeat", reason, now_s, cfg, events)
        return nh
    if nh.state in _PHI_STATES and not nh.suspected:
        d = _phi_delay_s(nh, cfg)
        if d is not None and now_s - nh.last_heartbeat_s >= d - 1e-9:
            a = nh.arrivals
            assert a is not None
            value = phimod.phi(a, gap_ms, cfg.phi_min_std_ms, cfg.phi_acceptable_pause_ms)
            prev = nh.state
            nh = _eject(nh, "phi", f"heartbeat: phi {value:.1f} >= {cfg.phi_threshold:g} after {gap_ms:.0f} ms "
                        f"silence (mean interval {a.mean_ms:.0f} ms, sd {math.sqrt(a.var_ms2):.1f} ms)",
                        now_s, cfg, events)
            return replace(nh, suspected=True, suspected_from=prev)
    return nh


def _classify(obs: ProbeObserved, cfg: HealthConfig) -> tuple[str, str]:
    """("good" | "slow" | "fail" | "fatal" | "busy", description)."""
    if obs.kind is EngineFatalKind.OK:
        if obs.ttft_ms < cfg.ttft_healthy_ms:
            return "good", f"TTFT {obs.ttft_ms:.0f} ms"
        if obs.ttft_ms < cfg.ttft_timeout_ms:
            return "slow", f"probe TTFT {obs.ttft_ms:.0f} ms >= {cfg.ttft_healthy_ms:.0f} ms"
        return "fail", f"inference timeout (TTFT {obs.ttft_ms:.0f} ms >= {cfg.ttft_timeout_ms:.0f} ms)"
    if obs.kind is EngineFatalKind.ENGINE_FATAL:
        return "fatal", f"engine fatal error: {obs.detail[:160]}"
    if obs.kind is EngineFatalKind.TIMEOUT:
        return "fail", f"inference timeout (no token within {cfg.ttft_timeout_ms:.0f} ms)" + (
            f": {obs.detail[:120]}" if obs.detail else "")
    if obs.kind is EngineFatalKind.HTTP_STATUS:
        return "fail", f"HTTP {obs.http_status}" + (f": {obs.detail[:120]}" if obs.detail else "")
    return "fail", f"{obs.kind.value}" + (f": {obs.detail[:120]}" if obs.detail else "")


def _busy_progressing(nh: NodeHealth) -> bool:
    """The engine is busy and its token counter advances (agent says running > 0, not stalled)."""
    return (nh.requests_running or 0) > 0 and not nh.stalled


def _on_probe(nh: NodeHealth, obs: ProbeObserved, now_s: float, cfg: HealthConfig,
              events: list[Event]) -> NodeHealth:
    cls, what = _classify(obs, cfg)
    if obs.kind is EngineFatalKind.OK:
        a = cfg.ttft_ewma_alpha
        ewma = obs.ttft_ms if nh.ewma_ttft_ms is None else a * obs.ttft_ms + (1 - a) * nh.ewma_ttft_ms
        nh = replace(nh, last_ttft_ms=obs.ttft_ms, ewma_ttft_ms=ewma)
    nh = replace(nh, last_probe_kind=obs.kind, probes_seen=nh.probes_seen + 1)
    saturated = cls == "fail" and _busy_progressing(nh) and (
        obs.kind in (EngineFatalKind.TIMEOUT, EngineFatalKind.OK)
        or (obs.kind is EngineFatalKind.HTTP_STATUS and obs.http_status in (429, 503)))
    if obs.kind is EngineFatalKind.HTTP_STATUS and obs.http_status == 429:
        saturated = True  # 429 is the engine saying "busy", never death
    if saturated:
        cls, what = "busy", f"saturated ({what}; {nh.requests_running or 0:.0f} running, tokens advancing)"

    if cls in ("good", "slow"):
        clean_since = nh.clean_since_s if nh.clean_since_s is not None else now_s
        nh = replace(nh, consecutive_probe_failures=0, clean_since_s=clean_since, clean_probes=nh.clean_probes + 1)
    else:
        nh = replace(nh, clean_since_s=None, clean_probes=0)

    st = nh.state
    if st in (NodeState.COLD, NodeState.WARMING):
        if cls in ("good", "slow") and nh.last_heartbeat_s is not None:
            return _to(nh, NodeState.PROBATION, f"first good probe ({what}); ramping from "
                       f"{cfg.ramp_start_percent:g} %", now_s, events,
                       ramp_percent=cfg.ramp_start_percent, ramp_step_at_s=now_s)
        return nh  # startup grace: failures not counted
    if st is NodeState.UNHEALTHY:
        if cls == "fatal":
            return replace(nh, reason=what, ejected_by="engine")
        return nh  # clean-period bookkeeping above; PROBATION entry in _advance
    if cls == "good":
        good = nh.consecutive_good_probes + 1
        nh = replace(nh, consecutive_good_probes=good)
        if st is NodeState.DEGRADED and good >= cfg.good_probes_to_recover:
            return _to(nh, NodeState.HEALTHY, f"{good} consecutive good probes (last {what})", now_s, events)
        return nh
    if cls == "slow":
        nh = replace(nh, consecutive_good_probes=0)
        if st is NodeState.HEALTHY:
            return _to(nh, NodeState.DEGRADED, what, now_s, events)
        return nh  # PROBATION: the ramp holds while slow (see _advance)
    if cls == "busy":
        nh = replace(nh, consecutive_good_probes=0)
        if st is NodeState.HEALTHY:
            return _to(nh, NodeState.DEGRADED, what, now_s, events)
        return replace(nh, reason=what) if st is NodeState.DEGRADED else nh
    if cls == "fatal":
        return _eject(nh, "engine", what, now_s, cfg, events)
    return _failure(nh, obs.kind, what, now_s, cfg, events)


def _failure(nh: NodeHealth, kind: EngineFatalKind, what: str, now_s: float, cfg: HealthConfig,
             events: list[Event]) -> NodeHealth:
    """One probe failure (or a stall counted as a timeout) in a routed state."""
    failures = nh.consecutive_probe_failures + 1
    nh = replace(nh, consecutive_probe_failures=failures, consecutive_good_probes=0,
                 clean_since_s=None, clean_probes=0)
    if nh.state is NodeState.PROBATION:
        return _eject(nh, "probe", f"probe failure in PROBATION: {what}", now_s, cfg, events)
    if failures >= cfg.probe_failures_to_eject:
        return _eject(nh, "probe", f"probe: {failures} consecutive failures, last {what}", now_s, cfg, events)
    if nh.state is NodeState.HEALTHY:
        return _to(nh, NodeState.DEGRADED, f"probe failure: {what}", now_s, events)
    return replace(nh, reason=f"probe failure: {what}")


def _advance(nh: NodeHealth, now_s: float, cfg: HealthConfig, events: list[Event]) -> NodeHealth:
    """Time-driven rules: stall confirmation, clean period -> PROBATION, ramp steps, backoff reset."""
    if (nh.stalled and nh.stall_counted == 1 and nh.stalled_since_s is not None
            and now_s - nh.stalled_since_s >= cfg.stall_confirm_ms / 1000.0 - 1e-9 and nh.state in _ROUTED):
        nh = replace(nh, stall_counted=2)
        nh = _failure(nh, EngineFatalKind.TIMEOUT,
                      f"engine still STALLED {cfg.stall_confirm_ms:.0f} ms later", now_s, cfg, events)
    if nh.state is NodeState.UNHEALTHY and not nh.suspected and nh.clean_since_s is not None:
        need = _required_clean_s(nh, cfg)
        clean_for = now_s - nh.clean_since_s
        heartbeats_ok = nh.last_heartbeat_s is not None and nh.consecutive_misses < cfg.consecutive_misses
        rtt_ok = (nh.baseline_rtt_ms is None or nh.ewma_rtt_ms is None
                  or nh.ewma_rtt_ms <= nh.baseline_rtt_ms * cfg.rtt_baseline_tolerance + 1.0)
        engine_ok = nh.engine_state == "READY" and not nh.gpu_fatal
        if (clean_for >= need - 1e-9 and nh.clean_probes >= cfg.probation_min_probes
                and heartbeats_ok and rtt_ok and engine_ok):
            rtt = "" if nh.ewma_rtt_ms is None else f", EWMA RTT {nh.ewma_rtt_ms:.1f} ms"
            nh = _to(nh, NodeState.PROBATION,
                     f"{clean_for:.0f} s of successful probes ({nh.clean_probes} probes{rtt}); "
                     f"ramping from {cfg.ramp_start_percent:g} %", now_s, events,
                     ramp_percent=cfg.ramp_start_percent, ramp_step_at_s=now_s)
    if nh.state is NodeState.PROBATION and now_s - nh.ramp_step_at_s >= cfg.ramp_step_s - 1e-9:
        slow = nh.last_probe_kind is EngineFatalKind.OK and (nh.last_ttft_ms or 0) >= cfg.ttft_healthy_ms
        if slow:
            nh = replace(nh, ramp_step_at_s=now_s, reason=f"ramp held at {nh.ramp_percent:g} %: last probe slow")
        else:
            steps = int((now_s - nh.ramp_step_at_s + 1e-9) // cfg.ramp_step_s)
            pct = min(100.0, nh.ramp_percent + steps * cfg.ramp_step_percent)
            if pct >= 100.0:
                nh = _to(nh, NodeState.HEALTHY, "ramp complete (100 %)", now_s, events, ramp_percent=100.0)
            else:
                nh = replace(nh, ramp_percent=pct, ramp_step_at_s=nh.ramp_step_at_s + steps * cfg.ramp_step_s,
                             reason=f"PROBATION ramp {pct:g} %")
    if (nh.state is NodeState.HEALTHY and nh.probation_clean_s and nh.healthy_since_s is not None
            and now_s - nh.healthy_since_s >= cfg.probation_clean_max_s):
        nh = replace(nh, probation_clean_s=0.0)  # a long healthy run forgives earlier failures
    return nh


def node_routing(nh: NodeHealth, cfg: HealthConfig) -> NodeRouting:
    """This node's routing before cluster policy (see :class:`NodeRouting`).

    DEGRADED keeps ``degraded_weight_factor`` (seed 001: cut by 70 %); PROBATION keeps its ramp
    percentage; more than ``queue_warning`` waiting multiplies by ``queue_warning_weight_factor``.
    GPU free memory under ``gpu_min_free_ratio`` or more than ``queue_critical`` waiting is a
    soft block. COLD, WARMING and UNHEALTHY are not routed (never published UNKNOWN, which Envoy
    treats as healthy).
    """
    if nh.draining:
        return NodeRouting("DRAINING", 1.0)
    st = nh.state
    if st not in _ROUTED:
        return NodeRouting("UNHEALTHY", 1.0, hard=True)
    factor = 1.0
    if st is NodeState.DEGRADED:
        factor = cfg.degraded_weight_factor
    elif st is NodeState.PROBATION:
        factor = max(nh.ramp_percent, cfg.ramp_start_percent) / 100.0
    soft = ""
    w = nh.requests_waiting
    if w is not None and w > cfg.queue_critical:
        soft = f"queue: {w:.0f} waiting > {cfg.queue_critical:g}"
    elif w is not None and w > cfg.queue_warning:
        factor *= cfg.queue_warning_weight_factor
    if not soft and nh.gpu_free_ratio is not None and nh.gpu_free_ratio < cfg.gpu_min_free_ratio:
        soft = f"GPU memory free {nh.gpu_free_ratio * 100:.1f} % < {cfg.gpu_min_free_ratio * 100:g} %"
    return NodeRouting("HEALTHY", factor, soft_block=soft)


def route(nh: NodeHealth, capacity: int, cfg: HealthConfig) -> Routing:
    """A node's Routing on its own (no cluster policy): full weight = capacity x 100 x factor.

    Weight is never the way to eject (Envoy NACKs 0): not-routed nodes keep their full weight
    and get health_status UNHEALTHY (or DRAINING), so Envoy keeps their stats.
    """
    nr = node_routing(nh, cfg)
    full = capacity * 100
    if nr.status != "HEALTHY" or nr.soft_block:
        return Routing(full, "UNHEALTHY" if nr.status == "HEALTHY" else nr.status)
    return Routing(max(1, int(round(full * nr.factor))), "HEALTHY")
