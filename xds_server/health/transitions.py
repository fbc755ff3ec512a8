"""The node state machine as data: ``(state, signal) -> (effect, next state)``.

:data:`TABLE` is the single source of the state machine. :func:`apply` looks a pair up, runs the
effect (which updates the node's records and may give a reason) and enters the next state. A pair
that is not in the table raises :class:`InvalidTransition`; pairs that legitimately do nothing
are in the table as explicit no-ops. :func:`render_diagram` draws the table's edges (the diagram
in :mod:`xds_server.health.model` is this output, checked by a test).

Signals are what observations and time produce; :mod:`xds_server.health.rules` derives them.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType

from xds_server.health import effects as fx
from xds_server.health import switchback_rules as sb
from xds_server.health.records import MACHINE_STATES, ROUTED_STATES, EjectionCause, Event, NodeHealth, NodeState, Ramp
from xds_server.health.signals import PREVIOUS, Ctx, Effect, Fired, InvalidTransition, Previous, Signal, Transition
from xds_server.health.switchback_records import Validation, ValidationVerdict

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


# ---- the table ----------------------------------------------------------------------------

S, G = NodeState, Signal
COLD, WARMING, PROBATION, HEALTHY, DEGRADED, REFUSING, UNHEALTHY = (
    S.COLD, S.WARMING, S.PROBATION, S.HEALTHY, S.DEGRADED, S.REFUSING, S.UNHEALTHY)
ROUTED = (PROBATION, HEALTHY, DEGRADED, REFUSING)  # REFUSING: a soft block (see records.ROUTED_STATES)
_PROBES = (G.PROBE_GOOD, G.GOOD_PROBES_RECOVER, G.PROBE_SLOW, G.PROBE_BUSY, G.PROBE_REFUSED, G.REFUSED_TOO_LONG,
           G.PROBE_FAIL, G.FAILURES_REACH_EJECT, G.PROBE_FATAL)
_STAY = None  # next state: the one the node is in

# (states, signals, effect, next state or _STAY). Each (state, signal) pair appears once.
_SPEC: tuple[tuple[tuple[NodeState, ...], tuple[Signal, ...], Effect, NodeState | Previous | None], ...] = (
    # heartbeats and liveness
    ((COLD,), (G.HEARTBEAT,), fx.first_heartbeat, WARMING),
    ((WARMING, *ROUTED), (G.HEARTBEAT,), fx.noop, _STAY),
    ((UNHEALTHY,), (G.HEARTBEAT,), fx.heartbeats_resumed, _STAY),
    (ROUTED, (G.MISS_THRESHOLD,), fx.eject(EjectionCause.HEARTBEAT), UNHEALTHY),
    ((UNHEALTHY,), (G.MISS_THRESHOLD,), fx.proven_by_count, _STAY),
    (ROUTED, (G.PHI_SUSPICION,), fx.eject(EjectionCause.PHI), UNHEALTHY),
    (ROUTED, (G.TRANSPORT_SUSPICION,), fx.eject(EjectionCause.TRANSPORT), UNHEALTHY),
    ((WARMING,), (G.MISS_THRESHOLD, G.PHI_SUSPICION, G.TRANSPORT_SUSPICION), fx.noop, _STAY),  # not routed
    ((UNHEALTHY,), (G.PHI_SUSPICION, G.TRANSPORT_SUSPICION), fx.noop, _STAY),                 # already out
    ((UNHEALTHY,), (G.SUSPICION_DISPROVED,), fx.disproved, PREVIOUS),
    ((UNHEALTHY,), (G.FAIL_STATIC_FORGIVES,), fx.forgiven, PREVIOUS),
    ((UNHEALTHY,), (G.FORGIVENESS_PENDING,), fx.forgive_later, _STAY),
    ((WARMING, *ROUTED), (G.FORGIVENESS_PENDING,), fx.noop, _STAY),
    ((HEALTHY,), (G.PING,), fx.baseline, _STAY),
    ((COLD, WARMING, PROBATION, DEGRADED, REFUSING, UNHEALTHY), (G.PING,), fx.noop, _STAY),
    # probes: startup grace in COLD/WARMING; UNHEALTHY only keeps the clean-run bookkeeping
    # (failures counted and the last one shown, never ejected: "cannot warm" is a reason and an event)
    ((COLD,), (G.PROBE_GOOD, G.GOOD_PROBES_RECOVER, G.PROBE_SLOW), fx.noop, _STAY),
    ((WARMING,), (G.PROBE_GOOD, G.GOOD_PROBES_RECOVER, G.PROBE_SLOW), fx.first_good_probe, PROBATION),
    ((COLD, WARMING), (G.PROBE_BUSY, G.PROBE_REFUSED, G.REFUSED_TOO_LONG), fx.warming_probe(count=False), _STAY),
    ((COLD, WARMING), (G.PROBE_FAIL, G.FAILURES_REACH_EJECT, G.PROBE_FATAL), fx.warming_probe(count=True), _STAY),
    # an answer while the agent is not heard promotes nothing (routing it, the next Tick would eject it
    # by the count rule for a whole clean period); the next heartbeat clears the misses
    ((WARMING,), (G.PROBE_UNHEARD,), fx.unheard, _STAY),
    ((COLD, *ROUTED, UNHEALTHY), (G.PROBE_UNHEARD,), fx.noop, _STAY),
    ((UNHEALTHY,), _PROBES[:-1], fx.noop, _STAY),
    ((UNHEALTHY,), (G.PROBE_FATAL,), fx.fatal_while_out, _STAY),
    ((PROBATION, HEALTHY, DEGRADED), (G.PROBE_GOOD,), fx.good, _STAY),
    ((PROBATION, HEALTHY), (G.GOOD_PROBES_RECOVER,), fx.good, _STAY),
    ((DEGRADED,), (G.GOOD_PROBES_RECOVER,), fx.recovered, HEALTHY),
    ((HEALTHY,), (G.PROBE_SLOW,), fx.slow_to_degraded, DEGRADED),
    ((HEALTHY,), (G.PROBE_BUSY, G.PROBE_REFUSED), fx.with_detail, DEGRADED),
    ((PROBATION,), (G.PROBE_SLOW,), fx.not_good(reason=False), _STAY),  # PROBATION: the ramp holds
    ((DEGRADED,), (G.PROBE_SLOW,), fx.not_good(reason=False), _STAY),  # a busy node's queued probe: still busy
    ((PROBATION,), (G.PROBE_BUSY, G.PROBE_REFUSED), fx.not_good(reason=False), _STAY),
    ((DEGRADED,), (G.PROBE_BUSY, G.PROBE_REFUSED), fx.not_good(reason=True), _STAY),
    ((HEALTHY,), (G.PROBE_FAIL,), fx.fail_to_degraded, DEGRADED),
    ((DEGRADED,), (G.PROBE_FAIL,), fx.fail_to_degraded, _STAY),
    ((PROBATION,), (G.PROBE_FAIL, G.FAILURES_REACH_EJECT), fx.eject_in_probation, UNHEALTHY),
    ((HEALTHY, DEGRADED, REFUSING), (G.FAILURES_REACH_EJECT,), fx.eject_on_count, UNHEALTHY),
    (ROUTED, (G.PROBE_FATAL,), fx.eject(EjectionCause.ENGINE), UNHEALTHY),
    # busy: a run of only refusals (429) for busy_refusal_block_s is a soft block (REFUSING) until
    # the engine takes a probe again; it was busy, not failed: no probation, no ramp
    ((PROBATION, HEALTHY, DEGRADED), (G.REFUSED_TOO_LONG,), fx.refusing, REFUSING),
    ((REFUSING,), (G.PROBE_REFUSED, G.REFUSED_TOO_LONG), fx.refusing, _STAY),
    ((REFUSING,), (G.GOOD_PROBES_RECOVER,), fx.refusal_over, HEALTHY),
    ((REFUSING,), (G.PROBE_GOOD, G.PROBE_SLOW, G.PROBE_BUSY), fx.refusal_over, DEGRADED),
    ((REFUSING,), (G.PROBE_FAIL,), fx.refusing_failure, _STAY),
    # engine and GPU (telemetry)
    (ROUTED, (G.STALL,), fx.stall_counted(1), _STAY),
    (ROUTED, (G.STALL_CONFIRMED,), fx.stall_counted(2), _STAY),
    (ROUTED, (G.GPU_FATAL,), fx.eject(EjectionCause.GPU), UNHEALTHY),
    (ROUTED, (G.ENGINE_FAILED,), fx.eject(EjectionCause.ENGINE), UNHEALTHY),
    (ROUTED, (G.ENGINE_RESTARTING,), fx.restarting, WARMING),
    ((WARMING, UNHEALTHY), (G.STALL, G.STALL_CONFIRMED, G.ENGINE_FAILED, G.ENGINE_RESTARTING), fx.noop, _STAY),
    ((WARMING,), (G.GPU_FATAL,), fx.gpu_lost_while_warming, _STAY),   # a good probe cannot promote it
    ((UNHEALTHY,), (G.GPU_FATAL,), fx.noop, _STAY),
    # real traffic across Envoys (LRS; policy/traffic_ejection.py decides, under max_ejection_percent)
    (ROUTED, (G.TRAFFIC_FAILING,), fx.eject(EjectionCause.TRAFFIC), UNHEALTHY),
    ((COLD, WARMING, UNHEALTHY), (G.TRAFFIC_FAILING,), fx.noop, _STAY),
    # time: half-open, ramp, backoff
    ((UNHEALTHY,), (G.CLEAN_PERIOD_MET,), fx.clean_period_met, PROBATION),
    ((WARMING, *ROUTED), (G.CLEAN_PERIOD_MET,), fx.noop, _STAY),
    ((PROBATION,), (G.RAMP_STEP,), fx.ramp_step, _STAY),
    ((PROBATION,), (G.RAMP_HELD,), fx.ramp_held, _STAY),
    ((PROBATION,), (G.RAMP_COMPLETE,), sb.ramp_complete, HEALTHY),
    # switch-back validation (health/switchback_rules.py): the ramp's end waits for a verdict
    ((PROBATION,), (G.VALIDATION_PENDING,), sb.pending, _STAY),
    ((PROBATION,), (G.VALIDATION_PASSED,), sb.passed, _STAY),
    ((PROBATION,), (G.VALIDATION_FAILED,), sb.failed, UNHEALTHY),
    ((COLD, WARMING, HEALTHY, DEGRADED, REFUSING, UNHEALTHY), (G.VALIDATION_PASSED, G.VALIDATION_FAILED), fx.noop,
     _STAY),
    ((HEALTHY,), (G.HEALTHY_RUN_MET,), fx.forget_backoff, _STAY),
    # operator
    (MACHINE_STATES, (G.DRAIN,), fx.drain(True), _STAY),
    (MACHINE_STATES, (G.UNDRAIN,), fx.drain(False), _STAY),
)


def _build(spec: Iterable[tuple[tuple[NodeState, ...], tuple[Signal, ...], Effect, NodeState | Previous | None]],
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
    if isinstance(target, Previous):
        before = nh.ejection.from_state
        if before is None or before not in ROUTED_STATES:
            raise InvalidTransition(nh.state, fired.signal, f"no routed state to return to ({before})")
        target = before
    out, reason = t.effect(nh, fired, ctx)
    if target is nh.state:
        return out if reason is None else replace(out, reason=reason)
    if reason is None:
        raise InvalidTransition(nh.state, fired.signal, "a transition without a reason")
    return _enter(out, target, reason, ctx)


def _enter(nh: NodeHealth, state: NodeState, reason: str, ctx: Ctx) -> NodeHealth:
    """Enter ``state``: record the event and reset what every transition resets."""
    now = ctx.now_s
    if state is NodeState.PROBATION and ctx.cfg.validation.enabled:
        reason = f"{reason}; unrouted until switch-back validation passes (a replay against two healthy peers)"
    ctx.events.append(Event(now, nh.node_id, nh.state, state,
                            f"(while draining) {reason}" if nh.drain.active else reason))
    ej = nh.ejection
    if state is not NodeState.UNHEALTHY and ej.cause is not None:
        ej = replace(ej, cause=None)
    if state is NodeState.HEALTHY:
        ej = replace(ej, healthy_since_s=now)
    elif nh.state is NodeState.HEALTHY:
        ej = replace(ej, healthy_since_s=None)
    ramp, validation = nh.ramp, nh.validation
    if state is NodeState.PROBATION and ctx.cfg.validation.enabled:
        # switch-back validation before the first request: unrouted, no ramp, until a verdict
        # (health/switchback_rules.py); every probation asks afresh
        ramp = Ramp(ctx.cfg.probation.ramp_start_percent, None)
        validation = Validation(ValidationVerdict.PENDING, "", now)
    elif state is NodeState.PROBATION:  # every probation starts its ramp afresh
        ramp, validation = Ramp(ctx.cfg.probation.ramp_start_percent, now), Validation()
    elif ramp.step_at_s is not None:
        ramp = replace(ramp, step_at_s=None)
    probe = replace(nh.probe, consecutive_good=0) if nh.probe.consecutive_good else nh.probe
    if probe.warm_reported and not (nh.state is NodeState.COLD and state is NodeState.WARMING):
        probe = replace(probe, warm_reported=False)  # "cannot warm" is reported once per COLD/WARMING episode
    return replace(nh, state=state, reason=reason, since_s=now, ejection=ej, ramp=ramp, probe=probe,
                   validation=validation)


def render_diagram(width: int = 92) -> str:
    """The table's state-changing edges: one entry per (from, to), signals in enum order."""
    edges: dict[tuple[NodeState, str], list[Signal]] = {}
    for (st, sig), t in TABLE.items():
        if t.next is st:
            continue
        to = "(previous)" if isinstance(t.next, Previous) else t.next.value
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
