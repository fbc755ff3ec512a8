"""``probe:`` section: the control plane's probe streams to the node_probe agents."""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from xds_server.config.base import _Model

__all__ = ["ProbeConfig"]


class ProbeConfig(_Model):
    """The probe stream to each node_probe agent (gRPC client side) and what it accepts."""

    #: Protection limits that rarely need changing (marked advanced in docs/config.md).
    ADVANCED: ClassVar[frozenset[str]] = frozenset({
        "channel_initial_backoff_ms", "lag_recheck_ms", "loop_watch_interval_ms", "malformed_log_interval_s",
        "max_gpus", "max_list_items", "max_requests", "max_text_chars", "max_ttft_ms", "max_unanswered_pings",
        "silent_stream_redial_ms", "stall_hold_ms", "unreachable_log_interval_s", "worker_report_interval_ms",
        "worker_restart_grace_ms"})

    keepalive_time_ms: int = Field(
        1000, ge=100,
        description="HTTP/2 keepalive ping interval on the probe channel (ours: a dead TCP path is "
        "noticed within ~2 s even if no heartbeat is due; heartbeats catch it sooner anyway)",
    )
    keepalive_timeout_ms: int = Field(
        1000, ge=100,
        description="keepalive ping ack deadline (ours). gRPC 1.85 closes a connection on it only with "
        "grpc.http2.ping_timeout_ms, deliberately not set here: after a stall of our own (SIGSTOP, VM "
        "pause) the ping sent before it would cut every probe stream as we wake (the fault matrix's "
        "control-plane SIGSTOP then ejected a node); a silent stream is closed by "
        "silent_stream_redial_ms instead, which knows about our stalls")
    liveness: Literal["heartbeat", "transport"] = Field(
        "heartbeat",
        description="how a node's liveness is judged (docs/DESIGN.md section 3): "
        "'heartbeat' = the agent's 100 ms heartbeats (arrival gaps: phi accrual, misses); 'transport' = "
        "HTTP/2 keepalive PINGs every transport_keepalive_time_ms answered within "
        "transport_ping_timeout_ms (inside gRPC's C core), the agent sending telemetry only on change "
        "and every telemetry_refresh_ms. Asked per stream in Hello; an agent that does not echo it "
        "(an older one) is judged by heartbeats. Default heartbeat: transport halves the control "
        "plane's CPU per node but detects a freeze only within ~1.1 s (p99), against <= 240 ms; "
        "benchmarks/RESULTS.md 'Liveness by transport'",
    )
    telemetry_refresh_ms: int = Field(
        1000, ge=100, le=60_000,
        description="transport liveness: unchanged telemetry is re-sent by the agent at most this "
        "often (ms; ours, 1 s: GPU readings are polled each 1 s). Changes (stall flag, "
        "GPU fault, engine state) and probe results are sent at once",
    )
    transport_keepalive_time_ms: int = Field(
        100, ge=10, le=60_000,
        description="transport liveness: HTTP/2 keepalive PING interval asked of the probe channel (ms; "
        "ours, 100). gRPC 1.85's client sends at most one PING per second on a connection with "
        "streams whatever this says (chttp2 NextAllowedPingInterval), so a frozen peer fails its "
        "stream 0.1-1.1 s after the freeze (docs/DESIGN.md section 3, benchmarks/transport_liveness.py)",
    )
    transport_ping_timeout_ms: int = Field(
        100, ge=10, le=60_000,
        description="transport liveness: a PING not answered within this (ms) fails the connection "
        "(set as grpc.keepalive_timeout_ms and grpc.http2.ping_timeout_ms, which gRPC 1.85 needs to "
        "enforce it). A stall of our own that outlasts it cuts every stream as we wake: the "
        "stall hold (stall_hold_ms) keeps that from being a verdict; docs/DESIGN.md section 3",
    )
    channel_initial_backoff_ms: int = Field(
        100, ge=1,
        description="gRPC channel's own first reconnect backoff (gRPC's default is 1 s: too slow "
        "for a node whose agent restarts); the channel's cap is health.heartbeat.reconnect_backoff_max",
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
        "TTFT EWMA (ours: 12.5 x health.probes.ttft_timeout; an agent gives up at its probe timeout, "
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
        description="a detection timer that fired late (health.heartbeat.self_lag_tolerance) is re-run this "
        "much later, once, so heartbeats already waiting are read first; after a stall of our own as "
        "long as a heartbeat miss window (interval + grace) or longer, one miss window later instead "
        "(ours; the fault matrix's control-plane SIGSTOP)",
    )
    stall_hold_ms: float = Field(
        1000.0, gt=0, le=60_000,
        description="after a stall of our own event loop at least one heartbeat miss window long (a "
        "SIGSTOP, a VM pause, a long GC), no verdict on a node's silence (misses, a closed or silent "
        "stream) is made until its first heartbeat after we woke, or for as long as the stall lasted "
        "but at most this long, whichever comes first (ours: a stream cut during a long stall is "
        "redialled after health.heartbeat.reconnect_backoff_initial, 100 ms, and heartbeats within one "
        "interval, 100 ms; heartbeats that waited unread took 200 ms to be read on a loaded 2-core "
        "host; a node that died during our stall is ejected at most this late; xds_server/probing/stall_hold.py)",
    )
    loop_watch_interval_ms: float = Field(
        50.0, gt=0, le=1000,
        description="how often the event loop is sampled to notice its own stalls (ours: well under a "
        "heartbeat miss window, 180 ms; 20 wake-ups a second per process). Read when a process's "
        "first probe stream starts",
    )
    workers: Literal["auto"] | Annotated[int, Field(ge=0, le=1024)] = Field(
        0,
        description="probe worker processes that hold the agents' streams and run the per-node "
        "detector (docs/DESIGN.md section 12): 0 = in this "
        "process (ours: today's path); N >= 1 = N worker processes, nodes assigned by a hash of "
        "their id; auto = CPU count - 1, at least 1 (one core left to health, policy and xDS). "
        "A change needs a restart",
    )
    worker_restart_grace_ms: float = Field(
        3000.0, gt=0, le=60_000,
        description="after a probe worker is replaced, its nodes' silence counts only from this "
        "long after the new worker took them over (after its start-up) (ours: covers a re-dial, "
        "ms, and the first heartbeat, 100 ms, ten times over on a slow host; a node that died "
        "meanwhile is ejected this much later, once per worker crash; docs/DESIGN.md section 12)",
    )
    worker_report_interval_ms: float = Field(
        1000.0, gt=0, le=60_000,
        description="a probe worker sends telemetry-only changes (load, RTT, GPU memory, heartbeat "
        "counts) at most this often; state changes, ejections and fail-static inputs go at once "
        "(ours: /nodes is at most this stale, decisions never)",
    )

    def channel_options(self, max_backoff_ms: float) -> list[tuple[str, int]]:
        """The gRPC channel options of a probe stream: keepalive, and reconnect backoff from
        ``channel_initial_backoff_ms`` up to ``max_backoff_ms`` (``health.heartbeat.reconnect_backoff_max``).
        With ``liveness`` transport the keepalive is the transport's PINGs, their deadline enforced."""
        if self.liveness == "transport":
            keepalive = [("grpc.keepalive_time_ms", self.transport_keepalive_time_ms),
                         ("grpc.keepalive_timeout_ms", self.transport_ping_timeout_ms),
                         ("grpc.http2.ping_timeout_ms", self.transport_ping_timeout_ms)]
        else:
            keepalive = [("grpc.keepalive_time_ms", self.keepalive_time_ms),
                         ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms)]
        return [
            *keepalive,
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", self.channel_initial_backoff_ms),
            ("grpc.max_reconnect_backoff_ms", int(max_backoff_ms)),
        ]

    def worker_count(self, cpu_count: int | None) -> int:
        """Worker processes to run: ``workers``, or for "auto" ``cpu_count`` - 1, at least 1
        (``cpu_count`` None, unknown, counts as 1). 0 = probe streams in this process."""
        if self.workers == "auto":
            return max(1, (cpu_count or 1) - 1)
        return self.workers
