"""``health:`` section: every health threshold with its default and source."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from node_probe.xids import FATAL_XIDS
from xds_server.config.base import _Model
from xds_server.config.validation import ValidationConfig

__all__ = ["HealthConfig"]


class HealthConfig(_Model):
    """Thresholds of the health model. Defaults come from the seeds (docs/DESIGN.md section 4)."""

    heartbeat_interval_ms: float = Field(100.0, gt=0, description="seed 000: 100 ms heartbeats")
    heartbeat_grace_ms: float = Field(
        80.0, ge=0, description="seed 000: a heartbeat not arrived within interval + 80 ms is a miss"
    )
    consecutive_misses: int = Field(3, ge=1, description="seed 000: 3 consecutive misses -> UNHEALTHY")
    ping_interval_ms: float = Field(1000.0, gt=0, description="RTT ping cadence (docs/DESIGN.md section 3)")
    rtt_ewma_alpha: float = Field(0.2, gt=0, le=1, description="seed 000: EWMA alpha 0.2 for RTT")
    ttft_healthy_ms: float = Field(200.0, gt=0, description="seed 001: TTFT < 200 ms is healthy")
    ttft_timeout_ms: float = Field(
        800.0, gt=0, description="seed 001: 200-800 ms degraded, > 800 ms counts as a timeout"
    )
    probe_failures_to_eject: int = Field(
        2, ge=1, description="seed 001: 2 consecutive probe timeouts -> UNHEALTHY"
    )
    good_probes_to_recover: int = Field(
        3, ge=1, description="seed 001: 3 consecutive probes < 200 ms -> back to HEALTHY"
    )
    degraded_weight_factor: float = Field(
        0.3, gt=0, le=1, description="seed 001: DEGRADED keeps 30 % of its weight (cut by 70 %)"
    )
    reconnect_backoff_initial_ms: float = Field(100.0, gt=0, description="probe stream redial backoff start")
    reconnect_backoff_max_ms: float = Field(2000.0, gt=0, description="probe stream redial backoff cap")
    # -- adaptive failure detection (phi accrual) -------------------------------------------
    failure_detector: Literal["phi", "count"] = Field(
        "phi",
        description="'phi': phi-accrual suspicion (Hayashibara et al. 2004) on top of the count "
        "rule; 'count': only consecutive_misses. The count rule is the floor either way",
    )
    phi_threshold: float = Field(
        8.0, gt=0, le=15, description="conviction level; 8 is Akka's and Cassandra's default"
    )
    phi_min_std_ms: float = Field(
        20.0, gt=0,
        description="floor of the inter-arrival standard deviation (Akka: min-std-deviation); "
        "with 100 ms heartbeats, phi 8 is reached ~212 ms after the last one while arrivals are regular",
    )
    phi_acceptable_pause_ms: float = Field(0.0, ge=0, description="Akka: acceptable-heartbeat-pause")
    phi_alpha: float = Field(0.1, gt=0, le=1, description="EWMA weight of inter-arrival mean/variance")
    phi_min_samples: int = Field(10, ge=1, description="heartbeats before phi is trusted")
    phi_max_suspicions_per_min: int = Field(
        6, ge=0,
        description="suspicions that heartbeats later disproved, per phi_suspicion_window_s "
        "(default one minute, hence the name), before phi is ignored (count rule only) until the "
        "oldest leaves the window: bounds flapping; 0 = unlimited. Ours",
    )
    phi_suspicion_window_s: float = Field(
        60.0, gt=0, description="rolling window of phi_max_suspicions_per_min (ours: one minute)"
    )
    self_lag_tolerance_ms: float = Field(
        20.0, ge=0,
        description="a detection timer that fires this late means our own event loop stalled; "
        "the check is deferred once instead of blaming the node",
    )
    # -- micro-probes ---------------------------------------------------------------------------
    ttft_ewma_alpha: float = Field(0.2, gt=0, le=1, description="EWMA alpha for TTFT (as RTT, seed 000)")
    saturated_http_statuses: tuple[int, ...] = Field(
        (429, 503),
        description="probe HTTP statuses that mean 'saturated', not dead, while the engine is busy "
        "and its token counter advances: DEGRADED, never ejected (field case fc07; 429 Too Many "
        "Requests and 503 Service Unavailable are what vLLM, SGLang and TGI return when full)",
    )
    busy_http_statuses: tuple[int, ...] = Field(
        (429,),
        description="probe HTTP statuses that always mean 'busy', never a failure: the engine "
        "itself says it is full (fc07)",
    )
    busy_progress_window_ms: float = Field(
        1000.0, gt=0,
        description="a slow or timed-out probe is 'busy' (DEGRADED, never ejected) only while the "
        "agent's evidence of progress (a step counter or the KV-cache usage of an instance with "
        "requests running moved) is at most this old *and* no older than the probe's own wait "
        "(ttft_timeout_ms for a timeout, the TTFT of a slow answer), so a reason never says "
        "'progressing' about progress from before the probe was sent; an HTTP status (answered at "
        "once) uses this window alone and gives the age. Ours: the agent's stall window (1 s), so a "
        "hang's last progress stops counting as evidence when the stall is declared",
    )
    busy_confirm_min_ms: float = Field(
        300.0, gt=0,
        description="a probe timeout while the engine shows evidence of progress is judged busy only once "
        "a progress signal moves *after* it, and a failure when none has moved this long (ms) after it, "
        "or busy_confirm_gaps x the engine's own progress cadence if longer, at most "
        "busy_progress_window_ms (unknown cadence: the window): a hang that began during the probe's "
        "wait never reads as busy. Ours: the agent's 100 ms scrape plus a 100 ms "
        "heartbeat plus 100 ms slack, the longest a progressing engine takes to show a move",
    )
    busy_confirm_gaps: float = Field(
        2.0, ge=1,
        description="... or this many of the engine's recent gaps between progress moves (a chunked "
        "prefill moves its KV usage every ~0.46 s on vLLM 0.32 with 256-token chunks), "
        "so an engine whose signals move slowly is not called hung between two moves. Ours",
    )
    busy_refusal_block_s: float = Field(
        15.0, gt=0,
        description="seconds (s) a node may answer every probe with a busy_http_statuses status (429) "
        "and no good probe before it is soft-blocked (REFUSING: not routed, counted against "
        "max_ejection_percent, back at its busy or full weight on its first answered probe, no "
        "probation). Ours: long enough that a load burst an engine works off in seconds "
        "(its queue draining; 3-30 probes at the agent's 3-5 s busy or 0.5 s idle cadence) keeps "
        "its DEGRADED share, short against what the share costs: every request Envoy sends to a node that refuses "
        "everything is a 429 to retry elsewhere. 15 s is half Envoy's default outlier "
        "base_ejection_time (30 s) and within the 10-30 s an operator expects of a soft ejection",
    )
    warm_limit_s: float = Field(
        300.0, gt=0,
        description="seconds (s) a COLD or WARMING node may go without a good probe before it is "
        "shown as 'cannot warm' (reason with the last probe result, one event); it is never routed "
        "before a good probe either way. Probe failures from an engine that answers (an HTTP status "
        "other than 503, bad output, a fatal error) say so sooner, at probe_failures_to_eject in a "
        "row (e.g. a wrong --engine-url). Ours: above fc08's 270 s weight load, so an engine "
        "still loading is not called stuck",
    )
    busy_good_probes_to_recover: int = Field(
        1, ge=1,
        description="good probes that return a node DEGRADED only for being busy (slow probes, "
        "429, busy timeouts; no counted failure) to HEALTHY at full weight: no probation or ramp, "
        "those are for nodes that failed (ours; good_probes_to_recover after a failure)",
    )
    stall_confirm_ms: float = Field(
        300.0, ge=0,
        description="an engine still reported STALLED this long after the first report, or once "
        "its last progress is busy_progress_window_ms + this old (measured from the freeze, not "
        "from the report's arrival), counts as a second probe timeout (-> UNHEALTHY); the first "
        "report counts as one",
    )
    # -- GPU and engine load --------------------------------------------------------------------
    gpu_min_free_ratio: float = Field(
        0.05, ge=0, le=1, description="seed 000: GPU free memory under 5 % -> not routed while it lasts"
    )
    queue_warning: float = Field(50, ge=0, description="seed 002: > 50 requests waiting -> weight reduced")
    queue_warning_weight_factor: float = Field(0.5, gt=0, le=1, description="weight kept above queue_warning")
    queue_critical: float = Field(100, ge=0, description="seed 002: > 100 waiting -> not routed while it lasts")
    fatal_xids: list[int] = Field(
        sorted(FATAL_XIDS),
        description="NVIDIA Xid codes that mean the GPU cannot be trusted (DBE, row-remap "
        "failure, NVLink, fallen off the bus, contained/uncontained ECC); default: "
        "node_probe.xids.FATAL_XIDS, the agent's list (one home)",
    )
    # -- half-open probation and ramp (seed 000) ---------------------------------------------
    probation_clean_s: float = Field(
        60.0, gt=0, description="seed 000: 60 s of 100 % successful probes before PROBATION"
    )
    probation_clean_max_s: float = Field(600.0, gt=0, description="cap of the doubled clean period")
    probation_min_probes: int = Field(3, ge=1, description="probes required inside the clean period")
    rtt_baseline_alpha: float = Field(0.05, gt=0, le=1, description="slow EWMA of RTT while HEALTHY")
    rtt_baseline_tolerance: float = Field(
        1.5, ge=1, description="'EWMA RTT back under its baseline' means <= baseline x this + rtt_baseline_slack_ms"
    )
    rtt_baseline_slack_ms: float = Field(
        1.0, ge=0,
        description="added to baseline x tolerance so sub-millisecond loopback RTTs (where 1.5 x "
        "is a few microseconds) do not block PROBATION on noise (ours)",
    )
    ramp_start_percent: float = Field(1.0, gt=0, le=100, description="seed 000: start at 1 % of full weight")
    ramp_step_percent: float = Field(1.0, gt=0, le=100, description="seed 000: +1 % per step")
    ramp_step_s: float = Field(1.0, gt=0, description="step length (ours; the seed gives none)")
    # -- cluster policy ------------------------------------------------------------------------
    score_rtt_weight: float = Field(0.7, ge=0, description="seed 000: score = 0.7 x EWMA RTT ms + ...")
    score_gpu_weight: float = Field(0.3, ge=0, description="seed 000: ... + 0.3 x (1 - GPU free) x 100")
    score_slack: float = Field(
        10.0, ge=0, description="added to every score before comparing, so ms-level RTT noise "
        "does not move weights"
    )
    score_min_factor: float = Field(0.25, gt=0, le=1, description="the worst-scored routable node keeps this share")
    score_step: float = Field(0.05, gt=0, le=1, description="score factors are quantized to this step")
    outlier_factor: float = Field(3.0, gt=1, description="EWMA above this x cluster median -> outlier")
    outlier_min_gap_rtt_ms: float = Field(50.0, ge=0, description="...and at least this far above it (RTT)")
    outlier_min_gap_ttft_ms: float = Field(200.0, ge=0, description="...and at least this far above it (TTFT)")
    outlier_min_nodes: int = Field(3, ge=2, description="nodes with data needed for a median")
    outlier_ejection_s: float = Field(30.0, gt=0, description="first outlier ejection; doubles each time")
    outlier_ejection_max_s: float = Field(300.0, gt=0, description="cap of the doubled outlier ejection")
    max_ejection_percent: float = Field(
        50.0, ge=0, le=100,
        description="never eject more than this share of a cluster by outlier or soft rules; "
        "hard evidence (lost heartbeats, failed probes, engine fatal) is never held back",
    )
    fail_static_fraction: float = Field(
        0.5, gt=0, lt=1, description="more than this share of all nodes lost together -> suspect our network"
    )
    fail_static_window_ms: float = Field(
        300.0, gt=0, description="'together': heartbeat losses within this window of each other"
    )
    silent_tick_max_ms: float = Field(
        1000.0, gt=0,
        description="a node ejected for consecutive_misses gets its silence Ticks at growing gaps "
        "(1, 1, 2, 4, 8 ... intervals) up to this (ms); heartbeat_interval_ms or less: a Tick every "
        "interval. Ours: bounds the health steps of a silent fleet",
    )
    fail_static_min_nodes: int = Field(3, ge=2, description="fleets smaller than this never go fail-static")
    fail_static_forgive_intervals: int = Field(
        10, ge=0,
        description="a node still silent when fail-static ends is forgiven its heartbeat ejection "
        "if its heartbeats resume within this many heartbeat intervals (ours: 1 s at 100 ms)",
    )
    drain_timeout_s: float = Field(600.0, gt=0, description="a drain is complete when in-flight is 0 or after this")
    validation: ValidationConfig = Field(default_factory=ValidationConfig,
                                         description="switch-back validation by replay (off by default)")

    @field_validator("saturated_http_statuses", "busy_http_statuses")
    @classmethod
    def _v_http_statuses(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        bad = [x for x in v if not 100 <= x <= 599]
        if bad:
            raise ValueError(f"HTTP statuses must be in 100..599, got {bad}")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> HealthConfig:
        if self.ttft_timeout_ms <= self.ttft_healthy_ms:
            raise ValueError("ttft_timeout_ms must be greater than ttft_healthy_ms")
        if self.reconnect_backoff_max_ms < self.reconnect_backoff_initial_ms:
            raise ValueError("reconnect_backoff_max_ms must be >= reconnect_backoff_initial_ms")
        if self.queue_critical < self.queue_warning:
            raise ValueError("queue_critical must be >= queue_warning")
        if self.probation_clean_max_s < self.probation_clean_s:
            raise ValueError("probation_clean_max_s must be >= probation_clean_s")
        if self.outlier_ejection_max_s < self.outlier_ejection_s:
            raise ValueError("outlier_ejection_max_s must be >= outlier_ejection_s")
        return self
