"""The health model's time rules: what a step fires because time passed (stall confirmation,
clean period, ramp, a long HEALTHY run), and :func:`failure`, one more probe failure. Pure: a
node's records, the config and the step's time (:mod:`xds_server.health.rules` runs them after
every observation's own rules)."""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from xds_server.config import HealthConfig
from xds_server.health.clocks import (
    EPS_S,
    required_clean_s,
    rtt_holds_until_s,
    stall_confirm_at_s,
)
from xds_server.health.records import SUSPICIONS, EngineState, NodeHealth, Observation, ProbeResultKind
from xds_server.health.signals import Ctx, Fired, Signal
from xds_server.health.switchback_rules import ramp_gate

__all__ = ["TIME_RULES", "clean_period_met", "clean_period_unmet", "failure"]

_NONE: tuple[Fired, ...] = ()
_CLEAN_PERIOD_MET = (Fired(Signal.CLEAN_PERIOD_MET),)
_RAMP_HELD = (Fired(Signal.RAMP_HELD),)
_HEALTHY_RUN_MET = (Fired(Signal.HEALTHY_RUN_MET),)


def failure(nh: NodeHealth, what: str, cfg: HealthConfig, answered: bool = False) -> Fired:
    """One more probe failure: does it reach ``probe_failures_to_eject``? ``answered``: the engine
    answered it (:func:`~xds_server.health.outcome.answered_failure`; carried as ``Fired.arg``
    for COLD/WARMING's "cannot warm")."""
    reach = nh.probe.consecutive_failures + 1 >= cfg.probes.failures_to_eject
    return Fired(Signal.FAILURES_REACH_EJECT if reach else Signal.PROBE_FAIL, what, 1.0 if answered else 0.0)




def r_stall_confirmed(nh: NodeHealth, obs: Observation, c: Ctx) -> Sequence[Fired]:
    """A reported stall still reported at :func:`~xds_server.health.clocks.stall_confirm_at_s`
    counts as a second probe timeout; the reason gives the evidence that confirmed it."""
    e, cfg = nh.engine, c.cfg
    at = stall_confirm_at_s(nh, cfg)
    if e.stall_counted != 1 or at is None or c.now_s < at - EPS_S:
        return _NONE
    assert e.stalled_since_s is not None  # stall_confirm_at_s is None without it
    if c.now_s - e.stalled_since_s >= cfg.probes.stall_confirm.s - EPS_S:
        what = f"engine still STALLED {cfg.probes.stall_confirm.ms:.0f} ms later"
    else:
        assert e.progress_at_s is not None
        what = (f"engine still STALLED: no progress for {c.now_s - e.progress_at_s:.2f} s (stall window "
                f"{cfg.busy.progress_window.ms:.0f} ms + {cfg.probes.stall_confirm.ms:.0f} ms)")
    return (Fired(Signal.STALL_CONFIRMED), failure(nh, what, cfg))


def r_clean_period(nh: NodeHealth, obs: Observation, c: Ctx) -> Sequence[Fired]:
    """Half-open entry (seed 000): :func:`clean_period_met`."""
    return _CLEAN_PERIOD_MET if clean_period_met(nh, c.cfg, c.now_s) else _NONE


def clean_period_met(nh: NodeHealth, cfg: HealthConfig, now_s: float) -> bool:
    """Seed 000's half-open entry at ``now_s`` (s): a clean run of probes for the (doubled) clean
    period with at least ``probation.min_probes``, heartbeats flowing, EWMA RTT back at its
    baseline (<= baseline x ``rtt.baseline_tolerance`` + ``rtt.baseline_slack``; for at most
    ``rtt.baseline_wait_periods`` clean periods more: :func:`rtt_holds_until_s`), engine READY,
    not a suspicion (back as it was at its next heartbeat, or proven). This rule runs after every
    observation of every node, so it returns at the first unmet check and formats nothing;
    :func:`clean_period_unmet` says the same checks in words (a test keeps the two equal)."""
    p, h = nh.probe, nh.heartbeat
    if p.clean_since_s is None or nh.ejection.cause in SUSPICIONS:
        return False
    if now_s - p.clean_since_s < required_clean_s(nh, cfg) - EPS_S or p.clean_probes < cfg.probation.min_probes:
        return False
    if h.last_s is None or h.consecutive_misses >= cfg.heartbeat.consecutive_misses:
        return False
    if rtt_holds_until_s(nh, cfg, now_s) is not None:
        return False
    return nh.engine.state is EngineState.READY and not nh.engine.gpu_fatal


def clean_period_unmet(nh: NodeHealth, cfg: HealthConfig, now_s: float) -> Iterator[str]:
    """What keeps an UNHEALTHY node out of PROBATION at ``now_s`` (s): each check of
    :func:`clean_period_met` that fails, as a sentence with its numbers, in the order checked;
    nothing: it enters. ``/nodes`` shows the list."""
    p, h, r = nh.probe, nh.heartbeat, nh.rtt
    if nh.ejection.cause in SUSPICIONS:
        yield (f"a {nh.ejection.cause} suspicion: back as it was at its next heartbeat, or proven by "
               f"{cfg.heartbeat.consecutive_misses} consecutive misses")
    need = required_clean_s(nh, cfg)
    if p.clean_since_s is None:
        yield f"no good probe since the last failure ({need:g} s of them needed)"
    elif now_s - p.clean_since_s < need - EPS_S:
        yield f"probes clean for {now_s - p.clean_since_s:.1f} of {need:g} s"
    if p.clean_probes < cfg.probation.min_probes:
        yield f"{p.clean_probes} of {cfg.probation.min_probes} good probes"
    if h.last_s is None or h.consecutive_misses >= cfg.heartbeat.consecutive_misses:
        yield f"heartbeats not flowing ({h.consecutive_misses} consecutive misses)"
    until = rtt_holds_until_s(nh, cfg, now_s)
    if until is not None:
        assert r.ewma_ms is not None and r.baseline_ms is not None  # (both known to be above)
        yield (f"EWMA RTT {r.ewma_ms:.1f} ms above its baseline {r.baseline_ms:.1f} ms x "
               f"{cfg.rtt.baseline_tolerance:g} + {cfg.rtt.baseline_slack.ms:g} ms"
               + ("" if math.isinf(until) else f" (it holds the node {until - now_s:.1f} s more at most)"))
    if nh.engine.state is not EngineState.READY:
        yield f"engine {nh.engine.state.value}"
    if nh.engine.gpu_fatal:
        yield f"GPU fatal: {nh.engine.gpu_fatal}"


def r_ramp(nh: NodeHealth, obs: Observation, c: Ctx) -> Sequence[Fired]:
    cfg, r, p = c.cfg, nh.ramp, nh.probe
    if r.step_at_s is None or c.now_s - r.step_at_s < cfg.probation.ramp_step.s - EPS_S:
        return _NONE
    if p.last_kind is ProbeResultKind.OK and (p.last_ttft_ms or 0) >= cfg.probes.ttft_healthy.ms:
        return _RAMP_HELD
    steps = int((c.now_s - r.step_at_s + EPS_S) // cfg.probation.ramp_step.s)
    if r.percent + steps * cfg.probation.ramp_step_percent >= 100.0:
        return ramp_gate(nh, cfg)  # RAMP_COMPLETE, or VALIDATION_PENDING (switch-back validation)
    return (Fired(Signal.RAMP_STEP, arg=steps),)


def r_healthy_run(nh: NodeHealth, obs: Observation, c: Ctx) -> Sequence[Fired]:
    """A HEALTHY run of ``probation.clean_max`` forgets earlier failed probations."""
    ej = nh.ejection
    if (ej.clean_period_s and ej.healthy_since_s is not None
            and c.now_s - ej.healthy_since_s >= c.cfg.probation.clean_max.s):
        return _HEALTHY_RUN_MET
    return _NONE


TIME_RULES = (r_stall_confirmed, r_clean_period, r_ramp, r_healthy_run)
"""Run after every observation's own rules, in this order."""
