"""What the health model knows about a node: enums, observations and the per-node records.

Everything here is a frozen value; :mod:`xds_server.health.rules` derives new values from old ones.
Times are seconds on the caller's monotonic clock; durations carry their unit in the name.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from xds_server.health import phi as phimod
from xds_server.health.switchback_records import Validation, ValidationObserved, ValidationVerdict
from xds_server.process.frozen import fast_init

__all__ = [
    "MACHINE_STATES",
    "ROUTED_STATES",
    "SUSPICIONS",
    "Drain",
    "DrainRequested",
    "Ejection",
    "EjectionCause",
    "Engine",
    "EngineState",
    "Event",
    "FailStaticEnded",
    "HeartbeatObserved",
    "Heartbeats",
    "NodeHealth",
    "NodeState",
    "Observation",
    "PingObserved",
    "ProbeObserved",
    "ProbeOutcome",
    "ProbeResultKind",
    "Probes",
    "Ramp",
    "Rtt",
    "StreamClosed",
    "Tick",
    "awaits_verdict",
    "initial",
]


class NodeState(str, enum.Enum):  # noqa: UP042  StrEnum would change str()/format() from "NodeState.X" to "X"
    """Per-node health state (docs/DESIGN.md section 4). DRAINING is the operator overlay only."""

    COLD = "COLD"
    WARMING = "WARMING"
    HEALTHY = "HEALTHY"
    DEGRADED = "DEGRADED"
    UNHEALTHY = "UNHEALTHY"
    PROBATION = "PROBATION"
    REFUSING = "REFUSING"
    DRAINING = "DRAINING"


MACHINE_STATES: tuple[NodeState, ...] = (
    NodeState.COLD, NodeState.WARMING, NodeState.PROBATION, NodeState.HEALTHY, NodeState.DEGRADED,
    NodeState.REFUSING, NodeState.UNHEALTHY,
)
"""The states of the transition table (``NodeHealth.state`` is always one of these)."""

ROUTED_STATES: frozenset[NodeState] = frozenset({NodeState.PROBATION, NodeState.HEALTHY, NodeState.DEGRADED,
                                                 NodeState.REFUSING})
"""States in which a node gets traffic before cluster policy. REFUSING is a soft block (busy: every
probe refused for ``busy.refusal_block``): routed, at the DEGRADED share, only while the
``max_ejection_percent`` cap holds the block back."""


class ProbeResultKind(enum.StrEnum):
    """What a micro-inference probe returned, as the agent reports it (``InferenceResult``)."""

    OK = "OK"
    TIMEOUT = "TIMEOUT"
    CONNECT = "CONNECT"
    HTTP_STATUS = "HTTP_STATUS"
    ENGINE_FATAL = "ENGINE_FATAL"
    BAD_OUTPUT = "BAD_OUTPUT"


class ProbeOutcome(enum.StrEnum):
    """How the model classes a probe result (thresholds in HealthConfig)."""

    GOOD = "good"      # OK and TTFT < ttft_healthy_ms
    SLOW = "slow"      # OK and TTFT < ttft_timeout_ms
    FAIL = "fail"      # a timeout, connect error, bad HTTP status or bad output
    FATAL = "fatal"    # the engine reported a fatal error
    BUSY = "busy"      # a failure while the engine is busy and its tokens advance: saturation (fc07)


class EjectionCause(enum.StrEnum):
    """Why a node is UNHEALTHY."""

    HEARTBEAT = "heartbeat"  # consecutive_misses heartbeats missed (the count rule)
    PHI = "phi"              # phi-accrual suspicion, not yet proven by the count rule
    TRANSPORT = "transport"  # the stream's transport failed its liveness check (an unanswered HTTP/2 PING),
    #                          not yet proven by the count rule
    PROBE = "probe"          # probe failures (or a stall counted as timeouts)
    ENGINE = "engine"        # engine fatal error or the agent reports the engine FAILED
    GPU = "gpu"              # a fatal GPU event (Xid, GPU lost)
    TRAFFIC = "traffic"      # real traffic fails across Envoys (LRS) while probes may pass
    VALIDATION = "validation"  # switch-back replay: answers unlike its healthy peers


SUSPICIONS: frozenset[EjectionCause] = frozenset({EjectionCause.PHI, EjectionCause.TRANSPORT})
"""Causes that are a suspicion, not proof: out at once, back to the state before (no probation) when
a heartbeat arrives before the count rule proves them (``heartbeat.consecutive_misses``)."""


class EngineState(enum.StrEnum):
    """The engine's lifecycle as the agent reports it (``Telemetry.engine_state``)."""

    COLD = "COLD"
    WARMING = "WARMING"
    READY = "READY"
    FAILED = "FAILED"


def _coerce(obj: object, name: str, enum_cls: type[enum.Enum]) -> None:
    """Turn a string field of a frozen dataclass into ``enum_cls``; ValueError names the field."""
    v = getattr(obj, name)
    if isinstance(v, enum_cls):
        return
    try:
        object.__setattr__(obj, name, enum_cls(v))
    except ValueError:
        allowed = ", ".join(m.value for m in enum_cls)
        raise ValueError(f"{type(obj).__name__}.{name}: {v!r} is not one of {allowed}") from None


# ---- observations -------------------------------------------------------------------------


@fast_init
@dataclass(frozen=True, slots=True)
class HeartbeatObserved:
    """A heartbeat arrived, with the agent's telemetry summary.

    Load fields are None when unknown (never read as 0). ``gpu_free_ratio`` is 0..1 (the least
    free GPU of the node). ``gpu_fatal`` names a fatal GPU event (e.g. "Xid 79"), empty when
    none. ``engine_state`` accepts the enum or its name; another value raises ValueError.
    ``progress_age_ms``: ms since a progress signal of a busy engine instance last moved (the
    agent's evidence of progress, ``Telemetry.progress_age_ms``), None when there is none;
    ``progress_detail`` says what moved. ``vouched``: it came on a stream whose transport carries
    the node's liveness (HTTP/2 PINGs: ``probe.liveness`` transport, an agent that dials in): until
    the stream ends (:class:`StreamClosed`) no miss is counted and phi does not judge, since the
    heartbeats are only the telemetry refresh.
    """

    engine_state: EngineState = EngineState.READY
    stalled: bool = False
    stall_detail: str = ""
    requests_running: float | None = None
    requests_waiting: float | None = None
    gpu_free_ratio: float | None = None
    gpu_fatal: str = ""
    progress_age_ms: float | None = None
    progress_detail: str = ""
    vouched: bool = False

    def __post_init__(self) -> None:
        _coerce(self, "engine_state", EngineState)


@fast_init
@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: count heartbeats that did not arrive, advance ramps and clean periods."""


@fast_init
@dataclass(frozen=True, slots=True)
class StreamClosed:
    """The probe stream to the agent ended or could not be opened (counts as one miss at once).
    ``liveness_lost``: it failed because the transport's liveness check did (an HTTP/2 PING of
    ``probe.liveness`` transport unanswered in time): the whole miss threshold at once."""

    detail: str = ""
    liveness_lost: bool = False


@fast_init
@dataclass(frozen=True, slots=True)
class PingObserved:
    """A Pong came back; ``rtt_ms`` measured on the control plane's monotonic clock."""

    rtt_ms: float


@fast_init
@dataclass(frozen=True, slots=True)
class ProbeObserved:
    """A micro-inference result. ``ttft_ms`` is meaningful when ``kind`` is OK."""

    kind: ProbeResultKind
    ttft_ms: float = 0.0
    http_status: int = 0
    detail: str = ""

    def __post_init__(self) -> None:
        _coerce(self, "kind", ProbeResultKind)


@fast_init
@dataclass(frozen=True, slots=True)
class FailStaticEnded:
    """Fleet-wide fail-static ended: heartbeat losses since ``burst_start_s`` were our own fault.

    A node ejected only for lost heartbeats during the episode, whose heartbeats flow again,
    returns to the state it had (no probation): the evidence against it was our network's.
    """

    burst_start_s: float


@fast_init
@dataclass(frozen=True, slots=True)
class DrainRequested:
    """Operator drain (``drain=True``) or undrain."""

    drain: bool
    reason: str = "operator"


@fast_init
@dataclass(frozen=True, slots=True)
class TrafficFailing:
    """Real traffic summed over every Envoy fails far more than it should (LRS,
    :mod:`xds_server.policy.traffic_ejection`); ``detail`` names the evidence."""

    detail: str


Observation = (HeartbeatObserved | Tick | StreamClosed | PingObserved | ProbeObserved | DrainRequested
               | FailStaticEnded | TrafficFailing | ValidationObserved)


# ---- per-node records ---------------------------------------------------------------------


@fast_init
@dataclass(frozen=True, slots=True)
class Heartbeats:
    """Liveness: heartbeat arrivals, misses and the phi-accrual estimate."""

    last_s: float | None = None             # arrival of the last heartbeat
    consecutive_misses: int = 0
    stream_closed: bool = False
    arrivals: phimod.ArrivalStats | None = None
    suspicion_clears: tuple[float, ...] = ()  # times of disproved suspicions, phi or transport (last window)
    vouched: bool = False                   # the last heartbeat's stream's transport carries liveness


@fast_init
@dataclass(frozen=True, slots=True)
class Rtt:
    """Ping round trips (ms): EWMA, last sample, the slow baseline learned while HEALTHY, and the
    samples folded into the EWMA since this control plane started (not persisted)."""

    ewma_ms: float | None = None
    last_ms: float | None = None
    baseline_ms: float | None = None
    samples: int = 0


@fast_init
@dataclass(frozen=True, slots=True)
class Probes:
    """Micro-inference probes: counters, TTFT (ms) and the current clean run."""

    consecutive_failures: int = 0
    consecutive_good: int = 0
    last_ttft_ms: float | None = None
    ewma_ttft_ms: float | None = None
    last_kind: ProbeResultKind | None = None
    seen: int = 0
    clean_since_s: float | None = None      # start of the current run of successful probes
    clean_probes: int = 0
    degraded_not_busy: bool = False         # since last HEALTHY: a counted failure or a slow probe
                                            # without evidence of load (recovery needs more probes)
    refused_since_s: float | None = None    # first probe of the current run of refusals (every
    refused_last_s: float | None = None     # probe answered a busy_http_statuses status) and the
    refused_probes: int = 0                 # last one; probes in the run; the status last seen
    refused_status: int = 0
    warm_reported: bool = False             # COLD/WARMING: "cannot warm" was reported (one event)
    busy_timeout_s: float | None = None     # a timeout with evidence of progress, not judged yet: busy
                                            # once progress moves after it, else a failure (clocks.busy_confirm_s)


@fast_init
@dataclass(frozen=True, slots=True)
class Engine:
    """The engine and GPUs as the agent's telemetry reports them (last heartbeat)."""

    state: EngineState = EngineState.COLD
    stalled: bool = False
    stalled_since_s: float | None = None
    stall_counted: int = 0                  # probe timeouts already counted for this stall (0..2)
    requests_running: float | None = None
    requests_waiting: float | None = None
    gpu_free_ratio: float | None = None
    gpu_fatal: str = ""
    progress_at_s: float | None = None      # when a progress signal last moved (heartbeat arrival - age)
    progress_detail: str = ""               # what moved (agent's text)
    progress_gap_s: float | None = None     # the engine's own progress cadence: the largest recent gap (s)
                                            # between two moves (halved per move since), None: unknown


@fast_init
@dataclass(frozen=True, slots=True)
class Ejection:
    """The current (or last) ejection, its backoff and a pending fail-static forgiveness."""

    cause: EjectionCause | None = None      # set while UNHEALTHY, None otherwise
    from_state: NodeState | None = None     # state before the last ejection
    clean_period_s: float = 0.0             # required clean period; 0 = cfg.probation.clean.s
    healthy_since_s: float | None = None    # start of the current HEALTHY run (forgets the backoff)
    forgive_since_s: float | None = None    # fail-static ended while this node was still silent:
    forgive_until_s: float = 0.0            # forgive its heartbeat ejection if heartbeats resume soon


@fast_init
@dataclass(frozen=True, slots=True)
class Ramp:
    """PROBATION's weight ramp: ``percent`` of full weight; ``step_at_s`` None when no ramp runs."""

    percent: float = 0.0
    step_at_s: float | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class Drain:
    """Operator drain: ``active`` since ``since_s``."""

    active: bool = False
    since_s: float | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class NodeHealth:
    """Everything the model knows about one node: its state and one record per concern."""

    node_id: str
    state: NodeState = NodeState.COLD
    reason: str = "no data yet"
    since_s: float = 0.0
    heartbeat: Heartbeats = field(default_factory=Heartbeats)
    rtt: Rtt = field(default_factory=Rtt)
    probe: Probes = field(default_factory=Probes)
    engine: Engine = field(default_factory=Engine)
    ejection: Ejection = field(default_factory=Ejection)
    ramp: Ramp = field(default_factory=Ramp)
    drain: Drain = field(default_factory=Drain)
    validation: Validation = field(default_factory=Validation)  # switch-back gate (health/switchback_records.py)

    @property
    def effective_state(self) -> NodeState:
        """The state Envoy's view follows: DRAINING overrides everything."""
        return NodeState.DRAINING if self.drain.active else self.state


@fast_init
@dataclass(frozen=True, slots=True)
class Event:
    """One state transition with the reason and the numbers that caused it."""

    at_s: float
    node_id: str
    from_state: NodeState
    to_state: NodeState
    reason: str


def initial(node_id: str, now_s: float) -> NodeHealth:
    """A node with no data yet (COLD)."""
    return NodeHealth(node_id=node_id, since_s=now_s)


def awaits_verdict(nh: NodeHealth) -> bool:
    """A PROBATION waiting unrouted for its switch-back verdict before its first request (no ramp
    running yet, the verdict PENDING: :mod:`xds_server.health.switchback_rules`)."""
    return (nh.state is NodeState.PROBATION and nh.ramp.step_at_s is None
            and nh.validation.verdict is ValidationVerdict.PENDING)
