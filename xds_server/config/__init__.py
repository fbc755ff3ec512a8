"""Control-plane configuration: one YAML file -> validated pydantic models.

Every threshold lives here with its default and the source of that default (the seed articles,
see docs/sources.md, and docs/DESIGN.md section 4). Nothing else in the code base hard-codes them.

Errors: :func:`load_config` and :func:`parse_config` raise :class:`ConfigError`, whose message
names each offending field by its dotted path (``clusters.0.nodes.1.address``) and the reason.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from xds_server.config.admin import AdminConfig
from xds_server.config.base import ConfigError, _Model, parse_hostport, yaml_problem
from xds_server.config.cluster import (
    ClusterConfig,
    DropOverloadConfig,
    Locality,
    NodeConfig,
    OutlierDetectionConfig,
)
from xds_server.config.discovery import (
    AgentsDiscoveryConfig,
    DiscoveryConfig,
    FileDiscoveryConfig,
    KubernetesDiscoveryConfig,
)
from xds_server.config.feed import FeedConfig, check_feed
from xds_server.config.health import HealthConfig
from xds_server.config.load import LrsConfig, TrafficEjectionConfig, check_lrs, lrs_notes
from xds_server.config.lrs_peers import PeerConfig
from xds_server.config.ops import ReloadConfig, StateConfig
from xds_server.config.probe import ProbeConfig
from xds_server.config.renames import moved_notes, rewrite_old_names
from xds_server.config.shed import ShedClassesConfig, ShedConfig, class_clusters
from xds_server.config.shift import ShiftConfig
from xds_server.config.tls import AgentTlsConfig, NodeAllowRule, TlsConfig, check_plaintext
from xds_server.config.xds import XdsConfig

__all__ = [
    "AdminConfig",
    "AgentTlsConfig",
    "AgentsDiscoveryConfig",
    "ClusterConfig",
    "ConfigError",
    "DiscoveryConfig",
    "DropOverloadConfig",
    "FeedConfig",
    "FileDiscoveryConfig",
    "HealthConfig",
    "KubernetesDiscoveryConfig",
    "Locality",
    "LrsConfig",
    "NodeAllowRule",
    "NodeConfig",
    "OutlierDetectionConfig",
    "PeerConfig",
    "ProbeConfig",
    "ReloadConfig",
    "SentinelConfig",
    "ShedClassesConfig",
    "ShedConfig",
    "ShiftConfig",
    "StateConfig",
    "TlsConfig",
    "TrafficEjectionConfig",
    "XdsConfig",
    "class_clusters",
    "load_config",
    "parse_config",
    "parse_hostport",
    "rewritten_yaml",
]



class SentinelConfig(_Model):
    """The whole control-plane configuration file."""

    xds: XdsConfig = XdsConfig()
    admin: AdminConfig = AdminConfig()
    health: HealthConfig = HealthConfig()
    probe: ProbeConfig = ProbeConfig()
    reload: ReloadConfig = ReloadConfig()
    state: StateConfig = StateConfig()
    tls: TlsConfig = TlsConfig()
    feed: FeedConfig = FeedConfig()
    lrs: LrsConfig = LrsConfig()
    shift: ShiftConfig = ShiftConfig()
    clusters: list[ClusterConfig] = Field(..., min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> SentinelConfig:
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
        for ci, c in enumerate(self.clusters):
            if c.discovery is not None and c.discovery.kubernetes is not None and self.tls.agents.mode is None:
                raise ValueError(f"clusters.{ci}.discovery.kubernetes: pods are dialled on their pod IPs, not "
                                 "loopback: set tls.agents.mode to mtls or tls (or plaintext, explicitly)")
        check_plaintext(self.tls, self.xds.listen,
                        [(f"clusters.{ci}.nodes.{ni}.probe_address", n.probe_address)
                         for ci, c in enumerate(self.clusters) for ni, n in enumerate(c.nodes)
                         if n.probe_address is not None])
        check_feed(self.feed, self.tls.mode)
        check_lrs(self.lrs, self.tls.mode)
        if self.health.validation.enabled and self.probe.workers != 0:
            raise ValueError("health.validation.enabled needs probe.workers: 0 (it runs in-process)")
        return self

    def notes(self) -> list[str]:
        """Lines an operator should read about this config (older forms, refusals it implies),
        printed by ``check-config`` and logged as warnings at start."""
        old = [] if self.xds.server_id is None else [
            "xds.server_id is deprecated and ignored: versions are content hashes, the same on every replica; "
            f"name this process with xds.replica_id (now {self.xds.replica_id!r})"]
        dialled = [n.id for c in self.clusters for n in c.nodes if n.probe_address is not None]
        if dialled:
            old.append(f"clusters[].nodes[].probe_address is deprecated ({len(dialled)} node(s): "
                       f"{', '.join(dialled[:3])}{', ...' if len(dialled) > 3 else ''}): let each agent dial the "
                       "control plane (node_probe --control-plane) and remove probe_address; docs/dial-in.md")
        inbound = any(n.probe_address is None for c in self.clusters for n in c.nodes) or any(
            c.discovery is not None and c.discovery.agents is not None for c in self.clusters)
        if inbound and self.probe.workers != 0 and self.probe.dial_in.listen is None:
            old.append("probe.workers: agents that dial in are held by this process, not the probe workers, while "
                       "they dial the xDS port; set probe.dial_in.listen (a port of their own) to spread them")
        return old + moved_notes(self) + lrs_notes(self.lrs, self.tls.mode, self.xds.listen)

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


def _read_yaml(path: str | Path) -> Any:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML{yaml_problem(e)}") from None


def rewritten_yaml(path: str | Path) -> str:
    """The config file at ``path`` with the names of earlier releases in their new places
    (:mod:`xds_server.config.renames`), as YAML; comments are not kept.
    ConfigError as :func:`load_config` (the file must load before it is rewritten)."""
    data = _read_yaml(path)
    parse_config(data)
    return yaml.safe_dump(rewrite_old_names(data, SentinelConfig), sort_keys=False)


def load_config(path: str | Path) -> SentinelConfig:
    """Read and validate a YAML config file.

    Raises ConfigError when the file cannot be read, is not valid YAML (with line/column), or
    fails validation (each error names the dotted field path and the reason).
    """
    return parse_config(_read_yaml(path))
