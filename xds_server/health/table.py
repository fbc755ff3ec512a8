"""The node state machine as data: ``(state, signal) -> (effect, next state)``.

:data:`TABLE` is the single source of the state machine. :func:`apply` looks a pair up, runs the
effect (which updates the node's records and may give a reason) and enters the next state. A pair
that is not in the table raises :class:`InvalidTransition`; pairs that legitimately do nothing
are in the table as explicit no-ops. :func:`render_diagram` draws the table's edges (the diagram
in :mod:`xds_server.health.model` is this output, checked by a test).

Signals are what observations and time produce; :mod:`xds_server.health.rules` derives them.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from xds_server.config import HealthConfig
from xds_server.health.clocks import required_clean_s
from xds_server.health.records import (
    MACHINE_STATES,
    ROUTED_STATES,
    EjectionCause,
    Event,
    NodeHealth,
    NodeState,
    Ramp,
)

__all__ = [
    "PREVIOUS",
    "TABLE",
    "Ctx",
    "Fired",
    "InvalidTransition",
    "Signal",
    "Transition",
    "apply",
    "render_diagram",
]


class Signal(enum.Enum):
    """What observations and time produce. Values are the labels of the state diagram.

    MISS_THRESHOLD: ``consecutive_misses`` reached; GOOD_PROBES_RECOVER: this good probe makes
    ``good_probes_to_recover``; FAILURES_REACH_EJECT: this failure makes
    ``probe_failures_to_eject``; HEALTHY_RUN_MET: HEALTHY for ``probation_clean_max_s`` (the
    doubled clean period is forgotten); FORGIVENESS_PENDING: fail-static ended while the node
    was still silent.
    """

    HEARTBEAT = "heartbeat"
    MISS_THRESHOLD = "miss threshold"
    PHI_SUSPICION = "phi suspicion"
    SUSPICION_DISPROVED = "phi suspicion disproved"
    PING = "ping"
    PROBE_GOOD = "probe good"
    GOOD_PROBES_RECOVER = "good probes to recover"
    PROBE_SLOW = "probe slow"
    PROBE_BUSY = "probe busy"
    PROBE_FAIL = "probe fail"
    FAILURES_REACH_EJECT = "failures to eject"
    PROBE_FATAL = "probe fatal"
    STALL = "stall"
    STALL_CONFIRMED = "stall confirmed"
    ENGINE_FAILED = "engine FAILED"
    GPU_FATAL = "GPU fatal"
    ENGINE_RESTARTING = "engine restarting"
    CLEAN_PERIOD_MET = "clean period met"
    RAMP_STEP = "ramp step"
    RAMP_HELD = "ramp held"
    RAMP_COMPLETE = "ramp complete"
    HEALTHY_RUN_MET = "long healthy run"
    FAIL_STATIC_FORGIVES = "fail-static forgives"
    FORGIVENESS_PENDING = "fail-static ended while silent"
    DRAIN = "drain"
    UNDRAIN = "undrain"


class _Previous:
    """Next-state marker: back to the state the node had before its ejection."""

    def __repr__(self) -> str:
        return "PREVIOUS"


PREVIOUS = _Previous()


class InvalidTransition(Exception):
    """A (state, signal) pair that is not in :data:`TABLE` (or a PREVIOUS with nowhere to go)."""

    def __init__(self, state: NodeState, signal: Signal, why: str = "not in the transition table") -> None:
        super().__init__(f"({state.value}, {signal.name}): {why}")
        self.state = state
        self.signal = signal


@dataclass(frozen=True, slots=True)
class Fired:
    """One occurrence of a signal: ``detail`` describes it (reason text); ``arg`` is a number
    some signals carry (RAMP_STEP: steps; FORGIVENESS_PENDING: burst start, s)."""

    signal: Signal
    detail: str = ""
    arg: float = 0.0


@dataclass(slots=True)
class Ctx:
    """The step being applied: time (s), config, and the transitions so far."""

    now_s: float
    cfg: HealthConfig
    events: list[Event]


Effect = Callable[[NodeHealth, Fired, Ctx], "tuple[NodeHealth, str | None]"]
"""``effect(nh, fired, ctx) -> (nh, reason)``: new records (state unchanged) and the reason
(required when the state changes; None keeps the current one when it does not)."""


@dataclass(frozen=True, slots=True)
class Transition:
    """What a signal does in a state: ``effect``, then ``next`` (a state, or PREVIOUS)."""

    effect: Effect
    next: NodeState | _Previous


# ---- effects ------------------------------------------------------------------------------


def _noop(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return nh, None


def _with_detail(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return nh, f.detail


def _eject(cause: EjectionCause, reason: Callable[[NodeHealth, Fired], str] | None = None) -> Effect:
    """Move to UNHEALTHY for ``cause``. A failure in PROBATION doubles the next clean period (capped)."""

    def effect(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
        text = f.detail if reason is None else reason(nh, f)
        clean = required_clean_s(nh, c.cfg)
        if nh.state is NodeState.PROBATION:
            clean = min(clean * 2.0, c.cfg.probation_clean_max_s)
            text += f"; failed in PROBATION at {nh.ramp.percent:.0f} %, next clean period {clean:.0f} s"
        return replace(
            nh, ejection=replace(nh.ejection, cause=cause, from_state=nh.state, clean_period_s=clean),
            probe=replace(nh.probe, clean_since_s=None, clean_probes=0), ramp=replace(nh.ramp, percent=0.0),
        ), text

    return effect


def _counted(nh: NodeHealth) -> NodeHealth:
    """One more consecutive probe failure (a stall counts as a timeout); the clean run ends."""
    return replace(nh, probe=replace(nh.probe, consecutive_failures=nh.probe.consecutive_failures + 1,
                                     consecutive_good=0, clean_since_s=None, clean_probes=0))


def _then(first: Callable[[NodeHealth], NodeHealth], effect: Effect) -> Effect:
    return lambda nh, f, c: effect(first(nh), f, c)


_fail_to_degraded: Effect = lambda nh, f, c: (_counted(nh), f"probe failure: {f.detail}")
_eject_in_probation = _then(_counted, _eject(EjectionCause.PROBE, lambda nh, f: f"probe failure in PROBATION: {f.detail}"))
_eject_on_count = _then(_counted, _eject(
    EjectionCause.PROBE, lambda nh, f: f"probe: {nh.probe.consecutive_failures} consecutive failures, last {f.detail}"))


def _good(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    good = nh.probe.consecutive_good + 1
    return replace(nh, probe=replace(nh.probe, consecutive_good=good)), None


def _recovered(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    good = nh.probe.consecutive_good + 1
    return nh, f"{good} consecutive good probes (last {f.detail})"


def _not_good(reason: bool) -> Effect:
    def effect(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
        return replace(nh, probe=replace(nh.probe, consecutive_good=0)), (f.detail if reason else None)

    return effect


def _first_good_probe(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return nh, f"first good probe ({f.detail}); ramping from {c.cfg.ramp_start_percent:g} %"


def _fatal_while_out(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return replace(nh, ejection=replace(nh.ejection, cause=EjectionCause.ENGINE)), f.detail


def _first_heartbeat(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return nh, f"first heartbeat (engine {nh.engine.state})"


def _heartbeats_resumed(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    if nh.ejection.cause not in (EjectionCause.HEARTBEAT, EjectionCause.PHI):
        return nh, None
    return nh, (f"heartbeats resumed; clean period {required_clean_s(nh, c.cfg):.0f} s "
                "of good probes before PROBATION")


def _disproved(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    hb = nh.heartbeat
    return replace(nh, heartbeat=replace(hb, suspicion_clears=hb.suspicion_clears + (c.now_s,))), f.detail


def _forgiven(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return replace(nh, ejection=replace(nh.ejection, forgive_since_s=None, forgive_until_s=0.0)), (
        "heartbeat loss forgiven: it was part of a fleet-wide loss (fail-static), heartbeats flow again")


def _forgive_later(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """Still silent when fail-static ended: forgive it too if heartbeats resume within the window."""
    until = c.now_s + c.cfg.fail_static_forgive_intervals * c.cfg.heartbeat_interval_ms / 1000.0
    return replace(nh, ejection=replace(nh.ejection, forgive_since_s=f.arg, forgive_until_s=until)), None


def _restarting(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return replace(nh, probe=replace(nh.probe, consecutive_failures=0, clean_since_s=None, clean_probes=0)), f.detail


def _stall_counted(n: int) -> Effect:
    return lambda nh, f, c: (replace(nh, engine=replace(nh.engine, stall_counted=n)), None)


def _proven_by_count(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """Already out (probe, engine or phi): now proven by the count rule."""
    if nh.ejection.cause is EjectionCause.HEARTBEAT:
        return nh, None
    return replace(nh, ejection=replace(nh.ejection, cause=EjectionCause.HEARTBEAT),
                   probe=replace(nh.probe, clean_since_s=None, clean_probes=0)), f.detail


def _baseline(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """While HEALTHY, the slow RTT baseline follows the EWMA (``rtt_baseline_alpha``)."""
    r, b = nh.rtt, c.cfg.rtt_baseline_alpha
    if r.ewma_ms is None:
        return nh, None
    base = r.ewma_ms if r.baseline_ms is None else b * r.ewma_ms + (1 - b) * r.baseline_ms
    return replace(nh, rtt=replace(r, baseline_ms=base)), None


def _ramp_step(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    steps = int(f.arg)
    pct = min(100.0, nh.ramp.percent + steps * c.cfg.ramp_step_percent)
    at = (nh.ramp.step_at_s or 0.0) + steps * c.cfg.ramp_step_s
    return replace(nh, ramp=Ramp(pct, at)), f"PROBATION ramp {pct:g} %"


def _ramp_held(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return replace(nh, ramp=replace(nh.ramp, step_at_s=c.now_s)), f"ramp held at {nh.ramp.percent:g} %: last probe slow"


def _ramp_complete(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return replace(nh, ramp=replace(nh.ramp, percent=100.0)), "ramp complete (100 %)"


def _clean_period_met(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    p = nh.probe
    clean_for = c.now_s - (p.clean_since_s if p.clean_since_s is not None else c.now_s)
    rtt = "" if nh.rtt.ewma_ms is None else f", EWMA RTT {nh.rtt.ewma_ms:.1f} ms"
    return nh, (f"{clean_for:.0f} s of successful probes ({p.clean_probes} probes{rtt}); "
                f"ramping from {c.cfg.ramp_start_percent:g} %")


def _forget_backoff(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return replace(nh, ejection=replace(nh.ejection, clean_period_s=0.0)), None


def _drain(active: bool) -> Effect:
    def effect(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
        if active:
            c.events.append(Event(c.now_s, nh.node_id, nh.state, NodeState.DRAINING, f"drain requested: {f.detail}"))
            return replace(nh, drain=replace(nh.drain, active=True, since_s=c.now_s)), None
        c.events.append(Event(c.now_s, nh.node_id, NodeState.DRAINING, nh.state, f"undrained: {f.detail}"))
        return replace(nh, drain=replace(nh.drain, active=False, since_s=None)), None

    return effect


# ---- the table ----------------------------------------------------------------------------

S, G = NodeState, Signal
COLD, WARMING, PROBATION, HEALTHY, DEGRADED, UNHEALTHY = (
    S.COLD, S.WARMING, S.PROBATION, S.HEALTHY, S.DEGRADED, S.UNHEALTHY)
ROUTED = (PROBATION, HEALTHY, DEGRADED)
_STAY = None  # next state: the one the node is in

# (states, signals, effect, next state or _STAY). Each (state, signal) pair appears once.
_SPEC: tuple[tuple[tuple[NodeState, ...], tuple[Signal, ...], Effect, NodeState | _Previous | None], ...] = (
    # heartbeats and liveness
    ((COLD,), (G.HEARTBEAT,), _first_heartbeat, WARMING),
    ((WARMING, *ROUTED), (G.HEARTBEAT,), _noop, _STAY),
    ((UNHEALTHY,), (G.HEARTBEAT,), _heartbeats_resumed, _STAY),
    (ROUTED, (G.MISS_THRESHOLD,), _eject(EjectionCause.HEARTBEAT), UNHEALTHY),
    ((UNHEALTHY,), (G.MISS_THRESHOLD,), _proven_by_count, _STAY),
    (ROUTED, (G.PHI_SUSPICION,), _eject(EjectionCause.PHI), UNHEALTHY),
    ((WARMING,), (G.MISS_THRESHOLD, G.PHI_SUSPICION), _noop, _STAY),   # not routed: nothing to eject
    ((UNHEALTHY,), (G.PHI_SUSPICION,), _noop, _STAY),                  # already out
    ((UNHEALTHY,), (G.SUSPICION_DISPROVED,), _disproved, PREVIOUS),
    ((UNHEALTHY,), (G.FAIL_STATIC_FORGIVES,), _forgiven, PREVIOUS),
    ((UNHEALTHY,), (G.FORGIVENESS_PENDING,), _forgive_later, _STAY),
    ((WARMING, *ROUTED), (G.FORGIVENESS_PENDING,), _noop, _STAY),
    ((HEALTHY,), (G.PING,), _baseline, _STAY),
    ((COLD, WARMING, PROBATION, DEGRADED, UNHEALTHY), (G.PING,), _noop, _STAY),
    # probes: startup grace in COLD/WARMING; UNHEALTHY only keeps the clean-run bookkeeping
    ((COLD,), (G.PROBE_GOOD, G.GOOD_PROBES_RECOVER, G.PROBE_SLOW, G.PROBE_BUSY, G.PROBE_FAIL,
               G.FAILURES_REACH_EJECT, G.PROBE_FATAL), _noop, _STAY),
    ((WARMING,), (G.PROBE_GOOD, G.GOOD_PROBES_RECOVER, G.PROBE_SLOW), _first_good_probe, PROBATION),
    ((WARMING,), (G.PROBE_BUSY, G.PROBE_FAIL, G.FAILURES_REACH_EJECT, G.PROBE_FATAL), _noop, _STAY),
    ((UNHEALTHY,), (G.PROBE_GOOD, G.GOOD_PROBES_RECOVER, G.PROBE_SLOW, G.PROBE_BUSY, G.PROBE_FAIL,
                    G.FAILURES_REACH_EJECT), _noop, _STAY),
    ((UNHEALTHY,), (G.PROBE_FATAL,), _fatal_while_out, _STAY),
    (ROUTED, (G.PROBE_GOOD,), _good, _STAY),
    ((PROBATION, HEALTHY), (G.GOOD_PROBES_RECOVER,), _good, _STAY),
    ((DEGRADED,), (G.GOOD_PROBES_RECOVER,), _recovered, HEALTHY),
    ((HEALTHY,), (G.PROBE_SLOW, G.PROBE_BUSY), _with_detail, DEGRADED),
    ((PROBATION, DEGRADED), (G.PROBE_SLOW,), _not_good(reason=False), _STAY),  # PROBATION: the ramp holds
    ((PROBATION,), (G.PROBE_BUSY,), _not_good(reason=False), _STAY),
    ((DEGRADED,), (G.PROBE_BUSY,), _not_good(reason=True), _STAY),
    ((HEALTHY,), (G.PROBE_FAIL,), _fail_to_degraded, DEGRADED),
    ((DEGRADED,), (G.PROBE_FAIL,), _fail_to_degraded, _STAY),
    ((PROBATION,), (G.PROBE_FAIL, G.FAILURES_REACH_EJECT), _eject_in_probation, UNHEALTHY),
    ((HEALTHY, DEGRADED), (G.FAILURES_REACH_EJECT,), _eject_on_count, UNHEALTHY),
    (ROUTED, (G.PROBE_FATAL,), _eject(EjectionCause.ENGINE), UNHEALTHY),
    # engine and GPU (telemetry)
    (ROUTED, (G.STALL,), _stall_counted(1), _STAY),
    (ROUTED, (G.STALL_CONFIRMED,), _stall_counted(2), _STAY),
    (ROUTED, (G.GPU_FATAL,), _eject(EjectionCause.GPU), UNHEALTHY),
    (ROUTED, (G.ENGINE_FAILED,), _eject(EjectionCause.ENGINE), UNHEALTHY),
    (ROUTED, (G.ENGINE_RESTARTING,), _restarting, WARMING),
    ((WARMING, UNHEALTHY), (G.STALL, G.STALL_CONFIRMED, G.GPU_FATAL, G.ENGINE_FAILED, G.ENGINE_RESTARTING),
     _noop, _STAY),
    # time: half-open, ramp, backoff
    ((UNHEALTHY,), (G.CLEAN_PERIOD_MET,), _clean_period_met, PROBATION),
    ((WARMING, *ROUTED), (G.CLEAN_PERIOD_MET,), _noop, _STAY),
    ((PROBATION,), (G.RAMP_STEP,), _ramp_step, _STAY),
    ((PROBATION,), (G.RAMP_HELD,), _ramp_held, _STAY),
    ((PROBATION,), (G.RAMP_COMPLETE,), _ramp_complete, HEALTHY),
    ((HEALTHY,), (G.HEALTHY_RUN_MET,), _forget_backoff, _STAY),
    # operator
    (MACHINE_STATES, (G.DRAIN,), _drain(True), _STAY),
    (MACHINE_STATES, (G.UNDRAIN,), _drain(False), _STAY),
)


def _build(spec: Iterable[tuple[tuple[NodeState, ...], tuple[Signal, ...], Effect, NodeState | _Previous | None]],
           ) -> Mapping[tuple[NodeState, Signal], Transition]:
    table: dict[tuple[NodeState, Signal], Transition] = {}
    for states, signals, effect, nxt in spec:
        for st in states:
            for sig in signals:
                if (st, sig) in table:
                    raise ValueError(f"duplicate transition ({st.value}, {sig.name})")
                table[(st, sig)] = Transition(effect, st if nxt is None else nxt)
    return MappingProxyType(table)


TABLE: Mapping[tuple[NodeState, Signal], Transition] = _build(_SPEC)
"""Every valid (state, signal) pair -> Transition. Read-only."""


# ---- the engine ---------------------------------------------------------------------------


def apply(nh: NodeHealth, fired: Fired, ctx: Ctx) -> NodeHealth:
    """Apply one signal through the table. Raises :class:`InvalidTransition` for a pair not in
    it, or for PREVIOUS when the node has no routed state to return to."""
    t = TABLE.get((nh.state, fired.signal))
    if t is None:
        raise InvalidTransition(nh.state, fired.signal)
    target = t.next
    if isinstance(target, _Previous):
        target = nh.ejection.from_state
        if target not in ROUTED_STATES:
            raise InvalidTransition(nh.state, fired.signal, f"no routed state to return to ({target})")
    out, reason = t.effect(nh, fired, ctx)
    if target is nh.state:
        return out if reason is None else replace(out, reason=reason)
    if reason is None:
        raise InvalidTransition(nh.state, fired.signal, "a transition without a reason")
    return _enter(out, target, reason, ctx)


def _enter(nh: NodeHealth, state: NodeState, reason: str, ctx: Ctx) -> NodeHealth:
    """Enter ``state``: record the event and reset what every transition resets."""
    now = ctx.now_s
    ctx.events.append(Event(now, nh.node_id, nh.state, state,
                            f"(while draining) {reason}" if nh.drain.active else reason))
    ej = nh.ejection
    if state is not NodeState.UNHEALTHY and ej.cause is not None:
        ej = replace(ej, cause=None)
    if state is NodeState.HEALTHY:
        ej = replace(ej, healthy_since_s=now)
    elif nh.state is NodeState.HEALTHY:
        ej = replace(ej, healthy_since_s=None)
    ramp = nh.ramp
    if state is NodeState.PROBATION:  # every probation starts its ramp afresh
        ramp = Ramp(ctx.cfg.ramp_start_percent, now)
    elif ramp.step_at_s is not None:
        ramp = replace(ramp, step_at_s=None)
    probe = replace(nh.probe, consecutive_good=0) if nh.probe.consecutive_good else nh.probe
    return replace(nh, state=state, reason=reason, since_s=now, ejection=ej, ramp=ramp, probe=probe)


def render_diagram(width: int = 92) -> str:
    """The table's state-changing edges: one entry per (from, to), signals in enum order."""
    edges: dict[tuple[NodeState, str], list[Signal]] = {}
    for (st, sig), t in TABLE.items():
        if t.next is st:
            continue
        to = "(previous)" if isinstance(t.next, _Previous) else t.next.value
        edges.setdefault((st, to), []).append(sig)
    order = {s: i for i, s in enumerate(MACHINE_STATES)}
    lines: list[str] = []
    for (st, to), sigs in sorted(edges.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        line = f"{st.value:<10} ──► {to:<11}"
        for label in (s.value for s in sorted(sigs, key=list(Signal).index)):
            if len(line) + len(label) + 3 > width:
                lines.append(line.rstrip())
                line = " " * 27
            line += f" {label} |" if line.strip() else f"{label} |"
        lines.append(line.rstrip(" |"))
    return "\n".join(lines)
