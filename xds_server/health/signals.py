"""The vocabulary of the health transition table: signals, their occurrences, transitions, errors.

See :mod:`xds_server.health.transitions` for the table itself.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from xds_server.config import HealthConfig
from xds_server.health.records import Event, NodeHealth, NodeState

__all__ = ["PREVIOUS", "Ctx", "Effect", "Fired", "InvalidTransition", "Previous", "Signal", "Transition"]


class Signal(enum.Enum):
    """What observations and time produce. Values are the labels of the state diagram.

    MISS_THRESHOLD: ``consecutive_misses`` reached; GOOD_PROBES_RECOVER: this good probe makes
    ``good_probes_to_recover``; FAILURES_REACH_EJECT: this failure makes
    ``probe_failures_to_eject``; PROBE_REFUSED: the engine answered a status in
    ``busy_http_statuses`` (429); REFUSED_TOO_LONG: this refusal makes a run of only refusals
    ``busy.refusal_block`` long; PROBE_UNHEARD: a good or slow probe while the node's heartbeats
    are missed (its stream closed, or ``consecutive_misses`` counted): the engine answers, its
    agent is not heard; HEALTHY_RUN_MET: HEALTHY for ``probation.clean_max`` (the
    doubled clean period is forgotten); FORGIVENESS_PENDING: fail-static ended while the node
    was still silent; TRANSPORT_SUSPICION: the stream's transport failed its liveness check (an
    unanswered HTTP/2 PING) while the count rule has not counted the node out (a suspicion, as
    phi's: disproved by a heartbeat before ``consecutive_misses`` prove it).
    """

    HEARTBEAT = "heartbeat"
    MISS_THRESHOLD = "miss threshold"
    PHI_SUSPICION = "phi suspicion"
    TRANSPORT_SUSPICION = "transport suspicion"
    SUSPICION_DISPROVED = "suspicion disproved"
    PING = "ping"
    PROBE_GOOD = "probe good"
    GOOD_PROBES_RECOVER = "good probes to recover"
    PROBE_SLOW = "probe slow"
    PROBE_BUSY = "probe busy"
    PROBE_REFUSED = "probe refused"
    REFUSED_TOO_LONG = "refused too long"
    PROBE_FAIL = "probe fail"
    FAILURES_REACH_EJECT = "failures to eject"
    PROBE_FATAL = "probe fatal"
    PROBE_UNHEARD = "probe answered, agent unheard"
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
    TRAFFIC_FAILING = "real traffic failing"
    VALIDATION_PENDING = "validation pending"
    VALIDATION_PASSED = "validation passed"
    VALIDATION_FAILED = "validation failed"
    DRAIN = "drain"
    UNDRAIN = "undrain"


class Previous:
    """Next-state marker: back to the state the node had before its ejection."""

    def __repr__(self) -> str:
        return "PREVIOUS"


PREVIOUS = Previous()


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
    next: NodeState | Previous
