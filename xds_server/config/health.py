"""``health:`` section: every health threshold with its default and source, grouped by concern.

Sections: ``heartbeat`` (liveness from the agents' beats), ``phi`` (adaptive suspicion),
``rtt``, ``probes`` (micro-inference), ``busy`` (busy is not dead), ``load`` (GPU and engine
load), ``probation`` (half-open and ramp), ``score``, ``outlier``, ``fail_static``, ``validation``
(switch-back replay) and ``drain_timeout``. Durations are written with their unit ("100ms", "60s";
:mod:`xds_server.config.duration`).

The flat names of earlier releases (``heartbeat_interval_ms: 100``) are still read: each is moved
to its section (``heartbeat.interval: 100ms``; :mod:`xds_server.config.health_names`) and said in
one line (``check-config`` prints them; ``check-config --rewrite`` the file with the new names).
"""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from node_probe.xids import FATAL_XIDS
from xds_server.config.base import _Model
from xds_server.config.duration import Duration, NonNegativeDuration, PositiveDuration, at_least
from xds_server.config.health_names import RENAMED
from xds_server.config.renames import Moves, _Renaming
from xds_server.config.validation import ValidationConfig

__all__ = ["BusyConfig", "EngineLoadConfig", "FailStaticConfig", "HealthConfig", "HeartbeatConfig",
           "OutlierConfig", "PhiConfig", "ProbationConfig", "ProbesConfig", "RttConfig", "ScoreConfig"]



class HeartbeatConfig(_Model):
    """Liveness from the agents' heartbeats (seed 000), and the probe stream's redial."""

    ADVANCED: ClassVar[frozenset[str]] = frozenset({"self_lag_tolerance", "silent_tick_max"})

    interval: PositiveDuration = Field(Duration.parse("100ms"), description="seed 000: 100 ms heartbeats")
    grace: NonNegativeDuration = Field(
        Duration.parse("80ms"), description="seed 000: a heartbeat not arrived within interval + 80 ms is a miss")
    consecutive_misses: int = Field(3, ge=1, description="seed 000: 3 consecutive misses -> UNHEALTHY")
    failure_detector: Literal["phi", "count"] = Field(
        "phi",
        description="'phi': phi-accrual suspicion (Hayashibara et al. 2004, section phi) on top of the count "
                    "rule; 'count': only consecutive_misses. The count rule is the floor either way",
    )
    self_lag_tolerance: NonNegativeDuration = Field(
        Duration.parse("20ms"),
        description="a detection timer that fires this late means our own event loop stalled; "
                    "the check is deferred once instead of blaming the node",
    )
    silent_tick_max: PositiveDuration = Field(
        Duration.parse("1s"),
        description="a node ejected for consecutive_misses gets its silence Ticks at growing gaps "
                    "(1, 1, 2, 4, 8 ... intervals) up to this; interval or less: a Tick every "
                    "interval. Ours: bounds the health steps of a silent fleet",
    )
    reconnect_backoff_initial: PositiveDuration = Field(
        Duration.parse("100ms"), description="probe stream redial backoff start")
    reconnect_backoff_max: PositiveDuration = Field(Duration.parse("2s"), description="probe stream redial backoff cap")

    @model_validator(mode="after")
    def _ordered(self) -> HeartbeatConfig:
        if self.reconnect_backoff_max.s < self.reconnect_backoff_initial.s:
            raise ValueError("reconnect_backoff_max must be >= reconnect_backoff_initial")
        return self


class PhiConfig(_Model):
    """Phi-accrual suspicion (Hayashibara et al. 2004), on when ``heartbeat.failure_detector`` is phi."""

    ADVANCED: ClassVar[frozenset[str]] = frozenset({"alpha", "min_samples", "max_suspicions", "suspicion_window"})

    threshold: float = Field(8.0, gt=0, le=15, description="conviction level; 8 is Akka's and Cassandra's default")
    min_std: PositiveDuration = Field(
        Duration.parse("20ms"),
        description="floor of the inter-arrival standard deviation (Akka: min-std-deviation); "
                    "with 100 ms heartbeats, phi 8 is reached ~212 ms after the last one while arrivals are regular",
    )
    acceptable_pause: NonNegativeDuration = Field(Duration.parse("0s"), description="Akka: acceptable-heartbeat-pause")
    alpha: float = Field(0.1, gt=0, le=1, description="EWMA weight of inter-arrival mean/variance")
    min_samples: int = Field(10, ge=1, description="heartbeats before phi is trusted")
    max_suspicions: int = Field(
        6, ge=0,
        description="suspicions that heartbeats later disproved, per suspicion_window, before phi is "
                    "ignored (count rule only) until the oldest leaves the window: bounds flapping; "
                    "shared with transport suspicions (a stream ended by an unanswered PING: then "
                    "the whole miss threshold at once); 0 = unlimited. Ours",
    )
    suspicion_window: PositiveDuration = Field(
        Duration.parse("60s"), description="rolling window of max_suspicions (ours: one minute)")


class RttConfig(_Model):
    """Round-trip time of the probe stream, and the baseline PROBATION waits for."""

    ADVANCED: ClassVar[frozenset[str]] = frozenset({"ping_budget", "ping_jitter", "self_lag_max"})

    ping_interval: PositiveDuration = Field(
        Duration.parse("1s"), description="RTT ping cadence (docs/DESIGN.md section 3)")
    ping_budget: float = Field(
        400.0, ge=0,
        description="RTT pings a second, all nodes of one process together (the main process and each "
        "probe worker): past ping_budget x ping_interval nodes, each node is pinged less often than "
        "ping_interval (every nodes / ping_budget s). 0 = no budget. Ours: a ping is a message written "
        "and one read on the event loop that also reads liveness; at 2,000 nodes, pings every 1 s took "
        "the control plane from 0.93 to 1.27 cores and pings every 5 s to 1.06 (benchmarks/RESULTS.md). "
        "The RTT moves weights and outlier ejection, not liveness")
    ping_jitter: float = Field(
        0.2, ge=0, lt=1,
        description="each wait between pings is ping_interval x a random factor in [1 - this, 1 + this], "
        "so a node's pings do not keep meeting the same periodic work of the control plane, which would "
        "add its length to every round trip of the same nodes. Ours: at 2,000 nodes, pings at exactly 1 s "
        "met the 1 s weight publish (~40 ms) every time, and three healthy nodes read EWMA RTT 65 ms "
        "against a median of 11 ms and were outlier-ejected (benchmarks/RESULTS.md)")
    self_lag_max: Annotated[PositiveDuration, at_least("5ms")] = Field(
        Duration.parse("20ms"),
        description="a round trip during which our own event loop ran this late or later (its loop watch, "
        "probe.stalls.loop_watch_interval) is not a sample: it waited on our queue, not on the node. "
        "Ours: at 2,000 nodes with 1 s pings on two busy cores the median round trip read 11-30 ms and "
        "healthy nodes at 65-90 ms were outlier-ejected (benchmarks/RESULTS.md); a sustained queue of "
        "our own leaves the EWMAs where they were. A ping due while the loop has run this late within one "
        "loop-watch period is not sent (its round trip would not count): an overloaded control plane sheds "
        "that work first")
    ewma_alpha: float = Field(0.2, gt=0, le=1, description="seed 000: EWMA alpha 0.2 for RTT")
    spike_factor: float = Field(
        4.0, ge=1, le=1000,
        description="a ping's round trip counts into the EWMA as at most this many times the EWMA "
        "(at least baseline_slack): one answer late by 0.5 s (the agent's own loop paused, a GC) "
        "otherwise lifts a 2 ms EWMA to ~100 ms and outlier-ejects a healthy node for 30 s; a lasting "
        "rise still grows the EWMA up to 1.6x per ping at alpha 0.2 (2 -> 100 ms: past 70 ms, an "
        "outlier's 3x median + 50 ms, in 10 pings). Ours")
    baseline_alpha: float = Field(0.05, gt=0, le=1, description="slow EWMA of RTT while HEALTHY")
    baseline_tolerance: float = Field(
        1.5, ge=1, description="'EWMA RTT back under its baseline' means <= baseline x this + baseline_slack")
    baseline_slack: NonNegativeDuration = Field(
        Duration.parse("1ms"),
        description="added to baseline x tolerance so sub-millisecond loopback RTTs (where 1.5 x "
                    "is a few microseconds) do not block PROBATION on noise (ours)",
    )
    baseline_wait_periods: float = Field(
        1.0, ge=0, le=100,
        description="the RTT check holds a node whose probes are otherwise clean at most this many "
        "(doubled) clean periods more: past (1 + this) x the clean period it enters PROBATION with its "
        "RTT as it is (the reason says so; the ramp, the score and the outlier rule judge it routed, and "
        "its baseline follows its RTT while HEALTHY). 0: RTT never holds it. Ours: a baseline learned "
        "while the host was idle (1.9 ms) held a recovered node out for good once it was busy (EWMA "
        "4.6 ms after 48 clean probes over 15 s, two nodes serving its share)",
    )

    @field_validator("ping_budget")
    @classmethod
    def _v_ping_budget(cls, v: float) -> float:
        if 0 < v < 1:
            raise ValueError(f"must be 0 (no budget) or at least 1 ping a second, got {v:g}")
        return v


class ProbesConfig(_Model):
    """The 1-token micro-inference probe through the engine (seed 001)."""

    ttft_healthy: PositiveDuration = Field(Duration.parse("200ms"), description="seed 001: TTFT < 200 ms is healthy")
    ttft_timeout: PositiveDuration = Field(
        Duration.parse("800ms"), description="seed 001: 200-800 ms degraded, > 800 ms counts as a timeout")
    ttft_ewma_alpha: float = Field(0.2, gt=0, le=1, description="EWMA alpha for TTFT (as RTT, seed 000)")
    failures_to_eject: int = Field(2, ge=1, description="seed 001: 2 consecutive probe timeouts -> UNHEALTHY")
    good_to_recover: int = Field(3, ge=1, description="seed 001: 3 consecutive probes < 200 ms -> back to HEALTHY")
    degraded_weight_factor: float = Field(
        0.3, gt=0, le=1, description="seed 001: DEGRADED keeps 30 % of its weight (cut by 70 %)")
    stall_confirm: NonNegativeDuration = Field(
        Duration.parse("300ms"),
        description="an engine still reported STALLED this long after the first report, or once "
                    "its last progress is busy.progress_window + this old (measured from the freeze, not "
                    "from the report's arrival), counts as a second probe timeout (-> UNHEALTHY); the first "
                    "report counts as one",
    )
    warm_limit: PositiveDuration = Field(
        Duration.parse("300s"),
        description="a COLD or WARMING node may go this long without a good probe before it is "
                    "shown as 'cannot warm' (reason with the last probe result, one event); it is never routed "
                    "before a good probe either way. Probe failures from an engine that answers (an HTTP status "
                    "other than 503, bad output, a fatal error) say so sooner, at failures_to_eject in a "
                    "row (e.g. a wrong --engine-url). Ours: above fc08's 270 s weight load, so an engine "
                    "still loading is not called stuck",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ProbesConfig:
        if self.ttft_timeout.s <= self.ttft_healthy.s:
            raise ValueError("ttft_timeout must be longer than ttft_healthy")
        return self


class BusyConfig(_Model):
    """A busy engine is never taken for a dead one (field case fc07)."""

    saturated_http_statuses: tuple[int, ...] = Field(
        (429, 503),
        description="probe HTTP statuses that mean 'saturated', not dead, while the engine is busy "
                    "and its token counter advances: DEGRADED, never ejected (field case fc07; 429 Too Many "
                    "Requests and 503 Service Unavailable are what vLLM, SGLang and TGI return when full)",
    )
    http_statuses: tuple[int, ...] = Field(
        (429,),
        description="probe HTTP statuses that always mean 'busy', never a failure: the engine "
                    "itself says it is full (fc07)",
    )
    progress_window: PositiveDuration = Field(
        Duration.parse("1s"),
        description="a slow or timed-out probe is 'busy' (DEGRADED, never ejected) only while the "
                    "agent's evidence of progress (a step counter or the KV-cache usage of an instance with "
                    "requests running moved) is at most this old *and* no older than the probe's own wait "
                    "(probes.ttft_timeout for a timeout, the TTFT of a slow answer), so a reason never says "
                    "'progressing' about progress from before the probe was sent; an HTTP status (answered at "
                    "once) uses this window alone and gives the age. Ours: the agent's stall window (1 s), so a "
                    "hang's last progress stops counting as evidence when the stall is declared",
    )
    confirm_min: PositiveDuration = Field(
        Duration.parse("300ms"),
        description="a probe timeout while the engine shows evidence of progress is judged busy only once "
                    "a progress signal moves *after* it, and a failure when none has moved this long after it, "
                    "or confirm_gaps x the engine's own progress cadence if longer, at most "
                    "progress_window (unknown cadence: the window): a hang that began during the probe's "
                    "wait never reads as busy. Ours: the agent's 100 ms scrape plus a 100 ms "
                    "heartbeat plus 100 ms slack, the longest a progressing engine takes to show a move",
    )
    confirm_gaps: float = Field(
        2.0, ge=1,
        description="... or this many of the engine's recent gaps between progress moves (a chunked "
                    "prefill moves its KV usage every ~0.46 s on vLLM 0.32 with 256-token chunks), "
                    "so an engine whose signals move slowly is not called hung between two moves. Ours",
    )
    refusal_block: PositiveDuration = Field(
        Duration.parse("15s"),
        description="how long a node may answer every probe with an http_statuses status (429) "
                    "and no good probe before it is soft-blocked (REFUSING: not routed, counted against "
                    "outlier.max_ejection_percent, back at its busy or full weight on its first answered probe, "
                    "no probation). Ours: long enough that a load burst an engine works off in seconds "
                    "(its queue draining; 3-30 probes at the agent's 3-5 s busy or 0.5 s idle cadence) keeps "
                    "its DEGRADED share, short against what the share costs: every request Envoy sends to a node "
                    "that refuses everything is a 429 to retry elsewhere. 15 s is half Envoy's default outlier "
                    "base_ejection_time (30 s) and within the 10-30 s an operator expects of a soft ejection",
    )
    good_probes_to_recover: int = Field(
        1, ge=1,
        description="good probes that return a node DEGRADED only for being busy (slow probes, "
                    "429, busy timeouts; no counted failure) to HEALTHY at full weight: no probation or ramp, "
                    "those are for nodes that failed (ours; probes.good_to_recover after a failure)",
    )

    @field_validator("saturated_http_statuses", "http_statuses")
    @classmethod
    def _v_http_statuses(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        bad = [x for x in v if not 100 <= x <= 599]
        if bad:
            raise ValueError(f"HTTP statuses must be in 100..599, got {bad}")
        return v


class EngineLoadConfig(_Model):
    """GPU memory, the engine's queue, and Xid errors (seeds 000 and 002)."""

    gpu_min_free_ratio: float = Field(
        0.05, ge=0, le=1, description="seed 000: GPU free memory under 5 % -> not routed while it lasts")
    queue_warning: float = Field(50, ge=0, description="seed 002: > 50 requests waiting -> weight reduced")
    queue_warning_weight_factor: float = Field(0.5, gt=0, le=1, description="weight kept above queue_warning")
    queue_critical: float = Field(100, ge=0, description="seed 002: > 100 waiting -> not routed while it lasts")
    fatal_xids: list[int] = Field(
        sorted(FATAL_XIDS),
        description="NVIDIA Xid codes that mean the GPU cannot be trusted (DBE, row-remap "
                    "failure, NVLink, fallen off the bus, contained/uncontained ECC); default: "
                    "node_probe.xids.FATAL_XIDS, the agent's list (one home)",
    )

    @model_validator(mode="after")
    def _ordered(self) -> EngineLoadConfig:
        if self.queue_critical < self.queue_warning:
            raise ValueError("queue_critical must be >= queue_warning")
        return self


class ProbationConfig(_Model):
    """Half-open probation and the ramp back to full weight (seed 000)."""

    clean: PositiveDuration = Field(
        Duration.parse("60s"), description="seed 000: 60 s of 100 % successful probes before PROBATION")
    clean_max: PositiveDuration = Field(Duration.parse("600s"), description="cap of the doubled clean period")
    min_probes: int = Field(3, ge=1, description="probes required inside the clean period")
    ramp_start_percent: float = Field(1.0, gt=0, le=100, description="seed 000: start at 1 % of full weight")
    ramp_step_percent: float = Field(1.0, gt=0, le=100, description="seed 000: +1 % per step")
    ramp_step: PositiveDuration = Field(Duration.parse("1s"), description="step length (ours; the seed gives none)")

    @model_validator(mode="after")
    def _ordered(self) -> ProbationConfig:
        if self.clean_max.s < self.clean.s:
            raise ValueError("clean_max must be >= clean")
        return self


class ScoreConfig(_Model):
    """Weights among routable nodes (seed 000: score = 0.7 x EWMA RTT + 0.3 x GPU used)."""

    rtt_weight: float = Field(0.7, ge=0, description="seed 000: score = 0.7 x EWMA RTT ms + ...")
    gpu_weight: float = Field(0.3, ge=0, description="seed 000: ... + 0.3 x (1 - GPU free) x 100")
    slack: float = Field(
        10.0, ge=0, description="added to every score before comparing, so ms-level RTT noise does not move weights")
    min_factor: float = Field(0.25, gt=0, le=1, description="the worst-scored routable node keeps this share")
    step: float = Field(0.05, gt=0, le=1, description="score factors are quantized to this step")


class OutlierConfig(_Model):
    """Outliers against the cluster's median, and the cap on soft ejections."""

    factor: float = Field(3.0, gt=1, description="EWMA above this x cluster median -> outlier")
    min_gap_rtt: NonNegativeDuration = Field(
        Duration.parse("50ms"), description="...and at least this far above it (RTT)")
    min_gap_ttft: NonNegativeDuration = Field(
        Duration.parse("200ms"), description="...and at least this far above it (TTFT)")
    min_nodes: int = Field(3, ge=2, description="nodes with data needed for a median")
    min_rtt_samples: int = Field(
        5, ge=1,
        description="a node's EWMA RTT is judged (and counts toward the median) only after this many "
        "pings since this control plane started, and until then it is the smallest round trip seen: "
        "the first round trips of a stream measure its setup and our own connect storm (1,000 agents "
        "dialling at once read 60-130 ms against a 13 ms median, and 79 healthy nodes were "
        "outlier-ejected); Envoy's outlier detection likewise waits for success_rate_request_volume. Ours")
    ejection: PositiveDuration = Field(Duration.parse("30s"), description="first outlier ejection; doubles each time")
    ejection_max: PositiveDuration = Field(Duration.parse("300s"), description="cap of the doubled outlier ejection")
    max_ejection_percent: float = Field(
        50.0, ge=0, le=100,
        description="never eject more than this share of a cluster by outlier or soft rules; "
                    "hard evidence (lost heartbeats, failed probes, engine fatal) is never held back",
    )

    @model_validator(mode="after")
    def _ordered(self) -> OutlierConfig:
        if self.ejection_max.s < self.ejection.s:
            raise ValueError("ejection_max must be >= ejection")
        return self


class FailStaticConfig(_Model):
    """Many nodes lost together is our network's fault, not theirs: keep the last good assignment."""

    fraction: float = Field(
        0.5, gt=0, lt=1, description="more than this share of all nodes lost together -> suspect our network")
    window: PositiveDuration = Field(
        Duration.parse("300ms"), description="'together': heartbeat losses within this window of each other")
    min_nodes: int = Field(3, ge=2, description="fleets smaller than this never go fail-static")
    forgive_intervals: int = Field(
        10, ge=0,
        description="a node still silent when fail-static ends is forgiven its heartbeat ejection "
                    "if its heartbeats resume within this many heartbeat intervals (ours: 1 s at 100 ms)",
    )


class HealthConfig(_Renaming):
    """Thresholds of the health model, by concern. Defaults come from the seeds (docs/DESIGN.md section 4)."""

    WHERE: ClassVar[str] = "health"
    MOVED: ClassVar[Moves] = RENAMED

    heartbeat: HeartbeatConfig = Field(default_factory=HeartbeatConfig, description="liveness from heartbeats")
    phi: PhiConfig = Field(default_factory=PhiConfig, description="adaptive suspicion")
    rtt: RttConfig = Field(default_factory=RttConfig, description="round-trip time")
    probes: ProbesConfig = Field(default_factory=ProbesConfig, description="micro-inference probes")
    busy: BusyConfig = Field(default_factory=BusyConfig, description="busy is not dead")
    load: EngineLoadConfig = Field(default_factory=EngineLoadConfig, description="GPU and engine load")
    probation: ProbationConfig = Field(default_factory=ProbationConfig, description="half-open probation and ramp")
    score: ScoreConfig = Field(default_factory=ScoreConfig, description="weights among routable nodes")
    outlier: OutlierConfig = Field(default_factory=OutlierConfig, description="outliers and the ejection cap")
    fail_static: FailStaticConfig = Field(default_factory=FailStaticConfig, description="fail-static")
    drain_timeout: PositiveDuration = Field(
        Duration.parse("600s"), description="a drain is complete when in-flight is 0 or after this")
    validation: ValidationConfig = Field(default_factory=ValidationConfig,
                                         description="switch-back validation by replay (off by default)")
