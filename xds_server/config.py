"""Control-plane configuration: one YAML file -> validated pydantic models.

Every threshold lives here with its default and the source of that default (the seed articles,
see docs/sources.md, and docs/DESIGN.md section 4). Nothing else in the code base hard-codes them.

Errors: :func:`load_config` and :func:`parse_config` raise :class:`ConfigError`, whose message
names each offending field by its dotted path (``clusters.0.nodes.1.address``) and the reason.
"""
from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from node_probe.telemetry import FATAL_XIDS

__all__ = [
    "AdminConfig",
    "ClusterConfig",
    "ConfigError",
    "DropOverloadConfig",
    "HealthConfig",
    "Locality",
    "NodeConfig",
    "OutlierDetectionConfig",
    "ProbeConfig",
    "ReloadConfig",
    "SentinelConfig",
    "StateConfig",
    "XdsConfig",
    "load_config",
    "parse_config",
    "parse_hostport",
]


class ConfigError(ValueError):
    """A configuration file is unreadable or invalid; the message names field(s) and reason(s)."""


def parse_hostport(value: str) -> tuple[str, int]:
    """Split ``"HOST:PORT"`` (``"[v6]:PORT"`` for IPv6) into ``(host, port)``.

    Raises ValueError when the port is missing, not an integer, or outside 0..65535.
    """
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host, _, port_s = value.rpartition(":")
    host = host.strip("[]")
    if not host:
        raise ValueError(f"missing host in {value!r}")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"port {port_s!r} is not an integer") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} outside 0..65535")
    return host, port


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_hostport(v: str) -> str:
    parse_hostport(v)
    return v


class XdsConfig(_Model):
    """The ADS gRPC server."""

    listen: str = Field("127.0.0.1:18000", description="HOST:PORT of the ADS gRPC server")
    server_id: str = Field(
        "sentinel", min_length=1, max_length=32,
        description="prefix of every version_info, so versions from two replicas never collide",
    )
    warmup_timeout_ms: int = Field(
        5000, ge=0,
        description="after start, hold a cluster's assignment until every node has left COLD or "
        "this long has passed, so a restart never publishes 'everything unhealthy' (docs/DESIGN.md section 6)",
    )
    max_receive_message_bytes: int = Field(
        16 * 1024 * 1024, ge=4 * 1024 * 1024,
        description="largest ADS request accepted (gRPC answers RESOURCE_EXHAUSTED above it). "
        "A delta reconnect echoes every name+version and a SotW EDS request names every cluster: "
        "gRPC's 4 MiB default is too small (docs/xds_protocol.md section 5 item 7); 16 MiB holds "
        "~200,000 names of 64 characters with versions (150,000 long names are ~6.3 MB) while "
        "bounding what one message can make the server parse and hold (was 64 MiB)",
    )
    coalesce_window_ms: float = Field(
        5.0, ge=0, le=1000,
        description="at most one publish per window: a change after a quiet window is published "
        "at once; changes arriving within the window after a publish are coalesced into one push "
        "(one build and encode per cluster, one response per stream) at its end. 0 = changes in "
        "one event-loop iteration only. Ours: a few ms is far below a heartbeat interval (100 ms) "
        "and turns a burst (a rack losing power) into two updates instead of one per node",
    )
    keepalive_time_ms: int = Field(
        30_000, ge=1_000,
        description="HTTP/2 keepalive ping interval on ADS streams (checklist 1.9 item 28); "
        "matches the 30 s the Envoy bootstrap uses towards us",
    )
    keepalive_timeout_ms: int = Field(5_000, ge=100, description="keepalive ping ack deadline")
    min_client_ping_interval_ms: int = Field(
        5_000, ge=0,
        description="HTTP/2 pings from a client without data in flight closer than this are a "
        "protocol violation (gRPC's grpc.http2.min_ping_interval_without_data_ms; its default 5 min "
        "would reject Envoy's 30 s keepalive; ours: 5 s)",
    )
    max_tracked_nonces: int = Field(
        16, ge=1, le=1024,
        description="delta: un-ACKed nonces remembered per stream and type (to report which "
        "version an ACK or NACK refers to); older ones count as stale",
    )
    fail_static_history_max: int = Field(
        1024, ge=2, le=1_000_000,
        description="assignments per cluster kept to find the last good one when fail-static "
        "begins; only those that can still be the answer are kept, this caps the rest (ours: "
        "a burst coalesced at 5 ms publishes 200 assignments per second)",
    )
    max_types_per_stream: int = Field(
        32, ge=2, le=1024,
        description="distinct type_urls one stream may ask for (INVALID_ARGUMENT beyond); Envoy "
        "uses a handful (CDS, EDS, LDS, RDS, SDS, ...)",
    )
    max_names_per_stream: int = Field(
        200_000, ge=1,
        description="subscribed resource names one stream may hold, all types (INVALID_ARGUMENT "
        "beyond): ~100 B each, so at most ~20 MB per stream; ours, above the 150,000-name "
        "request the conformance suite accepts",
    )
    client_text_max_chars: int = Field(
        256, ge=16,
        description="node id, node cluster, user agent, type_url and versions kept from a client "
        "are clipped to this many characters (type_urls longer are INVALID_ARGUMENT); Envoy's are "
        "far shorter. Ours (issue 9: 64 KB node ids grew /metrics and /xds/clients to 19.7 MB)",
    )
    nack_message_max_chars: int = Field(
        1024, ge=16,
        description="a NACK's error_detail.message as kept for /xds/clients and logged; Envoy's "
        "messages name the field and the reason in a few hundred characters",
    )
    absent_names_max_per_stream: int = Field(
        1000, ge=0,
        description="SotW EDS names that exist nowhere answered with an empty assignment, per stream "
        "and type (issue 11: Envoy would otherwise wait on them); names beyond get no answer, so a "
        "request naming 150,000 unknown clusters cannot make a 20 MB response (ours)",
    )
    clients_view_max_names: int = Field(
        100, ge=0,
        description="subscribed names listed per stream and type in /xds/clients (the count is "
        "always given): a client may hold 200,000 names; the view stays small",
    )
    memo_max_entries: int = Field(
        1024, ge=1,
        description="entries in each memo of the snapshot cache (encoded response bodies and "
        "subscription-set versions; two memos per served type, emptied on every change of the "
        "type). Ours: distinct responses in flight between two changes are few",
    )
    memo_max_bytes: int = Field(
        4 * 1024 * 1024, ge=64 * 1024,
        description="bytes (estimated) in each memo of the snapshot cache, least recently used "
        "out first; an entry over a quarter of it is not memoized. Bounds what closed streams "
        "leave behind (issue 9: an unbounded memo held 529 MB after 200 closed streams)",
    )
    request_bytes_per_s: int = Field(
        1024 * 1024, ge=1024,
        description="per-stream request budget, sustained: bytes of requests per second a stream "
        "may send before the server stops reading it for a while (HTTP/2 flow control then holds "
        "the client back). An Envoy sends a few small ACKs per update; ours: one stream flooding "
        "1.7 MB requests slowed every other stream's EDS delivery 60x (issue 9)",
    )
    request_burst_bytes: int = Field(
        16 * 1024 * 1024, ge=4 * 1024,
        description="per-stream request budget, burst: bytes a stream may send at once; one request "
        "is always read when the budget is not overdrawn, so a reconnect with every name (up to "
        "max_receive_message_bytes) is served at once",
    )
    request_cost_min_bytes: int = Field(
        1024, ge=0,
        description="what each request costs at least from the budget, bytes, whatever its size "
        "(so a flood of tiny requests is bounded too: 1,024 B/request at 1 MiB/s = 1,024 "
        "requests/s)",
    )

    _v_listen = field_validator("listen")(_check_hostport)


class AdminConfig(_Model):
    """The admin HTTP endpoint (aiohttp)."""

    listen: str = Field("127.0.0.1:19000", description="HOST:PORT of the admin HTTP server")
    token: str | None = Field(None, description="bearer token for POST drain/undrain; None = disabled")
    events_buffer: int = Field(1000, ge=10, description="events kept in the ring buffer")
    event_reason_max_chars: int = Field(
        512, ge=16, le=65_536,
        description="an event's reason is clipped to this before it is stored (ours: the longest "
        "reason the model writes is ~200 characters; agent and operator text is cut)",
    )
    drain_reason_max_chars: int = Field(
        200, ge=1, le=4096, description="the drain/undrain ?reason= text is clipped to this",
    )
    live_interval_ms: int = Field(
        500, ge=50, le=60_000,
        description="the dashboard's live feed (GET /live) sends a snapshot this often while a "
        "browser listens (ours: 2 Hz reads well and costs one /nodes view per tick)",
    )
    live_queue_max: int = Field(
        64, ge=2, le=10_000,
        description="messages queued per live-feed client; a client that falls this far behind is "
        "dropped and reconnects (ours: 64 is ~30 s of snapshots at the default rate)",
    )
    live_ping_s: float = Field(
        15.0, gt=0, le=300,
        description="an idle live-feed stream gets a comment line this often (ours: under the "
        "common 30-60 s proxy idle timeouts)",
    )

    _v_listen = field_validator("listen")(_check_hostport)


class ProbeConfig(_Model):
    """The probe stream to each node_probe agent (gRPC client side) and what it accepts."""

    keepalive_time_ms: int = Field(
        1000, ge=100,
        description="HTTP/2 keepalive ping interval on the probe channel (ours: a dead TCP path is "
        "noticed within ~2 s even if no heartbeat is due; heartbeats catch it sooner anyway)",
    )
    keepalive_timeout_ms: int = Field(1000, ge=100, description="keepalive ping ack deadline (ours)")
    channel_initial_backoff_ms: int = Field(
        100, ge=1,
        description="gRPC channel's own first reconnect backoff (gRPC's default is 1 s: too slow "
        "for a node whose agent restarts); the channel's cap is health.reconnect_backoff_max_ms",
    )
    max_unanswered_pings: int = Field(
        64, ge=1, le=65_536, description="outstanding RTT pings remembered per stream (ours)",
    )
    silent_stream_redial_ms: float = Field(
        2000.0, gt=0,
        description="a probe stream open but without a heartbeat for this long is closed and "
        "redialled (ours: 20 heartbeat intervals; the heartbeat rules eject the node long before)",
    )
    max_text_chars: int = Field(
        256, ge=16, le=65_536,
        description="agent strings (stall_detail, error texts, kv_cache_metric) are clipped to this "
        "before they reach reasons, events, logs or ProbeNow (ours)",
    )
    max_gpus: int = Field(64, ge=1, le=4096, description="GPU readings per heartbeat kept (ours: 8-16 per host)")
    max_list_items: int = Field(
        64, ge=1, le=4096, description="xid_events and errors kept per GPU reading (ours)",
    )
    max_ttft_ms: float = Field(
        10_000.0, gt=0,
        description="a successful probe's TTFT above this is rejected as nonsense, never fed to the "
        "TTFT EWMA (ours: 12.5 x health.ttft_timeout_ms; an agent gives up at its probe timeout, "
        "and one absurd value would keep a node an outlier for minutes)",
    )
    max_requests: float = Field(
        1e9, gt=0, description="requests_waiting/running above this are rejected as nonsense (ours)",
    )
    malformed_log_interval_s: float = Field(
        10.0, ge=0, description="a kind of malformed agent message is logged at most once per this (ours)",
    )
    unreachable_log_interval_s: float = Field(
        60.0, ge=0,
        description="an agent that cannot be reached is logged when it first fails, then at most once "
        "per this while it stays unreachable (with the count of failed dials); /nodes shows it at once (ours)",
    )
    lag_recheck_ms: float = Field(
        5.0, gt=0, le=1000,
        description="a detection timer that fired late (health.self_lag_tolerance_ms) is re-run this "
        "much later, once, so heartbeats already waiting are read first (ours)",
    )


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
        "requests running moved) is at most this old; ours: the agent's stall window (1 s), so a "
        "hang's last progress stops counting as evidence when the stall is declared (issue 11)",
    )
    busy_good_probes_to_recover: int = Field(
        1, ge=1,
        description="good probes that return a node DEGRADED only for being busy (slow probes, "
        "429, busy timeouts; no counted failure) to HEALTHY at full weight: no probation or ramp, "
        "those are for nodes that failed (ours, issue 11; good_probes_to_recover after a failure)",
    )
    stall_confirm_ms: float = Field(
        300.0, ge=0,
        description="an engine still reported STALLED this long after the first report counts "
        "as a second probe timeout (-> UNHEALTHY); the first report counts as one",
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
        "node_probe.telemetry.FATAL_XIDS, the agent's list (one home)",
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
    fail_static_min_nodes: int = Field(3, ge=2, description="fleets smaller than this never go fail-static")
    fail_static_forgive_intervals: int = Field(
        10, ge=0,
        description="a node still silent when fail-static ends is forgiven its heartbeat ejection "
        "if its heartbeats resume within this many heartbeat intervals (ours: 1 s at 100 ms)",
    )
    drain_timeout_s: float = Field(600.0, gt=0, description="a drain is complete when in-flight is 0 or after this")

    @field_validator("saturated_http_statuses", "busy_http_statuses")
    @classmethod
    def _v_http_statuses(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        bad = [x for x in v if not 100 <= x <= 599]
        if bad:
            raise ValueError(f"HTTP statuses must be in 100..599, got {bad}")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> "HealthConfig":
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


class Locality(_Model):
    """Envoy locality of a node (region/zone/sub_zone)."""

    region: str = ""
    zone: str = ""
    sub_zone: str = ""


class NodeConfig(_Model):
    """One inference node: where Envoy sends traffic and where its node_probe agent listens."""

    id: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")
    address: str = Field(..., description="serving HOST:PORT Envoy routes to (IP literal)")
    probe_address: str = Field(..., description="HOST:PORT of the node's node_probe agent (gRPC)")
    locality: Locality = Locality()
    priority: int = Field(0, ge=0, le=128, description="Envoy priority; 0 is highest")
    capacity: int = Field(
        1, ge=1, le=1_000_000,
        description="relative capacity; full weight = capacity x 100 so a 1 % step is representable",
    )

    @field_validator("address")
    @classmethod
    def _v_address(cls, v: str) -> str:
        host, port = parse_hostport(v)
        if port == 0:
            raise ValueError("port 0 is not a serving port")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"host {host!r} must be an IP literal (the cluster uses EDS with static addresses)"
            ) from None
        return v

    @field_validator("probe_address")
    @classmethod
    def _v_probe(cls, v: str) -> str:
        _, port = parse_hostport(v)
        if port == 0:
            raise ValueError("port 0 is not a probe port")
        return v


class OutlierDetectionConfig(_Model):
    """Envoy passive outlier detection served in the Cluster: a second line behind our probes."""

    enabled: bool = True
    consecutive_5xx: int = Field(5, ge=1, description="Envoy default 5")
    interval_ms: int = Field(1000, ge=1)
    base_ejection_time_ms: int = Field(10_000, ge=1)
    max_ejection_percent: int = Field(50, ge=0, le=100)


class DropOverloadConfig(_Model):
    """Shed a share of traffic at Envoy (``ClusterLoadAssignment.policy.drop_overloads``) when the
    cluster has lost capacity, instead of overloading the survivors.

    Dropped requests get a local 503 "drop overload" from Envoy (docs/xds_protocol.md 2.5).
    """

    category: str = Field(
        "capacity_lost", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$",
        description="Envoy stat/category name of the drop",
    )
    drop_percent: float = Field(
        ..., gt=0, le=100, description="share of requests dropped while the condition holds, %",
    )
    below_routable_capacity_ratio: float = Field(
        0.5, gt=0, le=1,
        description="apply the drop while the routable (HEALTHY, weighted) share of the "
        "cluster's full capacity is below this ratio; the drop and the host change that caused "
        "it land in the same ClusterLoadAssignment, which Envoy 1.40 needs to apply a drop "
        "change at all (docs/xds_protocol.md 2.5)",
    )


class ClusterConfig(_Model):
    """One Envoy cluster (CDS) and its nodes (EDS ClusterLoadAssignment)."""

    name: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    lb_policy: Literal["LEAST_REQUEST", "ROUND_ROBIN"] = Field(
        "LEAST_REQUEST", description="RANDOM ignores endpoint weights, so it is not offered"
    )
    healthy_panic_threshold_percent: float = Field(
        0.0, ge=0, le=100,
        description="Envoy's default 50 % spreads traffic over dead nodes (fc04); default 0",
    )
    update_merge_window_ms: int = Field(
        0, ge=0, description="Envoy's default 1 s delays ejection inside Envoy; default 0"
    )
    connect_timeout_ms: int = Field(1000, ge=1)
    upstream_protocol: Literal["http1", "http2"] = "http1"
    max_requests: int = Field(
        100_000, ge=1, description="circuit breaker; Envoy's 1024 default trips on long streams"
    )
    max_retries: int = Field(
        1024, ge=1,
        description="circuit breaker on concurrent retries; Envoy's default of 3 overflows when a "
        "node holding several in-flight requests freezes and they all retry at once",
    )
    outlier_detection: OutlierDetectionConfig = OutlierDetectionConfig()
    overprovisioning_factor: int = Field(
        140, ge=1, le=100_000,
        description="ClusterLoadAssignment.policy.overprovisioning_factor, %. Envoy's default 140: "
        "priority 0 keeps all traffic until fewer than ~71.4 % of its hosts are healthy, then "
        "the rest spills to priority 1 (docs/xds_protocol.md 2.4); 100 spills at the first loss",
    )
    drop_overloads: list[DropOverloadConfig] = Field(
        default_factory=list, max_length=1,
        description="at most one category: Envoy 1.40 NACKs an assignment with two "
        "(docs/xds_protocol.md 2.5)",
    )
    nodes: list[NodeConfig] = Field(
        default_factory=list,
        description="may be empty: a pool scaled to zero is served an assignment with no endpoints",
    )

    @model_validator(mode="after")
    def _unique_nodes(self) -> "ClusterConfig":
        seen: set[str] = set()
        for n in self.nodes:
            if n.id in seen:
                raise ValueError(f"duplicate node id {n.id!r}")
            seen.add(n.id)
        prios = sorted({n.priority for n in self.nodes})
        if prios != list(range(len(prios))):
            raise ValueError(f"priorities must be contiguous from 0, got {prios}")
        return self


class ReloadConfig(_Model):
    """Hot reload of the config file (SIGHUP, ``POST /reload``, or a change of the file)."""

    watch_interval_s: float = Field(
        2.0, ge=0, description="how often the config file's mtime and content hash are checked; 0: "
                               "no watching, reload on SIGHUP or POST /reload only (ours)",
    )
    drain_check_interval_s: float = Field(
        1.0, gt=0, description="how often nodes removed by a reload are checked for having drained "
                               "(dropped then; health.drain_timeout_s bounds the wait) (ours)",
    )


class StateConfig(_Model):
    """Routing state kept across restarts (states, ramps, ejection back-offs, drains)."""

    path: str | None = Field(
        None, description="state file, written atomically; None: nothing is kept across restarts",
    )
    write_interval_s: float = Field(
        5.0, gt=0, description="the state file is written at most once per this while state changes, "
                               "and on shutdown (ours)",
    )
    max_age_s: float = Field(
        120.0, ge=0, description="a state file older than this is ignored at start (ours: a node's "
                                 "agent may have changed a lot in two minutes; heartbeats re-confirm "
                                 "within 300 ms either way)",
    )


class SentinelConfig(_Model):
    """The whole control-plane configuration file."""

    xds: XdsConfig = XdsConfig()
    admin: AdminConfig = AdminConfig()
    health: HealthConfig = HealthConfig()
    probe: ProbeConfig = ProbeConfig()
    reload: ReloadConfig = ReloadConfig()
    state: StateConfig = StateConfig()
    clusters: list[ClusterConfig] = Field(..., min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "SentinelConfig":
        names: set[str] = set()
        node_ids: set[str] = set()
        for c in self.clusters:
            if c.name in names:
                raise ValueError(f"duplicate cluster name {c.name!r}")
            names.add(c.name)
            for n in c.nodes:
                if n.id in node_ids:
                    raise ValueError(f"node id {n.id!r} appears in more than one cluster")
                node_ids.add(n.id)
        return self

    def nodes(self) -> list[tuple[str, NodeConfig]]:
        """All nodes as ``(cluster_name, node)`` pairs, in file order."""
        return [(c.name, n) for c in self.clusters for n in c.nodes]


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        lines.append(f"{loc}: {msg}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def parse_config(data: Any) -> SentinelConfig:
    """Validate an already-parsed YAML document. Raises ConfigError naming field and reason."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid configuration: top level must be a mapping, got {type(data).__name__}")
    try:
        return SentinelConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def load_config(path: str | Path) -> SentinelConfig:
    """Read and validate a YAML config file.

    Raises ConfigError when the file cannot be read, is not valid YAML (with line/column), or
    fails validation (each error names the dotted field path and the reason).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {p} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    return parse_config(data)
