"""``probe:`` section: the control plane's probe streams to the node_probe agents."""
from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from xds_server.config.base import _check_hostport, _Model, parse_hostport
from xds_server.config.duration import Duration, NonNegativeDuration, PositiveDuration, at_least, at_most
from xds_server.config.renames import Moves, _Renaming

__all__ = ["ProbeChannelConfig", "ProbeConfig", "ProbeDialInConfig", "ProbeLimitsConfig", "ProbeLogsConfig",
           "ProbeStallsConfig", "ProbeTransportConfig"]



class ProbeChannelConfig(_Model):
    """The gRPC channel to each agent: keepalive, reconnect, the stream's own silence."""

    ADVANCED: ClassVar[frozenset[str]] = frozenset({"initial_backoff", "max_unanswered_pings", "silent_stream_redial"})

    keepalive_time: Annotated[PositiveDuration, at_least("100ms")] = Field(
        Duration.parse("1s"),
        description="HTTP/2 keepalive ping interval on the probe channel (ours: a dead TCP path is "
        "noticed within ~2 s even if no heartbeat is due; heartbeats catch it sooner anyway)",
    )
    keepalive_timeout: Annotated[PositiveDuration, at_least("100ms")] = Field(
        Duration.parse("1s"),
        description="keepalive ping ack deadline (ours). gRPC 1.85 closes a connection on it only with "
        "grpc.http2.ping_timeout_ms, deliberately not set here: after a stall of our own (SIGSTOP, VM "
        "pause) the ping sent before it would cut every probe stream as we wake (the fault matrix's "
        "control-plane SIGSTOP then ejected a node); a silent stream is closed by "
        "channel.silent_stream_redial instead, which knows about our stalls")
    initial_backoff: Annotated[PositiveDuration, at_least("1ms")] = Field(
        Duration.parse("100ms"),
        description="gRPC channel's own first reconnect backoff (gRPC's default is 1 s: too slow "
        "for a node whose agent restarts); the channel's cap is health.heartbeat.reconnect_backoff_max",
    )
    silent_stream_redial: PositiveDuration = Field(
        Duration.parse("2s"),
        description="a probe stream open but without a heartbeat for this long is closed and "
        "redialled (ours: 20 heartbeat intervals; the heartbeat rules eject the node long before)",
    )
    max_unanswered_pings: int = Field(
        64, ge=1, le=65_536, description="outstanding RTT pings remembered per stream (ours)",
    )


class ProbeTransportConfig(_Model):
    """``liveness: transport``: liveness from HTTP/2 PINGs inside gRPC's C core."""

    keepalive_time: Annotated[PositiveDuration, at_least("10ms"), at_most("60s")] = Field(
        Duration.parse("100ms"),
        description="transport liveness: HTTP/2 keepalive PING interval asked of the probe channel (ms; "
        "ours, 100). gRPC 1.85's client sends at most one PING per second on a connection with "
        "streams whatever this says (chttp2 NextAllowedPingInterval), so a frozen peer fails its "
        "stream 0.1-1.1 s after the freeze (docs/DESIGN.md section 3, benchmarks/transport_liveness.py)",
    )
    ping_timeout: Annotated[PositiveDuration, at_least("10ms"), at_most("60s")] = Field(
        Duration.parse("100ms"),
        description="transport liveness: a PING not answered within this fails the connection "
        "(set as grpc.keepalive_timeout_ms and grpc.http2.ping_timeout_ms, which gRPC 1.85 needs to "
        "enforce it). A stall of our own that outlasts it cuts every stream as we wake: the "
        "stall hold (stalls.stall_hold) keeps that from being a verdict; docs/DESIGN.md section 3",
    )
    telemetry_refresh: Annotated[PositiveDuration, at_least("100ms"), at_most("60s")] = Field(
        Duration.parse("1s"),
        description="transport liveness: unchanged telemetry is re-sent by the agent at most this "
        "often (ours, 1 s: GPU readings are polled each 1 s). Changes (stall flag, "
        "GPU fault, engine state) and probe results are sent at once",
    )


class ProbeDialInConfig(_Model):
    """Agents that dial in (``ProbeHub.Connect``, nodes without ``probe_address``): the control
    plane is the gRPC server and judges each agent's liveness from its own HTTP/2 PINGs."""

    ADVANCED: ClassVar[frozenset[str]] = frozenset({"register_timeout", "burst_min", "burst_share", "burst_window",
                                                    "burst_recovery", "accept_backlog", "accept_wait"})

    listen: str | None = Field(
        None,
        description="HOST:PORT agents dial; unset: the xDS port (xds.listen), beside ADS and LRS, "
        "with the same TLS. The keepalive below is a server-wide setting of gRPC: on the shared "
        "port Envoy's ADS connections are pinged as often (measured: Envoy answers, "
        "benchmarks/RESULTS.md 'Agents dial in'); a port of its own keeps xds.keepalive for them",
    )
    keepalive: Annotated[PositiveDuration, at_least("10ms"), at_most("60s")] = Field(
        Duration.parse("90ms"),
        description="HTTP/2 keepalive PING interval to every agent connection (grpc.keepalive_time_ms "
        "of the server; a gRPC server has no 1 s floor, a client has). Measured on grpcio 1.85: with "
        "ping_timeout 100 ms a frozen agent's stream ends after median 151 ms, p99 203 ms; the "
        "PINGs cost no Python time (benchmarks/server_keepalive.py)",
    )
    ping_timeout: Annotated[PositiveDuration, at_least("10ms"), at_most("60s")] = Field(
        Duration.parse("60ms"),
        description="a PING not answered within this ends the connection (grpc.http2.ping_timeout_ms: "
        "without it gRPC 1.85 waits 60 s). A stall of our own longer than this ends streams as we "
        "wake: the stall hold (stalls.stall_hold) keeps that from being a verdict on the nodes. "
        "Ours: keepalive + ping_timeout + drop_confirm + reading, judging and publishing (~8 ms) is "
        "the worst case of a host freeze: 90 + 60 + 15 + 8 = 173 ms, where 80 ms left a 2,000-node "
        "control plane's loop nothing under the 200 ms target (benchmarks/RESULTS.md 'A 60 ms PING "
        "deadline'). An agent answers PINGs in its gRPC C core: a live one is late when the round "
        "trip or its host's scheduling of that thread takes this long (no CPU limit on the agent: CFS "
        "throttling stalls for up to its 100 ms period). On the shared xDS port Envoy's ADS "
        "connections get the same deadline",
    )
    drop_confirm: Annotated[NonNegativeDuration, at_most("1s")] = Field(
        Duration.parse("15ms"),
        description="a stream whose transport ended under us is judged this much later: an agent that "
        "dialled again meanwhile is alive (our starved process dropped it), and a drop that is one "
        "of a burst (burst_min, burst_share within burst_window) is ours. Ours: a live agent "
        "re-dials on loopback or a LAN within a few ms; 0 = judge at once",
    )
    burst_min: int = Field(3, ge=2, le=100_000,
                           description="drops (or streams silent for 1.5 telemetry refreshes) that make a burst, "
                           "at least (ours)")
    burst_share: float = Field(
        0.1, ge=0.0, le=1.0,
        description="share of the open agent streams that must drop within burst_window (or be silent 1.5 "
        "telemetry refreshes) for a burst "
        "(ours: one rack losing power is a few % of a fleet; our own stall drops most streams)")
    burst_window: Annotated[PositiveDuration, at_most("10s")] = Field(
        Duration.parse("200ms"),
        description="drops this close to each other count together (ours: two ping timeouts apart)")
    burst_recovery: Annotated[PositiveDuration, at_most("10m")] = Field(
        Duration.parse("30s"),
        description="after a burst of drops or silences judged ours, agents dialling in (back after a "
        "lost stream, or for the first time: a fleet still dialling a started control plane; at least "
        "burst_min within stalls.stall_hold) hold the nodes not heard since again, "
        "and a drop found within a hold after a stall noted for a burst is ours too, for at most this "
        "long after such verdicts began (each within keepalive + ping_timeout + stall_hold of the "
        "last): verdicts that hold each other up end then. Ours: a control plane stopped 5 s with 1,000 agents had "
        "407 streams cut and took 4.9 s to take them all back; a hold of stall_hold alone ejected 261 "
        "healthy nodes (benchmarks/RESULTS.md). 2,000 agents on two loaded cores took 30-90 s to dial in")
    accept_backlog: int = Field(
        20_000, ge=1_000, le=1_000_000,
        description="new streams gRPC holds while our loop has not taken them yet, before it refuses "
        "more (grpc.server.max_pending_requests and its hard limit: gRPC's defaults 1,000 and 3,000, "
        "refused at random between them with RESOURCE_EXHAUSTED). Ours: 2,000 agents dialling a "
        "(re)started control plane at once were refused by the hundreds, dialled again and kept it "
        "starved (benchmarks/RESULTS.md); a stream waiting costs a few KB, a refused one a new "
        "connection",
    )
    accept_wait: Annotated[PositiveDuration, at_least("1s"), at_most("1h")] = Field(
        Duration.parse("5m"),
        description="how long gRPC holds a new stream our loop has not taken yet before it cancels it "
        "(grpc.server_max_unrequested_time_in_server, whole seconds, rounded up; gRPC's default 30 s). "
        "Ours: a control plane took 2,000 simulated agents' streams in 40-55 s on two loaded cores "
        "(~40-50 a second); at 30 s gRPC cancelled the rest, each dialled again at the back of the "
        "queue (benchmarks/RESULTS.md 'Streams that wait to be taken'). 5 min covers ~12,000 agents "
        "at that rate; a waiting stream costs a few KB, and its connection is "
        "still PINGed, so a dead agent's stream goes with its connection",
    )
    register_timeout: Annotated[PositiveDuration, at_most("60s")] = Field(
        Duration.parse("5s"),
        description="an agent's stream must bring its Register within this, else it is ended "
        "(ours: a connect is ms; bounds streams held open by a client that says nothing)",
    )

    @field_validator("listen")
    @classmethod
    def _v_listen(cls, v: str | None) -> str | None:
        return None if v is None else _check_hostport(v)


class ProbeLimitsConfig(_Model):
    """What an agent message may carry before it is clipped or refused (protection limits)."""

    ADVANCED: ClassVar[frozenset[str]] = frozenset({
        "max_text_chars", "max_gpus", "max_list_items", "max_ttft", "max_requests"})

    max_text_chars: int = Field(
        256, ge=16, le=65_536,
        description="agent strings (stall_detail, error texts, kv_cache_metric) are clipped to this "
        "before they reach reasons, events, logs or ProbeNow (ours)",
    )
    max_gpus: int = Field(64, ge=1, le=4096, description="GPU readings per heartbeat kept (ours: 8-16 per host)")
    max_list_items: int = Field(
        64, ge=1, le=4096, description="xid_events and errors kept per GPU reading (ours)",
    )
    max_ttft: PositiveDuration = Field(
        Duration.parse("10s"),
        description="a successful probe's TTFT above this is rejected as nonsense, never fed to the "
        "TTFT EWMA (ours: 12.5 x health.probes.ttft_timeout; an agent gives up at its probe timeout, "
        "and one absurd value would keep a node an outlier for minutes)",
    )
    max_requests: float = Field(
        1e9, gt=0, description="requests_waiting/running above this are rejected as nonsense (ours)",
    )


class ProbeLogsConfig(_Model):
    """How often repeated agent problems are logged."""

    ADVANCED: ClassVar[frozenset[str]] = frozenset({"malformed_interval", "unreachable_interval"})

    malformed_interval: NonNegativeDuration = Field(
        Duration.parse("10s"), description="a kind of malformed agent message is logged at most once per this (ours)",
    )
    unreachable_interval: NonNegativeDuration = Field(
        Duration.parse("60s"),
        description="an agent that cannot be reached is logged when it first fails, then at most once "
        "per this while it stays unreachable (with the count of failed dials); /nodes shows it at once (ours)",
    )


class ProbeStallsConfig(_Model):
    """Our own event loop's stalls: noticed, and never a verdict on a node."""

    ADVANCED: ClassVar[frozenset[str]] = frozenset({"lag_recheck", "stall_hold", "loop_watch_interval"})

    lag_recheck: Annotated[PositiveDuration, at_most("1s")] = Field(
        Duration.parse("5ms"),
        description="a detection timer that fired late (health.heartbeat.self_lag_tolerance) is re-run this "
        "much later, once, so heartbeats already waiting are read first; after a stall of our own as "
        "long as a heartbeat miss window (interval + grace) or longer, one miss window later instead "
        "(ours; the fault matrix's control-plane SIGSTOP)",
    )
    stall_hold: Annotated[PositiveDuration, at_most("60s")] = Field(
        Duration.parse("1s"),
        description="after a stall of our own event loop at least one heartbeat miss window long (a "
        "SIGSTOP, a VM pause, a long GC; and after a burst of agent streams dropped or silent at once, "
        "counted as a stall this long), no verdict on a node's silence (misses, a closed or silent "
        "stream) is made until its first heartbeat after we woke, or for as long as the stall lasted "
        "but at most this long, whichever comes first (ours: a stream cut during a long stall is "
        "redialled after health.heartbeat.reconnect_backoff_initial, 100 ms, and heartbeats within one "
        "interval, 100 ms; heartbeats that waited unread took 200 ms to be read on a loaded 2-core "
        "host; a node that died during our stall is ejected at most this late; xds_server/probing/stall_hold.py)",
    )
    loop_watch_interval: Annotated[PositiveDuration, at_most("1s")] = Field(
        Duration.parse("50ms"),
        description="how often the event loop is sampled to notice its own stalls (ours: well under a "
        "heartbeat miss window, 180 ms; 20 wake-ups a second per process). Read when a process's "
        "first probe stream starts",
    )


class ProbeConfig(_Renaming):
    """The probe stream to each node_probe agent (gRPC client side) and what it accepts."""

    WHERE: ClassVar[str] = "probe"
    MOVED: ClassVar[Moves] = {
        "keepalive_time_ms": ("channel.keepalive_time", "ms"),
        "keepalive_timeout_ms": ("channel.keepalive_timeout", "ms"),
        "channel_initial_backoff_ms": ("channel.initial_backoff", "ms"),
        "silent_stream_redial_ms": ("channel.silent_stream_redial", "ms"),
        "max_unanswered_pings": ("channel.max_unanswered_pings", ""),
        "transport_keepalive_time_ms": ("transport.keepalive_time", "ms"),
        "transport_ping_timeout_ms": ("transport.ping_timeout", "ms"),
        "telemetry_refresh_ms": ("transport.telemetry_refresh", "ms"),
        "max_text_chars": ("limits.max_text_chars", ""),
        "max_gpus": ("limits.max_gpus", ""),
        "max_list_items": ("limits.max_list_items", ""),
        "max_ttft_ms": ("limits.max_ttft", "ms"),
        "max_requests": ("limits.max_requests", ""),
        "malformed_log_interval_s": ("logs.malformed_interval", "s"),
        "unreachable_log_interval_s": ("logs.unreachable_interval", "s"),
        "lag_recheck_ms": ("stalls.lag_recheck", "ms"),
        "stall_hold_ms": ("stalls.stall_hold", "ms"),
        "loop_watch_interval_ms": ("stalls.loop_watch_interval", "ms"),
        "worker_restart_grace_ms": ("worker_restart_grace", "ms"),
        "worker_report_interval_ms": ("worker_report_interval", "ms"),
    }
    ADVANCED: ClassVar[frozenset[str]] = frozenset({"worker_report_interval", "worker_restart_grace"})

    liveness: Literal["heartbeat", "transport"] = Field(
        "heartbeat",
        description="how a node's liveness is judged (docs/DESIGN.md section 3): "
        "'heartbeat' = the agent's 100 ms heartbeats (arrival gaps: phi accrual, misses); 'transport' = "
        "HTTP/2 keepalive PINGs every transport.keepalive_time answered within "
        "transport.ping_timeout (inside gRPC's C core), the agent sending telemetry only on change "
        "and every transport.telemetry_refresh. Asked per stream in Hello; an agent that does not echo it "
        "(an older one) is judged by heartbeats. Default heartbeat: transport halves the control "
        "plane's CPU per node but detects a freeze only within ~1.1 s (p99), against <= 240 ms; "
        "benchmarks/RESULTS.md 'Liveness by transport'",
    )
    workers: Literal["auto"] | Annotated[int, Field(ge=0, le=1024)] = Field(
        0,
        description="probe worker processes that hold the agents' streams and run the per-node "
        "detector (docs/DESIGN.md section 12): 0 = in this "
        "process (ours: today's path); N >= 1 = N worker processes, nodes assigned by a hash of "
        "their id; auto = CPU count - 1, at least 1 (one core left to health, policy and xDS). "
        "Agents that dial in are accepted by the workers only on a port of their own "
        "(dial_in.listen, bound by every worker with SO_REUSEPORT; a node then belongs to the "
        "worker its agent's stream reached); on the xDS port this process holds them. "
        "A change needs a restart",
    )
    worker_restart_grace: Annotated[PositiveDuration, at_most("60s")] = Field(
        Duration.parse("3s"),
        description="after a probe worker is replaced, its nodes' silence counts only from this "
        "long after the new worker took them over (after its start-up) (ours: covers a re-dial, "
        "ms, and the first heartbeat, 100 ms, ten times over on a slow host; a node that died "
        "meanwhile is ejected this much later, once per worker crash; docs/DESIGN.md section 12)",
    )
    worker_report_interval: Annotated[PositiveDuration, at_most("60s")] = Field(
        Duration.parse("1s"),
        description="a probe worker sends telemetry-only changes (load, RTT, GPU memory, heartbeat "
        "counts) at most this often; state changes, ejections and fail-static inputs go at once "
        "(ours: /nodes is at most this stale, decisions never)",
    )
    dial_in: ProbeDialInConfig = Field(default_factory=ProbeDialInConfig,
                                       description="agents that dial the control plane")
    channel: ProbeChannelConfig = Field(default_factory=ProbeChannelConfig, description="the gRPC channel")
    transport: ProbeTransportConfig = Field(default_factory=ProbeTransportConfig,
                                            description="liveness from HTTP/2 PINGs")
    limits: ProbeLimitsConfig = Field(default_factory=ProbeLimitsConfig, description="protection limits")
    logs: ProbeLogsConfig = Field(default_factory=ProbeLogsConfig, description="log rate of agent problems")
    stalls: ProbeStallsConfig = Field(default_factory=ProbeStallsConfig, description="our own stalls")

    @model_validator(mode="after")
    def _workers_port(self) -> ProbeConfig:
        listen = self.dial_in.listen
        if self.workers != 0 and listen is not None and parse_hostport(listen)[1] == 0:
            raise ValueError(f"dial_in.listen {listen}: port 0 with workers {self.workers!r} would give each "
                             "probe worker a port of its own; name the port the agents dial")
        return self

    def channel_options(self, max_backoff_ms: float) -> list[tuple[str, int]]:
        """The gRPC channel options of a probe stream: keepalive, and reconnect backoff from
        ``channel.initial_backoff`` up to ``max_backoff_ms`` (``health.heartbeat.reconnect_backoff_max``).
        With ``liveness`` transport the keepalive is the transport's PINGs, their deadline enforced."""
        t, c = self.transport, self.channel
        if self.liveness == "transport":
            keepalive = [("grpc.keepalive_time_ms", round(t.keepalive_time.ms)),
                         ("grpc.keepalive_timeout_ms", round(t.ping_timeout.ms)),
                         ("grpc.http2.ping_timeout_ms", round(t.ping_timeout.ms))]
        else:
            keepalive = [("grpc.keepalive_time_ms", round(c.keepalive_time.ms)),
                         ("grpc.keepalive_timeout_ms", round(c.keepalive_timeout.ms))]
        return [
            *keepalive,
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", round(c.initial_backoff.ms)),
            ("grpc.max_reconnect_backoff_ms", int(max_backoff_ms)),
        ]

    def dial_in_options(self) -> list[tuple[str, int]]:
        """The gRPC server options of the port agents dial: PINGs every ``dial_in.keepalive`` with or
        without streams, each answered within ``dial_in.ping_timeout``, and ``dial_in.accept_backlog``
        streams held, for up to ``dial_in.accept_wait``, before any is refused."""
        d = self.dial_in
        return [("grpc.server.max_pending_requests", d.accept_backlog),
                ("grpc.server.max_pending_requests_hard_limit", d.accept_backlog),
                ("grpc.server_max_unrequested_time_in_server", math.ceil(d.accept_wait.s)),
                ("grpc.keepalive_time_ms", round(d.keepalive.ms)),
                ("grpc.keepalive_timeout_ms", round(d.ping_timeout.ms)),
                ("grpc.http2.ping_timeout_ms", round(d.ping_timeout.ms)),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0)]

    def worker_count(self, cpu_count: int | None) -> int:
        """Worker processes to run: ``workers``, or for "auto" ``cpu_count`` - 1, at least 1
        (``cpu_count`` None, unknown, counts as 1). 0 = probe streams in this process."""
        if self.workers == "auto":
            return max(1, (cpu_count or 1) - 1)
        return self.workers
