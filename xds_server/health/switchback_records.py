"""The switch-back validation gate's records: what the health model knows of a node's replay
validation. Pure values; :mod:`xds_server.health.switchback_rules` has the gate's rules and
effects, :mod:`xds_server.policy.replay_judge` the verdict.

Shape: ``NodeHealth.validation`` is a :class:`Validation`; the control plane's replay
orchestration (``xds_server/probing/replay.py``) feeds a :class:`ValidationObserved` through
``step`` when it has judged the candidate.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from xds_server.process.frozen import fast_init

__all__ = ["Validation", "ValidationObserved", "ValidationVerdict"]


class ValidationVerdict(enum.StrEnum):
    """Where a node's switch-back validation stands in its current (or last) PROBATION."""

    NONE = "none"                # not asked in this PROBATION (or validation is off)
    PENDING = "pending"          # the ramp is done; PROBATION holds until a verdict
    PASSED = "passed"            # answers like its peers (within their noise + margin)
    PROBES_ONLY = "probes only"  # could not be replayed (old agent, < 2 peers): probes decide
    FAILED = "failed"            # diverges from its peers: back to UNHEALTHY


@fast_init
@dataclass(frozen=True, slots=True)
class Validation:
    """``verdict`` since ``at_s`` (monotonic s; None: never asked); ``detail``: the evidence."""

    verdict: ValidationVerdict = ValidationVerdict.NONE
    detail: str = ""
    at_s: float | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class ValidationObserved:
    """A verdict for the PROBATION that began at ``probation_since_s`` (``NodeHealth.since_s`` when
    the validation was asked). ``verdict``: PASSED, PROBES_ONLY or FAILED. A verdict for another
    PROBATION (the node left it meanwhile) or for a node not waiting for one changes nothing."""

    verdict: ValidationVerdict
    detail: str
    probation_since_s: float
