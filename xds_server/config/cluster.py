"""``clusters:`` section: clusters, their nodes, localities, outlier detection, drop overload."""
from __future__ import annotations

import ipaddress
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from xds_server.config.base import _Model, parse_hostport
from xds_server.config.discovery import DiscoveryConfig
from xds_server.config.duration import Duration, NonNegativeDuration
from xds_server.config.renames import Moves, _Renaming

__all__ = ["NODE_ID_PATTERN", "ClusterConfig", "DropOverloadConfig", "Locality", "NodeConfig",
           "OutlierDetectionConfig"]


NODE_ID_PATTERN = r"^[A-Za-z0-9_.:\-]{1,128}$"
"""A node id: 1..128 of A-Z a-z 0-9 _ . : - (an Envoy-safe stat name part; pod names fit)."""


class Locality(_Model):
    """Envoy locality of a node (region/zone/sub_zone)."""

    region: str = ""
    zone: str = ""
    sub_zone: str = ""


class NodeConfig(_Model):
    """One inference node: where Envoy sends traffic, and where its node_probe agent listens when
    the control plane dials it (``probe_address``, deprecated; unset: the agent dials in)."""

    id: str = Field(..., min_length=1, max_length=128, pattern=NODE_ID_PATTERN)
    address: str = Field(..., description="serving HOST:PORT Envoy routes to (IP literal)")
    probe_address: str | None = Field(
        None, description="HOST:PORT of the node's node_probe agent for the control plane to dial (gRPC). "
        "Deprecated: unset, the agent dials the control plane (node_probe --control-plane) and "
        "liveness comes from the server's own keepalive PINGs (probe.dial_in). Kept for one release",
    )
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
    def _v_probe(cls, v: str | None) -> str | None:
        if v is None:
            return None
        _, port = parse_hostport(v)
        if port == 0:
            raise ValueError("port 0 is not a probe port")
        return v


class OutlierDetectionConfig(_Renaming):
    """Envoy passive outlier detection served in the Cluster: a second line behind our probes and
    the fleet-wide traffic judgement (lrs.traffic_ejection), set so it cannot undo the latter:
    Envoy ejects a node on consecutive *gateway* failures (502/503/504 and connection failures:
    the node, not the request), while its 5xx and success-rate detectors, which a query of death
    trips on every node in turn, only count (docs/real-traffic.md)."""

    WHERE: ClassVar[str] = "clusters[].outlier_detection"
    MOVED: ClassVar[Moves] = {
        "interval_ms": ("interval", "ms"),
        "base_ejection_time_ms": ("base_ejection_time", "ms"),
    }

    enabled: bool = True
    consecutive_5xx: int = Field(5, ge=1, description="Envoy default 5")
    enforcing_consecutive_5xx: int = Field(
        0, ge=0, le=100, description="% of consecutive_5xx detections that eject (Envoy default 100). Ours: 0, "
        "counted only: a request that fails on every node (a query of death) would eject each in turn")
    consecutive_gateway_failure: int = Field(5, ge=1, description="Envoy default 5")
    enforcing_consecutive_gateway_failure: int = Field(
        100, ge=0, le=100, description="% of consecutive gateway-failure detections that eject (Envoy default "
        "0). Ours: 100: refused connections, resets and 502/503/504 are the node's, ejected at once")
    enforcing_success_rate: int = Field(
        0, ge=0, le=100, description="% of success-rate detections that eject (Envoy default 100). Ours: 0: "
        "the statistical judgement of lrs.traffic_ejection replaces it, fleet-wide")
    interval: NonNegativeDuration = Field(Duration.parse("1s"))
    base_ejection_time: NonNegativeDuration = Field(Duration.parse("10s"))
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


class ClusterConfig(_Renaming):
    """One Envoy cluster (CDS) and its nodes (EDS ClusterLoadAssignment)."""

    WHERE: ClassVar[str] = "clusters[]"
    MOVED: ClassVar[Moves] = {
        "update_merge_window_ms": ("update_merge_window", "ms"),
        "connect_timeout_ms": ("connect_timeout", "ms"),
    }

    name: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    lb_policy: Literal["LEAST_REQUEST", "ROUND_ROBIN"] = Field(
        "LEAST_REQUEST", description="RANDOM ignores endpoint weights, so it is not offered"
    )
    healthy_panic_threshold_percent: float = Field(
        0.0, ge=0, le=100,
        description="Envoy's default 50 % spreads traffic over dead nodes (fc04); default 0",
    )
    update_merge_window: NonNegativeDuration = Field(
        Duration.parse("0"), description="Envoy's default 1 s delays ejection inside Envoy; default 0"
    )
    connect_timeout: NonNegativeDuration = Field(Duration.parse("1s"))
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
    discovery: DiscoveryConfig | None = Field(
        None, description="more nodes found at run time (targets file, Kubernetes pods), merged with "
                          "``nodes``; see xds_server.discovery",
    )

    @model_validator(mode="after")
    def _unique_nodes(self) -> ClusterConfig:
        seen: set[str] = set()
        for n in self.nodes:
            if n.id in seen:
                raise ValueError(f"duplicate node id {n.id!r}")
            seen.add(n.id)
        prios = sorted({n.priority for n in self.nodes})
        if prios != list(range(len(prios))):
            raise ValueError(f"priorities must be contiguous from 0, got {prios}")
        return self
