"""Effects of the health transition table: what a signal does to a node's records.

Each effect is ``effect(nh, fired, ctx) -> (nh, reason)``: it returns new records (the state is
unchanged; :func:`xds_server.health.transitions.apply` enters the next state) and the reason line, or
None to keep the current one when the state does not change.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from xds_server.health.clocks import required_clean_s, rtt_above_baseline
from xds_server.health.outcome import refusal_evidence
from xds_server.health.records import SUSPICIONS, EjectionCause, Event, NodeHealth, NodeState, Ramp
from xds_server.health.signals import Ctx, Effect, Fired, Signal

__all__ = [
    "baseline",
    "clean_period_met",
    "disproved",
    "drain",
    "eject",
    "eject_in_probation",
    "eject_on_count",
    "fail_to_degraded",
    "fatal_while_out",
    "first_good_probe",
    "first_heartbeat",
    "forget_backoff",
    "forgive_later",
    "forgiven",
    "good",
    "gpu_lost_while_warming",
    "heartbeats_resumed",
    "noop",
    "not_good",
    "proven_by_count",
    "ramp_complete",
    "ramp_held",
    "ramp_step",
    "recovered",
    "refusal_over",
    "refusing",
    "refusing_failure",
    "restarting",
    "slow_to_degraded",
    "stall_counted",
    "unheard",
    "warming_probe",
    "with_detail",
]


def noop(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return nh, None


def with_detail(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return nh, f.detail


def eject(cause: EjectionCause, reason: Callable[[NodeHealth, Fired], str] | None = None) -> Effect:
    """Move to UNHEALTHY for ``cause``. A failure in PROBATION doubles the next clean period (capped)."""

    def effect(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
        text = f.detail if reason is None else reason(nh, f)
        clean = required_clean_s(nh, c.cfg)
        if nh.state is NodeState.PROBATION:
            clean = min(clean * 2.0, c.cfg.probation.clean_max.s)
            text += f"; failed in PROBATION at {nh.ramp.percent:.0f} %, next clean period {clean:.0f} s"
        return replace(
            nh, ejection=replace(nh.ejection, cause=cause, from_state=nh.state, clean_period_s=clean),
            probe=replace(nh.probe, clean_since_s=None, clean_probes=0), ramp=replace(nh.ramp, percent=0.0),
        ), text

    return effect


def _counted(nh: NodeHealth) -> NodeHealth:
    """One more consecutive probe failure (a stall counts as a timeout); the clean run ends."""
    return replace(nh, probe=replace(nh.probe, consecutive_failures=nh.probe.consecutive_failures + 1,
                                     consecutive_good=0, clean_since_s=None, clean_probes=0,
                                     degraded_not_busy=True))


def _then(first: Callable[[NodeHealth], NodeHealth], effect: Effect) -> Effect:
    return lambda nh, f, c: effect(first(nh), f, c)


def _not_busy(nh: NodeHealth) -> NodeHealth:
    """Mark the node degraded for more than load (a slow probe without evidence of load)."""
    return nh if nh.probe.degraded_not_busy else replace(nh, probe=replace(nh.probe, degraded_not_busy=True))


slow_to_degraded: Effect = _then(_not_busy, with_detail)


def fail_to_degraded(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return _counted(nh), f"probe failure: {f.detail}"


eject_in_probation = _then(_counted, eject(EjectionCause.PROBE,
                                           lambda nh, f: f"probe failure in PROBATION: {f.detail}"))
eject_on_count = _then(_counted, eject(
    EjectionCause.PROBE, lambda nh, f: f"probe: {nh.probe.consecutive_failures} consecutive failures, last {f.detail}"))


def good(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    good = nh.probe.consecutive_good + 1
    return replace(nh, probe=replace(nh.probe, consecutive_good=good)), None


def recovered(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """DEGRADED -> HEALTHY: after a counted failure or an unexplained slow probe
    ``good_probes_to_recover`` good probes; when
    the node was only busy (slow, 429, busy timeouts) ``busy_good_probes_to_recover``."""
    good = nh.probe.consecutive_good + 1
    text = (f"{good} consecutive good probes (last {f.detail})" if nh.probe.degraded_not_busy
            else f"load eased: {good} good probe{'s' if good > 1 else ''} (last {f.detail}) after being only busy")
    return replace(nh, probe=replace(nh.probe, degraded_not_busy=False)), text


_NOT_ROUTED = "not routed until a probe is answered"


def refusing(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """Into (or still) REFUSING: every probe refused for ``busy.refusal_block``; the reason is
    the run (:func:`~xds_server.health.outcome.refusal_evidence`). From PROBATION the node has not
    proven itself since it failed: it returns DEGRADED and needs ``good_probes_to_recover``."""
    p = replace(nh.probe, consecutive_good=0,
                degraded_not_busy=nh.probe.degraded_not_busy or nh.state is NodeState.PROBATION)
    return replace(nh, probe=p), f"{refusal_evidence(nh)}; {_NOT_ROUTED}"


def refusing_failure(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """REFUSING and a probe failure: counted (the next one ejects); still not routed."""
    return _counted(nh), f"probe failure: {f.detail} (after refusing work); {_NOT_ROUTED}"


def refusal_over(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """REFUSING -> routed on the first probe the engine took: HEALTHY at full weight when it was
    only busy and the probe was good, else DEGRADED (busy share); never probation or ramp."""
    if f.signal is Signal.GOOD_PROBES_RECOVER:
        return replace(nh, probe=replace(nh.probe, degraded_not_busy=False)), (
            f"load eased: first good probe ({f.detail}) after refusing work; full weight, no probation")
    return nh, f"{f.detail}; took work again after refusing it: routed at the DEGRADED share"


def gpu_lost_while_warming(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """WARMING with a fatal GPU event: stays WARMING (never routed, not even at the ramp's 1 %)."""
    return nh, f"{f.detail}; not routed while warming"


def warming_probe(count: bool) -> Effect:
    """COLD or WARMING and a probe that does not promote the node (never routed either way, fc08).

    ``count``: a failure, counted in ``consecutive_failures`` (a failure arrives as PROBE_FAIL or
    FAILURES_REACH_EJECT; ``Fired.arg`` is 1 when the engine answered: an HTTP status other than
    503, bad output, a fatal error); else a busy answer (429, a busy timeout), not counted. The
    reason gives the last probe's result. It reads "cannot warm: ..." once ``probes.warm_limit`` has
    passed since the node entered its state without a good probe, or after
    ``probe_failures_to_eject`` failures in a row from an engine that answers (something that is
    not a loading engine is there: e.g. a wrong ``--engine-url``); the first such reason of
    the episode is also an event (``from_state`` = ``to_state``)."""

    def effect(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
        cfg, p = c.cfg, nh.probe
        n = p.consecutive_failures + 1 if count else p.consecutive_failures
        age_s = c.now_s - nh.since_s
        plural = "s" if n != 1 else ""
        if count and f.arg and n >= cfg.probes.failures_to_eject:
            why = f"{n} consecutive probe failure{plural} from an engine that answers"
        elif age_s >= cfg.probes.warm_limit.s or p.warm_reported:  # once reported, it reads so until a good probe
            limit = f" (probes.warm_limit {cfg.probes.warm_limit})" if age_s >= cfg.probes.warm_limit.s else ""
            why = f"no good probe {age_s:.0f} s after {nh.state.value} began{limit}"
            if n:
                why += f", {n} consecutive probe failure{plural}"
        else:
            why = ""
        if not why:
            tail = f" ({n} consecutive probe failure{plural})" if n else ""
            reason = f"{nh.state.value.lower()}, no good probe yet{tail}: {f.detail}"
        else:
            reason = f"cannot warm: {why}; last probe: {f.detail}"
        report = bool(why) and not p.warm_reported
        if report:
            c.events.append(Event(c.now_s, nh.node_id, nh.state, nh.state, reason))
        if n != p.consecutive_failures or report:
            nh = replace(nh, probe=replace(p, consecutive_failures=n, consecutive_good=0,
                                           warm_reported=p.warm_reported or report))
        return nh, reason

    return effect


def unheard(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """WARMING, a good probe while its heartbeats are missed: stays WARMING until its agent is heard."""
    h = nh.heartbeat
    why = "its stream closed" if h.stream_closed else f"{h.consecutive_misses} heartbeats missed"
    return nh, (f"warming: the engine answers ({f.detail}) but its agent is not heard ({why}); "
                "promoted after a heartbeat")


def not_good(reason: bool) -> Effect:
    def effect(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
        return replace(nh, probe=replace(nh.probe, consecutive_good=0)), (f.detail if reason else None)

    return effect


def first_good_probe(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return nh, f"first good probe ({f.detail}); ramping from {c.cfg.probation.ramp_start_percent:g} %"


def fatal_while_out(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return replace(nh, ejection=replace(nh.ejection, cause=EjectionCause.ENGINE)), f.detail


def first_heartbeat(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return nh, f"first heartbeat (engine {nh.engine.state})"


def heartbeats_resumed(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    if nh.ejection.cause is not EjectionCause.HEARTBEAT and nh.ejection.cause not in SUSPICIONS:
        return nh, None
    return nh, (f"heartbeats resumed; clean period {required_clean_s(nh, c.cfg):.0f} s "
                "of good probes before PROBATION")


def disproved(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    hb = nh.heartbeat
    return replace(nh, heartbeat=replace(hb, suspicion_clears=hb.suspicion_clears + (c.now_s,))), f.detail


def forgiven(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return replace(nh, ejection=replace(nh.ejection, forgive_since_s=None, forgive_until_s=0.0)), (
        "heartbeat loss forgiven: it was part of a fleet-wide loss (fail-static), heartbeats flow again")


def forgive_later(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """Still silent when fail-static ended: forgive it too if heartbeats resume within the window."""
    until = c.now_s + c.cfg.fail_static.forgive_intervals * c.cfg.heartbeat.interval.s
    return replace(nh, ejection=replace(nh.ejection, forgive_since_s=f.arg, forgive_until_s=until)), None


def restarting(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return replace(nh, probe=replace(nh.probe, consecutive_failures=0, clean_since_s=None, clean_probes=0)), f.detail


def stall_counted(n: int) -> Effect:
    return lambda nh, f, c: (replace(nh, engine=replace(nh.engine, stall_counted=n)), None)


def proven_by_count(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """Already out (probe, engine or phi): now proven by the count rule."""
    if nh.ejection.cause is EjectionCause.HEARTBEAT:
        return nh, None
    return replace(nh, ejection=replace(nh.ejection, cause=EjectionCause.HEARTBEAT),
                   probe=replace(nh.probe, clean_since_s=None, clean_probes=0)), f.detail


def baseline(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """While HEALTHY, the slow RTT baseline follows the EWMA (``rtt_baseline_alpha``)."""
    r, b = nh.rtt, c.cfg.rtt.baseline_alpha
    if r.ewma_ms is None:
        return nh, None
    base = r.ewma_ms if r.baseline_ms is None else b * r.ewma_ms + (1 - b) * r.baseline_ms
    return replace(nh, rtt=replace(r, baseline_ms=base)), None


def ramp_step(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    steps = int(f.arg)
    pct = min(100.0, nh.ramp.percent + steps * c.cfg.probation.ramp_step_percent)
    at = (nh.ramp.step_at_s or 0.0) + steps * c.cfg.probation.ramp_step.s
    return replace(nh, ramp=Ramp(pct, at)), f"PROBATION ramp {pct:g} %"


def ramp_held(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return replace(nh, ramp=replace(nh.ramp, step_at_s=c.now_s)), f"ramp held at {nh.ramp.percent:g} %: last probe slow"


def ramp_complete(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return replace(nh, ramp=replace(nh.ramp, percent=100.0),
                   probe=replace(nh.probe, degraded_not_busy=False)), "ramp complete (100 %)"


def clean_period_met(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    p = nh.probe
    clean_for = c.now_s - (p.clean_since_s if p.clean_since_s is not None else c.now_s)
    r = nh.rtt
    rtt = "" if r.ewma_ms is None else f", EWMA RTT {r.ewma_ms:.1f} ms"
    if rtt_above_baseline(r, c.cfg):  # admitted past rtt.baseline_wait_periods: the time rule's waiver
        rtt += f", still above its baseline {r.baseline_ms:.1f} ms: admitted, the ramp judges it"
    return nh, (f"{clean_for:.0f} s of successful probes ({p.clean_probes} probes{rtt}); "
                f"ramping from {c.cfg.probation.ramp_start_percent:g} %")


def forget_backoff(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    return replace(nh, ejection=replace(nh.ejection, clean_period_s=0.0)), None


def drain(active: bool) -> Effect:
    def effect(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
        if active:
            c.events.append(Event(c.now_s, nh.node_id, nh.state, NodeState.DRAINING, f"drain requested: {f.detail}"))
            return replace(nh, drain=replace(nh.drain, active=True, since_s=c.now_s)), None
        c.events.append(Event(c.now_s, nh.node_id, NodeState.DRAINING, nh.state, f"undrained: {f.detail}"))
        return replace(nh, drain=replace(nh.drain, active=False, since_s=None)), None

    return effect
