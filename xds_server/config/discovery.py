"""``clusters[].discovery:`` section: nodes found at run time (a targets file, Kubernetes pods,
agents that register themselves).

Discovered nodes are merged with the cluster's static ``nodes`` and enter through the reload
path (added COLD -> WARMING, removed drained then dropped); see :mod:`xds_server.discovery`.
"""
from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from xds_server.config.base import _Model
from xds_server.config.duration import Duration, PositiveDuration, at_least, at_most
from xds_server.config.renames import Moves, _Renaming
from xds_server.process.identity import check_pattern

__all__ = ["AgentsDiscoveryConfig", "DiscoveryConfig", "FileDiscoveryConfig", "KubernetesDiscoveryConfig"]


_LABEL_KEY = r"^([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
_LABEL_VALUE = r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$"
_PORT_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class FileDiscoveryConfig(_Renaming):
    """A targets file: a YAML or JSON list of nodes (``id``, ``address``, ``probe_address``, optional
    ``locality``, ``priority``, ``capacity``: the fields of a static node), or a mapping with that
    list under ``nodes``. Read every ``interval_s``; a changed content hash (sha256) is parsed."""

    WHERE: ClassVar[str] = "clusters[].discovery.file"
    MOVED: ClassVar[Moves] = {
        "interval_s": ("interval", "s"),
    }

    path: str = Field(..., min_length=1, description="targets file; relative to the working directory")
    interval: PositiveDuration = Field(
        Duration.parse("1s"), description="how often the file is read and its content hash compared, s (ours)",
    )


def _port(v: int | str, field: str) -> int | str:
    if isinstance(v, int):
        if not 1 <= v <= 65535:
            raise ValueError(f"{field} {v} outside 1..65535")
        return v
    if not re.match(_PORT_NAME, v) or len(v) > 15:
        raise ValueError(f"{field} {v!r} is neither a port number nor a container port name (IANA_SVC_NAME)")
    return v


class KubernetesDiscoveryConfig(_Renaming):
    """Pods selected by label in one namespace (the selector an InferencePool uses), through
    ``kubernetes-asyncio`` (the optional extra ``kubernetes``): list, then watch from the list's
    resourceVersion. A pod is a node when it has a podIP, is Ready and has no deletionTimestamp;
    its node id is the pod name."""

    WHERE: ClassVar[str] = "clusters[].discovery.kubernetes"
    MOVED: ClassVar[Moves] = {
        "watch_timeout_s": ("watch_timeout", "s"),
        "retry_backoff_s": ("retry_backoff", "s"),
    }

    namespace: str = Field("default", min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    label_selector: dict[str, str] = Field(
        ..., min_length=1, description="equality selector: every label must match (as InferencePool.spec.selector)",
    )
    target_port: int | str = Field(
        ..., description="serving port Envoy routes to: a number, or the name of a container port",
    )
    probe_port: int | str = Field(
        ..., description="the node_probe agent's port: a number, or the name of a container port",
    )
    kubeconfig: str | None = Field(
        None, description="kubeconfig file; None: the in-cluster service account when "
                          "KUBERNETES_SERVICE_HOST is set, else $KUBECONFIG or ~/.kube/config",
    )
    context: str | None = Field(None, description="kubeconfig context; None: its current-context")
    watch_timeout: Annotated[PositiveDuration, at_least("1s"), at_most("1h")] = Field(
        Duration.parse("5m"), description="server-side end of each watch (timeoutSeconds); the watch is "
                                        "then resumed from the last resourceVersion (ours)",
    )
    retry_backoff: Annotated[PositiveDuration, at_most("1m")] = Field(
        Duration.parse("1s"), description="wait after a failed list or watch before trying again, s (ours)",
    )
    priority: int = Field(0, ge=0, le=128, description="Envoy priority of every discovered pod")
    capacity: int = Field(1, ge=1, le=1_000_000, description="relative capacity of every discovered pod")
    locality_from: Literal["none", "node", "pod"] = Field(
        "none", description="where a pod's locality (Envoy region/zone) comes from: the "
                            "topology.kubernetes.io/region and /zone labels of the Kubernetes node it "
                            "runs on (needs RBAC get on nodes; each node read once), or of the pod "
                            "itself; none: no locality",
    )

    @field_validator("label_selector")
    @classmethod
    def _v_selector(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not re.match(_LABEL_KEY, k) or len(k) > 317:
                raise ValueError(f"label key {k!r} is not a Kubernetes label key")
            if not re.match(_LABEL_VALUE, val) or len(val) > 63:
                raise ValueError(f"label value {val!r} (of {k!r}) is not a Kubernetes label value")
        return v

    @field_validator("target_port")
    @classmethod
    def _v_target(cls, v: int | str) -> int | str:
        return _port(v, "target_port")

    @field_validator("probe_port")
    @classmethod
    def _v_probe(cls, v: int | str) -> int | str:
        return _port(v, "probe_port")


class AgentsDiscoveryConfig(_Model):
    """Nodes that register themselves: an agent dialling in (``node_probe --control-plane``) with a
    node id the config does not list joins this cluster when its identity is allowed. The node is
    made from the agent's Register (serving address, locality, priority, capacity)."""

    allow: list[str] = Field(
        ..., min_length=1,
        description="typed fnmatch patterns over the agent's client certificate (as tls.node_allow's "
        "identity: 'spiffe://...', 'uri:', 'dns:', 'cn:'); an agent matching none is refused and "
        "said. The single entry '*' lets any agent register, a certificate or none (plaintext "
        "fleets on a trusted network, the demo)",
    )
    forget_after: Annotated[PositiveDuration, at_least("1s")] = Field(
        Duration.parse("10m"),
        description="a registered node whose agent has had no stream open this long is dropped "
        "from the cluster (it is ejected long before: its stream's end is its liveness). Ours: "
        "outlasts a rolling restart of an agent or a control-plane replica",
    )

    @field_validator("allow")
    @classmethod
    def _v_allow(cls, v: list[str]) -> list[str]:
        for i, p in enumerate(v):
            why = None if p == "*" else check_pattern(p)
            if why:
                raise ValueError(f"allow.{i}: {why}")
        return v


class DiscoveryConfig(_Model):
    """Where a cluster's nodes come from besides its static ``nodes``: any of the sources."""

    file: FileDiscoveryConfig | None = None
    kubernetes: KubernetesDiscoveryConfig | None = None
    agents: AgentsDiscoveryConfig | None = None

    @model_validator(mode="after")
    def _some(self) -> DiscoveryConfig:
        if self.file is None and self.kubernetes is None and self.agents is None:
            raise ValueError("discovery needs a source: file, kubernetes or agents")
        return self
