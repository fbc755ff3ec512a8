"""``xds:`` section: the ADS gRPC server, its bounds and its fail-static history."""
from __future__ import annotations

import socket
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from xds_server.config.base import _check_hostport, _Model
from xds_server.config.duration import Duration, NonNegativeDuration, PositiveDuration, at_least, at_most
from xds_server.config.renames import Moves, _Renaming

__all__ = ["XdsConfig", "XdsKeepaliveConfig", "XdsLimitsConfig", "XdsPublishConfig"]



def _hostname() -> str:
    """The host's name, reduced to the characters a replica id allows ("sentinel" if none)."""
    name = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in socket.gethostname())[:64]
    return name or "sentinel"


class XdsPublishConfig(_Model):
    """When assignments are published: the start-up hold, coalescing, the fail-static history."""

    ADVANCED: ClassVar[frozenset[str]] = frozenset({"build_ratio", "fail_static_history_max"})

    warmup_timeout: NonNegativeDuration = Field(
        Duration.parse("5s"),
        description="after start, hold a cluster's assignment until every node has left COLD or "
        "this long has passed, so a restart never publishes 'everything unhealthy' (docs/DESIGN.md section 6)",
    )
    coalesce_window: Annotated[NonNegativeDuration, at_most("1s")] = Field(
        Duration.parse("5ms"),
        description="at most one publish per window: a change after a quiet window is published "
        "at once; changes arriving within the window after a publish are coalesced into one push "
        "(one build and encode per cluster, one response per stream) at its end. 0 = changes in "
        "one event-loop iteration only. Ours: a few ms is far below a heartbeat interval (100 ms) "
        "and turns a burst (a rack losing power) into two updates instead of one per node",
    )
    build_ratio: float = Field(
        3.0, ge=0, le=100,
        description="during a burst of changes, publish at most every (this x the last publish's "
        "build time) when that is longer than coalesce_window, so publishing a large cluster "
        "takes at most 1/(1 + ratio) of the event loop (3: 25 %). A 1,000-endpoint cluster takes "
        "~15-25 ms to build: at the 5 ms window a fleet starting up rebuilt it back to back and "
        "starved the heartbeats (benchmarks/RESULTS.md). An isolated change after "
        "a quiet gap is still published at once, and a node leaving routing on hard evidence after "
        "coalesce_window alone, at most every other publish (2,000 endpoints build in ~45 ms: the gap "
        "kept a frozen node routed up to ~135 ms past its verdict), as the last assignment with "
        "the node out, the full decision one gap later. 0 = the window alone",
    )
    measure_refresh: Annotated[NonNegativeDuration, at_most("60s")] = Field(
        Duration.parse("1s"),
        description="a change of a node's measures alone (EWMA RTT or TTFT, GPU free memory: its "
        "weight and outlier judgement, not its state or routing) is published at most this long after "
        "the last publish, with whatever else changed by then. Ours: at 2,000 nodes with 1 s RTT pings "
        "these changed ~1,000 nodes' routing keys a second and kept the cluster publishing back to "
        "back (benchmarks/RESULTS.md); weights need not move faster than a second. 0 = as any change",
    )
    fail_static_history_max: int = Field(
        1024, ge=2, le=1_000_000,
        description="assignments per cluster kept to find the last good one when fail-static "
        "begins; only those that can still be the answer are kept, this caps the rest (ours: "
        "a burst coalesced at 5 ms publishes 200 assignments per second)",
    )


class XdsKeepaliveConfig(_Model):
    """HTTP/2 keepalive and connection age on the xDS port."""

    ADVANCED: ClassVar[frozenset[str]] = frozenset({"min_client_ping_interval"})

    time: Annotated[PositiveDuration, at_least("1s")] = Field(
        Duration.parse("30s"),
        description="HTTP/2 keepalive ping interval of our pings to the clients on the xDS port "
        "(checklist 1.9 item 28): the stream of a frozen or vanished Envoy is closed within this "
        "+ timeout. Envoy's own pings to us, which move it off a frozen replica, are "
        "the bootstrap's (1 s)",
    )
    timeout: Annotated[PositiveDuration, at_least("100ms")] = Field(
        Duration.parse("5s"),
        description="keepalive ping ack deadline; set as gRPC's grpc.http2.ping_timeout_ms too, without "
        "which gRPC 1.85 does not close a connection whose peer stopped answering pings")
    min_client_ping_interval: NonNegativeDuration = Field(
        Duration.parse("500ms"),
        description="HTTP/2 pings from a client without data in flight closer than this are a "
        "protocol violation (gRPC's grpc.http2.min_ping_interval_without_data_ms; its default 5 min "
        "would end the stream of an Envoy pinging every 1 s, as the bootstrap's xds_cluster "
        "keepalive does; ours: half of that 1 s)",
    )
    max_connection_age: NonNegativeDuration = Field(
        Duration.parse("0s"),
        description="close each client connection on the xDS port (Envoy's ADS/EDS, the relay's "
        "feed) after this many seconds (+- 10 % jitter; gRPC's grpc.max_connection_age_ms), so "
        "every client reconnects within it: a client certificate rotated through SDS is presented "
        "and an allow-list change is applied at the reconnect (an open connection keeps the "
        "certificate it was opened with), and Envoys spread over replicas again after a failover. "
        "The reconnect changes nothing in Envoy (same content, same versions). 0 = never. Ours; "
        "Istio's control plane uses 30 min for the same reasons",
    )
    max_connection_age_grace: NonNegativeDuration = Field(
        Duration.parse("1s"),
        description="after max_connection_age, how long open streams may continue before the "
        "connection is closed (gRPC's grpc.max_connection_age_grace_ms). An ADS stream never ends "
        "by itself, so this only lets a response being written finish. Ours",
    )


class XdsLimitsConfig(_Model):
    """What one client may make the server parse, hold and send: protection limits that rarely
    need changing."""

    ADVANCED: ClassVar[frozenset[str]] = frozenset({
        "absent_names_max_per_stream", "client_text_max_chars", "clients_view_max_names", "max_names_per_stream",
        "max_receive_message_bytes", "max_tracked_nonces", "max_types_per_stream", "memo_max_bytes",
        "memo_max_entries", "nack_message_max_chars", "request_burst_bytes", "request_bytes_per_s",
        "request_cost_min_bytes"})

    max_receive_message_bytes: int = Field(
        16 * 1024 * 1024, ge=4 * 1024 * 1024,
        description="largest ADS request accepted (gRPC answers RESOURCE_EXHAUSTED above it). "
        "A delta reconnect echoes every name+version and a SotW EDS request names every cluster: "
        "gRPC's 4 MiB default is too small (docs/xds_protocol.md section 5 item 7); 16 MiB holds "
        "~200,000 names of 64 characters with versions (150,000 long names are ~6.3 MB) while "
        "bounding what one message can make the server parse and hold (was 64 MiB)",
    )
    max_tracked_nonces: int = Field(
        16, ge=1, le=1024,
        description="delta: un-ACKed nonces remembered per stream and type (to report which "
        "version an ACK or NACK refers to); older ones count as stale",
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
        "far shorter. Ours (unclipped, 64 KB node ids grew /metrics and /xds/clients to 19.7 MB)",
    )
    nack_message_max_chars: int = Field(
        1024, ge=16,
        description="a NACK's error_detail.message as kept for /xds/clients and logged; Envoy's "
        "messages name the field and the reason in a few hundred characters",
    )
    absent_names_max_per_stream: int = Field(
        1000, ge=0,
        description="SotW EDS names that exist nowhere answered with an empty assignment, per stream "
        "and type (Envoy would otherwise wait on them); names beyond get no answer, so a "
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
        "leave behind (an unbounded memo held 529 MB after 200 closed streams)",
    )
    request_bytes_per_s: int = Field(
        1024 * 1024, ge=1024,
        description="per-stream request budget, sustained: bytes of requests per second a stream "
        "may send before the server stops reading it for a while (HTTP/2 flow control then holds "
        "the client back). An Envoy sends a few small ACKs per update; ours: one stream flooding "
        "1.7 MB requests slowed every other stream's EDS delivery 60x",
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


class XdsConfig(_Renaming):
    """The ADS gRPC server."""

    WHERE: ClassVar[str] = "xds"
    MOVED: ClassVar[Moves] = {
        "warmup_timeout_ms": ("publish.warmup_timeout", "ms"),
        "coalesce_window_ms": ("publish.coalesce_window", "ms"),
        "publish_build_ratio": ("publish.build_ratio", ""),
        "fail_static_history_max": ("publish.fail_static_history_max", ""),
        "keepalive_time_ms": ("keepalive.time", "ms"),
        "keepalive_timeout_ms": ("keepalive.timeout", "ms"),
        "min_client_ping_interval_ms": ("keepalive.min_client_ping_interval", "ms"),
        "max_connection_age_s": ("keepalive.max_connection_age", "s"),
        "max_connection_age_grace_s": ("keepalive.max_connection_age_grace", "s"),
        "max_receive_message_bytes": ("limits.max_receive_message_bytes", ""),
        "max_tracked_nonces": ("limits.max_tracked_nonces", ""),
        "max_types_per_stream": ("limits.max_types_per_stream", ""),
        "max_names_per_stream": ("limits.max_names_per_stream", ""),
        "client_text_max_chars": ("limits.client_text_max_chars", ""),
        "nack_message_max_chars": ("limits.nack_message_max_chars", ""),
        "absent_names_max_per_stream": ("limits.absent_names_max_per_stream", ""),
        "clients_view_max_names": ("limits.clients_view_max_names", ""),
        "memo_max_entries": ("limits.memo_max_entries", ""),
        "memo_max_bytes": ("limits.memo_max_bytes", ""),
        "request_bytes_per_s": ("limits.request_bytes_per_s", ""),
        "request_burst_bytes": ("limits.request_burst_bytes", ""),
        "request_cost_min_bytes": ("limits.request_cost_min_bytes", ""),
    }

    listen: str = Field("127.0.0.1:18000", description="HOST:PORT of the ADS gRPC server")
    replica_id: str = Field(
        default_factory=_hostname, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$",
        description="this process's own name among replicas (default: the hostname, a pod name "
        "under Kubernetes): in log lines (`replica` field), /metrics (`sentinel_replica_info`), "
        "/healthz and /xds/clients, and the control_plane_id agents see. Never part of a version: "
        "versions are content hashes, so two replicas with the same state publish the same "
        "versions (docs/replicas.md: Running two replicas)",
    )
    server_id: str | None = Field(
        None, description="deprecated and ignored: it prefixed every version, so replicas "
        "published different versions for the same state; versions are content hashes now. "
        "Name a replica with replica_id",
    )
    ramp_anchor: Literal["wall_clock", "local"] = Field(
        "wall_clock",
        description="when PROBATION ramp steps happen. wall_clock: on multiples of "
        "health.probation.ramp_step of the Unix clock, so replicas with synchronized clocks (NTP: ms) "
        "step together and publish the same weights; local: ramp_step after this process saw "
        "the node enter PROBATION (each replica on its own schedule)",
    )
    publish: XdsPublishConfig = Field(default_factory=XdsPublishConfig, description="when assignments are published")
    keepalive: XdsKeepaliveConfig = Field(default_factory=XdsKeepaliveConfig,
                                          description="HTTP/2 keepalive and connection age")
    limits: XdsLimitsConfig = Field(default_factory=XdsLimitsConfig, description="protection limits")

    _v_listen = field_validator("listen")(_check_hostport)

    def grpc_server_options(self) -> list[tuple[str, int]]:
        """The xDS port's gRPC server options from these fields (message size, keepalive, ping
        policy, connection age)."""
        ka = self.keepalive
        opts = [
            ("grpc.max_receive_message_length", self.limits.max_receive_message_bytes),
            ("grpc.keepalive_time_ms", round(ka.time.ms)),
            ("grpc.keepalive_timeout_ms", round(ka.timeout.ms)),
            ("grpc.http2.ping_timeout_ms", round(ka.timeout.ms)),
            ("grpc.http2.min_ping_interval_without_data_ms", round(ka.min_client_ping_interval.ms)),
            # grpc turns SO_REUSEPORT on by default: a second server on the same port would then
            # bind silently and share the connections. Off, it fails to start (as the agent does).
            ("grpc.so_reuseport", 0),
        ]
        if ka.max_connection_age.s > 0:
            opts += [("grpc.max_connection_age_ms", max(1, round(ka.max_connection_age.ms))),
                     ("grpc.max_connection_age_grace_ms", round(ka.max_connection_age_grace.ms))]
        return opts
