"""Control-plane configuration: one YAML file -> validated pydantic models.

Every threshold lives here with its default and the source of that default (the seed articles in
``shared/seeds/`` and DESIGN.md section 4). Nothing else in the code base hard-codes them.

Errors: :func:`load_config` and :func:`parse_config` raise :class:`ConfigError`, whose message
names each offending field by its dotted path (``clusters.0.nodes.1.address``) and the reason.
"""
from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "AdminConfig",
    "ClusterConfig",
    "ConfigError",
    "HealthConfig",
    "Locality",
    "NodeConfig",
    "OutlierDetectionConfig",
    "SentinelConfig",
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
        "this long has passed, so a restart never publishes 'everything unhealthy' (DESIGN.md 6)",
    )
    max_receive_message_bytes: int = Field(
        64 * 1024 * 1024, ge=4 * 1024 * 1024,
        description="delta reconnects echo every name+version; 4 MiB default is too small "
        "(notes/xds_protocol.md section 5 item 7)",
    )

    _v_listen = field_validator("listen")(_check_hostport)


class AdminConfig(_Model):
    """The admin HTTP endpoint (aiohttp)."""

    listen: str = Field("127.0.0.1:19000", description="HOST:PORT of the admin HTTP server")
    token: str | None = Field(None, description="bearer token for POST drain/undrain; None = disabled")
    events_buffer: int = Field(1000, ge=10, description="events kept in the ring buffer")

    _v_listen = field_validator("listen")(_check_hostport)


class HealthConfig(_Model):
    """Thresholds of the health model. Defaults come from the seeds (DESIGN.md section 4)."""

    heartbeat_interval_ms: float = Field(100.0, gt=0, description="seed 000: 100 ms heartbeats")
    heartbeat_grace_ms: float = Field(
        80.0, ge=0, description="seed 000: a heartbeat not arrived within interval + 80 ms is a miss"
    )
    consecutive_misses: int = Field(3, ge=1, description="seed 000: 3 consecutive misses -> UNHEALTHY")
    ping_interval_ms: float = Field(1000.0, gt=0, description="RTT ping cadence (DESIGN.md section 3)")
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

    @model_validator(mode="after")
    def _ordered(self) -> "HealthConfig":
        if self.ttft_timeout_ms <= self.ttft_healthy_ms:
            raise ValueError("ttft_timeout_ms must be greater than ttft_healthy_ms")
        if self.reconnect_backoff_max_ms < self.reconnect_backoff_initial_ms:
            raise ValueError("reconnect_backoff_max_ms must be >= reconnect_backoff_initial_ms")
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
    outlier_detection: OutlierDetectionConfig = OutlierDetectionConfig()
    nodes: list[NodeConfig] = Field(..., min_length=1)

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


class SentinelConfig(_Model):
    """The whole control-plane configuration file."""

    xds: XdsConfig = XdsConfig()
    admin: AdminConfig = AdminConfig()
    health: HealthConfig = HealthConfig()
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
