"""From observations to signals: the health model's ``step``.

``step(nh, obs, now_s, cfg) -> (nh, events)`` first records what the observation says in the
node's records (bookkeeping that does not depend on the state), then runs the observation's rules
in order. Each rule reads the node as it is after the signals before it, and gives zero or more
signals; each signal goes through :func:`xds_server.health.transitions.apply`. Rules read records, not
the state: what a signal does in each state is the table's business alone. After heartbeats,
silence, pings and probes the time rules run (stall confirmation, clean period, ramp, backoff;
:mod:`xds_server.health.time_rules`).

Thresholds are fields of :class:`~xds_server.config.HealthConfig` (defaults and sources there).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar, cast

from xds_server.config import HealthConfig
from xds_server.health import phi as phimod
from xds_server.health.beats import quiet_heartbeat, record_heartbeat
from xds_server.health.clocks import EPS_S, misses_at, phi_delay_s, transport_suspected
from xds_server.health.outcome import answered_failure, classify_probe, is_refusal, judge_busy_timeout, refusal_evidence
from xds_server.health.records import (
    ROUTED_STATES,
    SUSPICIONS,
    DrainRequested,
    EjectionCause,
    EngineState,
    Event,
    FailStaticEnded,
    HeartbeatObserved,
    NodeHealth,
    Observation,
    PingObserved,
    ProbeObserved,
    ProbeOutcome,
    ProbeResultKind,
    StreamClosed,
    Tick,
    TrafficFailing,
)
from xds_server.health.switchback_records import ValidationObserved
from xds_server.health.switchback_rules import verdict_signals
from xds_server.health.time_rules import TIME_RULES, failure
from xds_server.health.transitions import Ctx, Fired, Signal, apply

__all__ = ["step"]


@dataclass(slots=True)
class _StepCtx(Ctx):
    """Ctx plus what the recording phase saw before it overwrote the records."""

    gap_ms: float | None = None                     # silence before this heartbeat
    prev_engine: EngineState | None = None          # engine state before this heartbeat
    pending: tuple[float, float] | None = None      # (burst start, until) of a pending forgiveness
    outcome: ProbeOutcome = ProbeOutcome.GOOD
    what: str = ""
    busy_verdict: tuple[bool, str] | None = None    # a busy-read timeout judged by this heartbeat


Record = Callable[[NodeHealth, Observation, _StepCtx], NodeHealth]
Rule = Callable[[NodeHealth, Observation, _StepCtx], Sequence[Fired]]
_O = TypeVar("_O", bound=Observation)
_NONE: tuple[Fired, ...] = ()
# Signals without a detail, built once (Fired is immutable): these fire on most steps.
_HEARTBEAT = (Fired(Signal.HEARTBEAT),)
_PING = (Fired(Signal.PING),)


def step(nh: NodeHealth, obs: Observation, now_s: float, cfg: HealthConfig) -> tuple[NodeHealth, list[Event]]:
    """Apply one observation at ``now_s``; return the new health and the transitions it caused.

    Rules (thresholds from ``cfg``): heartbeats: ``consecutive_misses`` misses (a closed stream
    counts one at once) or a phi suspicion -> UNHEALTHY. Probes: TTFT < ``probes.ttft_healthy`` is
    good; up to ``probes.ttft_timeout`` or one failure -> DEGRADED; ``probe_failures_to_eject``
    consecutive failures or one ENGINE_FATAL -> UNHEALTHY; DEGRADED -> HEALTHY after
    ``good_probes_to_recover`` good probes. A timeout or an HTTP status in
    ``saturated_http_statuses`` while the engine is busy and its token counter advances is
    saturation, not death (DEGRADED only, field case fc07). A STALLED engine counts as one probe
    timeout, and as a second one if still stalled after ``probes.stall_confirm`` (fc06).
    COLD/WARMING: not routed, failures counted but never ejecting ("cannot warm").

    Raises TypeError for an unknown observation type and
    :class:`~xds_server.health.transitions.InvalidTransition` for a (state, signal) pair the table
    does not have (e.g. a NodeHealth whose ``state`` is DRAINING, which is an overlay only).
    """
    if type(obs) is HeartbeatObserved:
        quiet = quiet_heartbeat(nh, obs, now_s, cfg)
        if quiet is not None:
            return quiet, []
    return _step_full(nh, obs, now_s, cfg)


def _step_full(nh: NodeHealth, obs: Observation, now_s: float, cfg: HealthConfig) -> tuple[NodeHealth, list[Event]]:
    """:func:`step` without the quiet heartbeat's fast path: the recording, then every rule."""
    try:
        record, rules = _OBSERVERS[type(obs)]
    except KeyError:
        raise TypeError(f"unknown observation {obs!r}") from None
    ctx = _StepCtx(now_s, cfg, [])
    nh = record(nh, obs, ctx)
    for rule in rules:
        for fired in rule(nh, obs, ctx):
            nh = apply(nh, fired, ctx)
    return nh, ctx.events


# ---- heartbeats ---------------------------------------------------------------------------


def _record_heartbeat(nh: NodeHealth, hb: HeartbeatObserved, c: _StepCtx) -> NodeHealth:
    nh, (c.gap_ms, c.prev_engine, c.pending) = record_heartbeat(nh, hb, c.now_s, c.cfg)
    if nh.probe.busy_timeout_s is not None:
        c.busy_verdict = judge_busy_timeout(nh, c.now_s, c.cfg)
        if c.busy_verdict is not None:
            nh = replace(nh, probe=replace(nh.probe, busy_timeout_s=None))
    return nh


def _r_busy_judged(nh: NodeHealth, hb: HeartbeatObserved, c: _StepCtx) -> Sequence[Fired]:
    """A timeout read as busy, judged by this heartbeat: busy, or a failure (a hang)."""
    if c.busy_verdict is None:
        return _NONE
    busy, what = c.busy_verdict
    return (Fired(Signal.PROBE_BUSY, what),) if busy else (failure(nh, what, c.cfg),)


def _r_disproved(nh: NodeHealth, hb: HeartbeatObserved, c: _StepCtx) -> Sequence[Fired]:
    cause = nh.ejection.cause
    if cause in SUSPICIONS and nh.ejection.from_state in ROUTED_STATES:
        return (Fired(Signal.SUSPICION_DISPROVED,
                      f"{cause} suspicion disproved: heartbeat arrived after {c.gap_ms or 0.0:.0f} ms"),)
    return _NONE


def _forgivable(nh: NodeHealth, burst_start_s: float) -> bool:
    """Ejected only for lost heartbeats, from a routed state, during the fail-static burst."""
    ej = nh.ejection
    return ((ej.cause is EjectionCause.HEARTBEAT or ej.cause in SUSPICIONS) and ej.from_state in ROUTED_STATES
            and nh.since_s >= burst_start_s)


def _r_forgive_pending(nh: NodeHealth, hb: HeartbeatObserved, c: _StepCtx) -> Sequence[Fired]:
    if c.pending is not None and c.now_s <= c.pending[1] and _forgivable(nh, c.pending[0]):
        return (Fired(Signal.FAIL_STATIC_FORGIVES),)
    return _NONE


def _r_heartbeat(nh: NodeHealth, hb: HeartbeatObserved, c: _StepCtx) -> Sequence[Fired]:
    return _HEARTBEAT


def _r_gpu_fatal(nh: NodeHealth, hb: HeartbeatObserved, c: _StepCtx) -> Sequence[Fired]:
    return (Fired(Signal.GPU_FATAL, f"GPU fatal event: {hb.gpu_fatal}"),) if hb.gpu_fatal else _NONE


def _r_engine_failed(nh: NodeHealth, hb: HeartbeatObserved, c: _StepCtx) -> Sequence[Fired]:
    if hb.engine_state is EngineState.FAILED:
        return (Fired(Signal.ENGINE_FAILED, "agent reports engine FAILED"),)
    return _NONE


def _r_engine_restarting(nh: NodeHealth, hb: HeartbeatObserved, c: _StepCtx) -> Sequence[Fired]:
    if hb.engine_state in (EngineState.COLD, EngineState.WARMING) and c.prev_engine is EngineState.READY:
        return (Fired(Signal.ENGINE_RESTARTING, f"engine restarting (agent reports {hb.engine_state})"),)
    return _NONE


def _r_stall(nh: NodeHealth, hb: HeartbeatObserved, c: _StepCtx) -> Sequence[Fired]:
    if hb.stalled and nh.engine.stall_counted == 0:  # the first report counts as one timeout
        return (Fired(Signal.STALL),
                failure(nh, f"engine STALLED ({hb.stall_detail or 'tokens frozen'})", c.cfg))
    return _NONE


# ---- silence: Tick and StreamClosed -------------------------------------------------------


def _record_silence(nh: NodeHealth, obs: Tick | StreamClosed, c: _StepCtx) -> NodeHealth:
    h = nh.heartbeat
    last = h.last_s
    if last is None:
        return nh
    if h.vouched:  # the stream's transport carries liveness: nothing is missed while it is open
        if type(obs) is not StreamClosed:
            return nh
        last = c.now_s  # it proved the node alive until it ended
        h = replace(h, last_s=last, vouched=False)
    closed = h.stream_closed or isinstance(obs, StreamClosed)
    # A closed stream counts as one miss at once, on top of the heartbeats not arrived.
    misses = max(misses_at(last, c.now_s, c.cfg) + (1 if closed else 0), h.consecutive_misses)
    if isinstance(obs, StreamClosed) and obs.liveness_lost and not transport_suspected(nh, c.cfg):
        misses = max(misses, c.cfg.heartbeat.consecutive_misses)  # the transport's liveness failed: proof
    return replace(nh, heartbeat=replace(h, consecutive_misses=misses, stream_closed=closed))


def _r_silence(nh: NodeHealth, obs: Tick | StreamClosed, c: _StepCtx) -> Sequence[Fired]:
    cfg, h = c.cfg, nh.heartbeat
    if h.last_s is None:
        return _NONE
    gap_ms = (c.now_s - h.last_s) * 1000.0
    if h.consecutive_misses >= cfg.heartbeat.consecutive_misses:
        detail = f"; stream closed: {obs.detail}" if isinstance(obs, StreamClosed) and obs.detail else ""
        return (Fired(Signal.MISS_THRESHOLD, f"heartbeat: {h.consecutive_misses} consecutive misses "
                                             f"(last heartbeat {gap_ms:.0f} ms ago){detail}"),)
    if nh.ejection.cause in SUSPICIONS:
        return _NONE  # suspected already
    if isinstance(obs, StreamClosed) and obs.liveness_lost:  # a suspicion (transport_suspected)
        return (Fired(Signal.TRANSPORT_SUSPICION,
                      f"stream closed: {obs.detail or 'transport lost'}; suspected until "
                      f"{cfg.heartbeat.consecutive_misses} consecutive misses prove it "
                      f"(last heartbeat {gap_ms:.0f} ms ago)"),)
    d = phi_delay_s(nh, cfg)
    if d is None or c.now_s - h.last_s < d - EPS_S:
        return _NONE
    a = h.arrivals
    assert a is not None  # phi_delay_s is None without arrivals
    value = phimod.phi(a, gap_ms, cfg.phi.min_std.ms, cfg.phi.acceptable_pause.ms)
    return (Fired(Signal.PHI_SUSPICION,
                  f"heartbeat: phi {value:.1f} >= {cfg.phi.threshold:g} after {gap_ms:.0f} ms silence "
                  f"(mean interval {a.mean_ms:.0f} ms, sd {math.sqrt(a.var_ms2):.1f} ms)"),)


# ---- pings and probes ---------------------------------------------------------------------


def _record_ping(nh: NodeHealth, obs: PingObserved, c: _StepCtx) -> NodeHealth:
    """Fold a ping's round trip into the EWMA, the sample counting at most ``rtt.spike_factor``
    x the EWMA (at least ``rtt.baseline_slack``): one late answer moves it a little, a lasting
    rise still moves it by a factor per sample. Until ``outlier.min_rtt_samples`` pings the
    EWMA is the smallest round trip seen instead: queueing only adds delay, and the first pings
    of a fleet dialling in at once read our own backlog (2,000 agents: 60-260 ms against a 5 ms
    median, which an EWMA seeded with them still held after 5 pings). ``last_ms`` keeps the
    sample as measured."""
    rc, r = c.cfg.rtt, nh.rtt
    if r.ewma_ms is None:
        ewma = obs.rtt_ms
    elif r.samples < c.cfg.outlier.min_rtt_samples:
        ewma = min(r.ewma_ms, obs.rtt_ms)
    else:
        sample = min(obs.rtt_ms, rc.spike_factor * max(r.ewma_ms, rc.baseline_slack.ms))
        ewma = rc.ewma_alpha * sample + (1 - rc.ewma_alpha) * r.ewma_ms
    return replace(nh, rtt=replace(r, ewma_ms=ewma, last_ms=obs.rtt_ms, samples=r.samples + 1))


def _r_ping(nh: NodeHealth, obs: PingObserved, c: _StepCtx) -> Sequence[Fired]:
    return _PING


def _record_probe(nh: NodeHealth, obs: ProbeObserved, c: _StepCtx) -> NodeHealth:
    c.outcome, c.what = classify_probe(nh, obs, c.cfg, c.now_s)
    p = nh.probe
    last, ewma = p.last_ttft_ms, p.ewma_ttft_ms
    if obs.kind is ProbeResultKind.OK:
        a = c.cfg.probes.ttft_ewma_alpha
        last, ewma = obs.ttft_ms, obs.ttft_ms if ewma is None else a * obs.ttft_ms + (1 - a) * ewma
    answered = obs.kind is ProbeResultKind.OK and obs.ttft_ms < c.cfg.probes.ttft_timeout.ms
    if c.outcome in (ProbeOutcome.GOOD, ProbeOutcome.SLOW) or (c.outcome is ProbeOutcome.BUSY and answered):
        # a successful probe (a slow answer from a busy engine too) extends the clean run
        failures = 0
        clean_since = p.clean_since_s if p.clean_since_s is not None else c.now_s
        clean_probes = p.clean_probes + 1
    else:
        failures, clean_since, clean_probes = p.consecutive_failures, None, 0
    if is_refusal(obs, c.cfg):  # the run of only refusals goes on (or starts)
        since = p.refused_since_s if p.refused_since_s is not None else c.now_s
        refused: tuple[float | None, float | None, int, int] = (since, c.now_s, p.refused_probes + 1, obs.http_status)
    else:
        refused = (None, None, 0, 0)
    # a timeout read as busy is judged at the next heartbeats (did progress move after it?)
    judge_at = c.now_s if c.outcome is ProbeOutcome.BUSY and obs.kind is ProbeResultKind.TIMEOUT else None
    return replace(nh, probe=replace(p, consecutive_failures=failures, last_ttft_ms=last, ewma_ttft_ms=ewma,
                                     last_kind=obs.kind, seen=p.seen + 1, clean_since_s=clean_since,
                                     clean_probes=clean_probes, refused_since_s=refused[0],
                                     refused_last_s=refused[1], refused_probes=refused[2],
                                     refused_status=refused[3], busy_timeout_s=judge_at))


_PROBE_SIGNAL = {ProbeOutcome.SLOW: Signal.PROBE_SLOW, ProbeOutcome.BUSY: Signal.PROBE_BUSY,
                 ProbeOutcome.FATAL: Signal.PROBE_FATAL}


def _r_probe(nh: NodeHealth, obs: ProbeObserved, c: _StepCtx) -> Sequence[Fired]:
    """A probe's signal. A success while the last heartbeat reports a fatal GPU event is that
    event instead (a node whose GPU is lost is never promoted by a probe). A node that was only
    busy since it was last HEALTHY recovers after ``busy_good_probes_to_recover`` good probes,
    one with a counted failure after ``good_probes_to_recover``. A refusal (429) is
    PROBE_REFUSED, or REFUSED_TOO_LONG once every probe for ``busy.refusal_block`` was one.
    A good or slow probe while the node's heartbeats are missed (its stream closed, or
    ``consecutive_misses`` counted) is PROBE_UNHEARD: the engine answers, but its agent is not
    heard, and the table promotes nothing on it (a result read before a reconnected agent's
    first heartbeat would route a WARMING node the count rule ejects at its next Tick, for a
    clean period); its next heartbeat clears the misses."""
    o = c.outcome
    if o is ProbeOutcome.FAIL:
        return (failure(nh, c.what, c.cfg, answered_failure(obs)),)
    if nh.probe.busy_timeout_s is not None:
        return _NONE  # busy or a hang: the heartbeats after it tell (_r_busy_judged)
    if nh.engine.gpu_fatal and o in (ProbeOutcome.GOOD, ProbeOutcome.SLOW, ProbeOutcome.BUSY):
        return (Fired(Signal.GPU_FATAL, f"GPU fatal event: {nh.engine.gpu_fatal} (probe {c.what} ignored)"),)
    hb = nh.heartbeat
    if o in (ProbeOutcome.GOOD, ProbeOutcome.SLOW) and (
            hb.stream_closed or hb.consecutive_misses >= c.cfg.heartbeat.consecutive_misses):
        return (Fired(Signal.PROBE_UNHEARD, c.what),)
    if o is ProbeOutcome.GOOD:
        need = (c.cfg.probes.good_to_recover if nh.probe.degraded_not_busy
                else c.cfg.busy.good_probes_to_recover)
        recover = nh.probe.consecutive_good + 1 >= need
        return (Fired(Signal.GOOD_PROBES_RECOVER if recover else Signal.PROBE_GOOD, c.what),)
    if o is ProbeOutcome.BUSY and is_refusal(obs, c.cfg):
        p = nh.probe
        run_s = c.now_s - (p.refused_since_s if p.refused_since_s is not None else c.now_s)
        if run_s >= c.cfg.busy.refusal_block.s - EPS_S:
            return (Fired(Signal.REFUSED_TOO_LONG, refusal_evidence(nh)),)
        return (Fired(Signal.PROBE_REFUSED, c.what),)
    return (Fired(_PROBE_SIGNAL[o], c.what, 1.0 if o is ProbeOutcome.FATAL else 0.0),)


# ---- operator and fleet -------------------------------------------------------------------


def _keep(nh: NodeHealth, obs: Observation, c: _StepCtx) -> NodeHealth:
    return nh


def _r_drain(nh: NodeHealth, obs: DrainRequested, c: _StepCtx) -> Sequence[Fired]:
    if obs.drain == nh.drain.active:
        return _NONE
    return (Fired(Signal.DRAIN if obs.drain else Signal.UNDRAIN, obs.reason),)


def _flowing(nh: NodeHealth) -> bool:
    return nh.heartbeat.consecutive_misses == 0 and not nh.heartbeat.stream_closed


def _record_fail_static_end(nh: NodeHealth, obs: FailStaticEnded, c: _StepCtx) -> NodeHealth:
    ej = nh.ejection
    if _flowing(nh) and ej.cause is not None and ej.forgive_since_s is not None:
        return replace(nh, ejection=replace(ej, forgive_since_s=None, forgive_until_s=0.0))
    return nh


def _r_fail_static_end(nh: NodeHealth, obs: FailStaticEnded, c: _StepCtx) -> Sequence[Fired]:
    if not _flowing(nh):  # still silent: forgive it too if its heartbeats resume soon
        return (Fired(Signal.FORGIVENESS_PENDING, arg=obs.burst_start_s),)
    if _forgivable(nh, obs.burst_start_s):
        return (Fired(Signal.FAIL_STATIC_FORGIVES),)
    return _NONE


def _r_traffic(nh: NodeHealth, obs: TrafficFailing, c: _StepCtx) -> Sequence[Fired]:
    return (Fired(Signal.TRAFFIC_FAILING, obs.detail),)


_Observer = tuple[Record, tuple[Rule, ...]]


def _observer(kind: type[_O], record: Callable[[NodeHealth, _O, _StepCtx], NodeHealth],
              rules: tuple[Callable[[NodeHealth, _O, _StepCtx], Sequence[Fired]], ...]) -> _Observer:
    """``(record, rules)`` for observations of type ``kind``, checked against it here. Widened to
    take any Observation: :func:`_step_full` only calls them with an observation of ``kind``."""
    return cast(_Observer, (record, rules))


_TIME: tuple[Rule, ...] = TIME_RULES
_OBSERVERS: dict[type[Observation], _Observer] = {
    HeartbeatObserved: _observer(HeartbeatObserved, _record_heartbeat, (
        _r_disproved, _r_forgive_pending, _r_heartbeat, _r_gpu_fatal, _r_engine_failed, _r_engine_restarting,
        _r_busy_judged, _r_stall, *_TIME)),
    Tick: _observer(Tick, _record_silence, (_r_silence, *_TIME)),
    StreamClosed: _observer(StreamClosed, _record_silence, (_r_silence, *_TIME)),
    PingObserved: _observer(PingObserved, _record_ping, (_r_ping, *_TIME)),
    ProbeObserved: _observer(ProbeObserved, _record_probe, (_r_probe, *_TIME)),
    DrainRequested: _observer(DrainRequested, _keep, (_r_drain,)),
    FailStaticEnded: _observer(FailStaticEnded, _record_fail_static_end, (_r_fail_static_end,)),
    TrafficFailing: _observer(TrafficFailing, _keep, (_r_traffic,)),
    ValidationObserved: _observer(ValidationObserved, _keep, (lambda nh, obs, c: verdict_signals(nh, obs), *_TIME)),
}
"""Observation type -> (recording, rules in order)."""
