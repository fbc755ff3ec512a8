"""The switch-back validation gate as rules and effects of the transition table.

While ``health.validation.enabled``, a node entering PROBATION (from UNHEALTHY after its clean
period, or a new node's first good probe) waits for a verdict *before its first request*: it
enters with no ramp running and ``validation`` PENDING, and is not routed
(:func:`~xds_server.health.routing.node_routing`). A :class:`~xds_server.health.switchback_records.ValidationObserved`
for this PROBATION then fires VALIDATION_PASSED (PASSED or PROBES_ONLY: the ramp starts at
``ramp_start_percent``, the reason naming the verdict; the ramp stays, for warming caches and
catching load-dependent faults) or VALIDATION_FAILED (UNHEALTHY, cause ``validation``, the
evidence in the reason, the next clean period doubled as for any failure in PROBATION; the next
episode waits unrouted again, so a failing node never gets a request).

A ramp that reaches 100 % without a passing verdict (validation turned on by a reload during a
ramp) still waits at its end: the ramp rule fires VALIDATION_PENDING instead of RAMP_COMPLETE
(:func:`ramp_gate`), keeping the node at its last ramp percent until the verdict. Pure: records,
config and the step's time.

Table rows (``xds_server.health.transitions``)::

    PROBATION  VALIDATION_PENDING  pending   PROBATION
    PROBATION  VALIDATION_PASSED   passed    PROBATION   (then RAMP_COMPLETE -> HEALTHY)
    PROBATION  VALIDATION_FAILED   failed    UNHEALTHY
    others     VALIDATION_PASSED / VALIDATION_FAILED   no-op (a late verdict)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from xds_server.config import HealthConfig
from xds_server.health import effects as fx
from xds_server.health.records import EjectionCause, NodeHealth, NodeState, Ramp
from xds_server.health.signals import Ctx, Fired, Signal
from xds_server.health.switchback_records import Validation, ValidationObserved, ValidationVerdict

__all__ = ["failed", "passed", "pending", "ramp_complete", "ramp_gate", "verdict_signals"]

V = ValidationVerdict
_RAMP_COMPLETE = (Fired(Signal.RAMP_COMPLETE),)
_PENDING = (Fired(Signal.VALIDATION_PENDING),)
_NONE: tuple[Fired, ...] = ()
_OK = (V.PASSED, V.PROBES_ONLY)


def ramp_gate(nh: NodeHealth, cfg: HealthConfig) -> Sequence[Fired]:
    """What a ramp that reached 100 % fires: RAMP_COMPLETE, or VALIDATION_PENDING while a
    validation is required (``cfg.validation.enabled``) and no passing verdict is recorded."""
    if not cfg.validation.enabled or nh.validation.verdict in _OK:
        return _RAMP_COMPLETE
    return _PENDING


def verdict_signals(nh: NodeHealth, obs: ValidationObserved) -> Sequence[Fired]:
    """A verdict's signal: only for the PROBATION it was asked for (``probation_since_s`` equal
    to ``nh.since_s``) while that node waits (PENDING); anything else fires nothing."""
    if (nh.state is not NodeState.PROBATION or obs.probation_since_s != nh.since_s
            or nh.validation.verdict is not V.PENDING):
        return _NONE
    if obs.verdict is V.FAILED:
        return (Fired(Signal.VALIDATION_FAILED, obs.detail),)
    if obs.verdict in _OK:
        return (Fired(Signal.VALIDATION_PASSED, obs.detail, 1.0 if obs.verdict is V.PROBES_ONLY else 0.0),)
    return _NONE


def pending(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """Hold the ramp one more step; the first time, record PENDING and say why."""
    held = replace(nh, ramp=replace(nh.ramp, step_at_s=c.now_s))
    if nh.validation.verdict is V.PENDING:
        return held, None
    return (replace(held, validation=Validation(V.PENDING, "", c.now_s)),
            f"ramp at {nh.ramp.percent:g} %: switch-back validation pending (replay against two healthy peers)")


def passed(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """Record the verdict. Before the first request (no ramp running yet): start the ramp at
    ``ramp_start_percent``, the reason naming the verdict. At the ramp's end (validation turned
    on during a ramp): make the ramp due now (it completes in this step)."""
    verdict = V.PROBES_ONLY if f.arg else V.PASSED
    done = Validation(verdict, f.detail, c.now_s)
    if nh.ramp.step_at_s is None:
        word = "validated" if verdict is V.PASSED else "validated by probes alone"
        why = f"switch-back {word}: {f.detail}" if f.detail else f"switch-back {word}"
        return (replace(nh, validation=done, ramp=Ramp(c.cfg.probation.ramp_start_percent, c.now_s)),
                f"{why}; ramping from {c.cfg.probation.ramp_start_percent:g} %")
    due = c.now_s - c.cfg.probation.ramp_step.s
    return replace(nh, validation=done, ramp=replace(nh.ramp, step_at_s=due)), None


_eject = fx.eject(EjectionCause.VALIDATION)


def failed(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """Record FAILED and eject (cause ``validation``; the evidence is the reason)."""
    return _eject(replace(nh, validation=Validation(V.FAILED, f.detail, c.now_s)), f, c)


def ramp_complete(nh: NodeHealth, f: Fired, c: Ctx) -> tuple[NodeHealth, str | None]:
    """The ramp's end; with validation on, the reason names the verdict that let it end."""
    out, reason = fx.ramp_complete(nh, f, c)
    v = nh.validation
    if c.cfg.validation.enabled and v.verdict in _OK:
        word = "validated" if v.verdict is V.PASSED else "validated by probes alone"
        reason = f"{reason}; switch-back {word}: {v.detail}" if v.detail else f"{reason}; switch-back {word}"
    return out, reason
