"""Kubernetes pods -> nodes, and a pod list kept current by watch events (pure: JSON in, values out).

Pods are the API's JSON objects (``metadata``, ``spec``, ``status``: camelCase, as a PodList's
``items`` or a watch event's ``object``). Shape::

    node_or_reason = pod_node(pod, spec)            # NodeConfig, or a str saying why not routed
    nodes, skipped = pods_to_nodes(state.pods, spec)   # (NodeConfig, ...), {pod name: reason}
    state = PodState.listed(pod_list)               # pods by name + the list's resourceVersion
    state = state.apply("MODIFIED", pod)            # one watch event (ADDED/MODIFIED/DELETED/BOOKMARK)

Rules: a pod is a node (id: the pod name) when it has a ``status.podIP``, its ``Ready``
condition is ``"True"`` and it has no ``metadata.deletionTimestamp``. Otherwise it is not routed:
a pod that never was a node is not added (it is warming up in Kubernetes' own terms); one that
was is removed, which the reload path turns into drained-then-dropped (a pod being deleted
stops getting new requests at once). A pod that comes back Ready is added again. Ports are
numbers or named container ports (the first container that declares the name). Locality: the
``topology.kubernetes.io/region`` and ``/zone`` labels of the pod's Kubernetes node or of the
pod (``locality_from``).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from xds_server.config import KubernetesDiscoveryConfig, Locality, NodeConfig
from xds_server.config.cluster import NODE_ID_PATTERN

__all__ = ["PodState", "pod_node", "pods_to_nodes", "resource_version_newer"]

_NODE_ID = re.compile(NODE_ID_PATTERN)
REGION_LABEL = "topology.kubernetes.io/region"
ZONE_LABEL = "topology.kubernetes.io/zone"


def _port(pod: Mapping[str, Any], want: int | str) -> int | None:
    if isinstance(want, int):
        return want
    for c in (pod.get("spec") or {}).get("containers") or ():
        for p in c.get("ports") or ():
            if p.get("name") == want and isinstance(p.get("containerPort"), int):
                return p["containerPort"]
    return None


def _hostport(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def pod_node(pod: Mapping[str, Any], spec: KubernetesDiscoveryConfig,
             node_labels: Mapping[str, Mapping[str, str]] | None = None) -> NodeConfig | str:
    """The node a pod is, or why it is none (a short reason naming the field). ``node_labels``:
    Kubernetes node name -> its labels, read for ``locality_from: node`` (a node not in it: no
    locality)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = meta.get("name") or ""
    if not _NODE_ID.fullmatch(name):
        return f"pod name {name!r} is not a usable node id (1..128 of A-Z a-z 0-9 _ . : -)"
    if meta.get("deletionTimestamp"):
        return "being deleted (metadata.deletionTimestamp set)"
    ip = status.get("podIP")
    if not ip:
        return "no status.podIP yet"
    ready = next((c.get("status") for c in status.get("conditions") or () if c.get("type") == "Ready"), None)
    if ready != "True":
        return f"not Ready (condition Ready={ready or 'absent'})"
    target, probe = _port(pod, spec.target_port), _port(pod, spec.probe_port)
    if target is None:
        return f"no container port named {spec.target_port!r} (target_port)"
    if probe is None:
        return f"no container port named {spec.probe_port!r} (probe_port)"
    labels: Mapping[str, str] = {}
    if spec.locality_from == "pod":
        labels = meta.get("labels") or {}
    elif spec.locality_from == "node":
        labels = (node_labels or {}).get((pod.get("spec") or {}).get("nodeName") or "", {})
    locality = Locality(region=labels.get(REGION_LABEL, ""), zone=labels.get(ZONE_LABEL, ""))
    try:
        return NodeConfig(id=name, address=_hostport(ip, target), probe_address=_hostport(ip, probe),
                          locality=locality, priority=spec.priority, capacity=spec.capacity)
    except ValidationError as e:
        err = e.errors()[0]
        return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}"


def pods_to_nodes(pods: Mapping[str, Mapping[str, Any]], spec: KubernetesDiscoveryConfig,
                  node_labels: Mapping[str, Mapping[str, str]] | None = None,
                  ) -> tuple[tuple[NodeConfig, ...], dict[str, str]]:
    """The nodes of ``pods`` (name -> pod) sorted by id, and why each other pod is not one
    (``node_labels`` as for :func:`pod_node`)."""
    nodes: list[NodeConfig] = []
    skipped: dict[str, str] = {}
    for name in sorted(pods):
        n = pod_node(pods[name], spec, node_labels)
        if isinstance(n, str):
            skipped[name] = n
        else:
            nodes.append(n)
    return tuple(nodes), skipped


def resource_version_newer(a: str, b: str | None) -> bool:
    """Whether resourceVersion ``a`` is newer than ``b``. Kubernetes says resourceVersions are
    opaque, except that etcd-backed ones are integers that grow; compared as integers when both
    are, else any ``a`` differing from ``b`` counts as newer."""
    if b is None:
        return True
    if a.isdigit() and b.isdigit():
        return int(a) > int(b)
    return a != b


@dataclass(frozen=True)
class PodState:
    """The pods a list + watch has seen, by name, and the resourceVersion to resume from.

    ``stale``: events skipped because their object is not newer than ``resource_version`` (the
    last list, event or bookmark) or than the pod held (a replay after a watch restart; a
    DELETED followed by a replayed ADDED would otherwise bring the pod back); ``applied``: events
    that changed ``pods``."""

    pods: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    resource_version: str | None = None
    applied: int = 0
    stale: int = 0

    @classmethod
    def listed(cls, pod_list: Mapping[str, Any], prev: PodState | None = None) -> PodState:
        """The state a PodList gives (a relist replaces every pod; counts carry over from ``prev``)."""
        items = {((p.get("metadata") or {}).get("name") or ""): p for p in pod_list.get("items") or ()}
        rv = (pod_list.get("metadata") or {}).get("resourceVersion")
        return cls(items, rv, prev.applied if prev else 0, prev.stale if prev else 0)

    def apply(self, etype: str, obj: Mapping[str, Any]) -> PodState:
        """One watch event. BOOKMARK only moves the resourceVersion; ADDED/MODIFIED put the pod,
        DELETED removes it; a stale event (see the class) is counted and changes nothing. Raises
        ValueError for another type (ERROR is the caller's)."""
        meta = obj.get("metadata") or {}
        rv = meta.get("resourceVersion")
        new_rv = rv if isinstance(rv, str) and rv else self.resource_version
        if etype == "BOOKMARK":
            return PodState(self.pods, new_rv, self.applied, self.stale)
        if etype not in ("ADDED", "MODIFIED", "DELETED"):
            raise ValueError(f"unexpected watch event type {etype!r}")
        name = meta.get("name") or ""
        held_rv = ((self.pods.get(name) or {}).get("metadata") or {}).get("resourceVersion")
        if isinstance(rv, str) and any(r and not resource_version_newer(rv, r)
                                       for r in (self.resource_version, held_rv)):
            return PodState(self.pods, self.resource_version, self.applied, self.stale + 1)
        pods = dict(self.pods)
        if etype == "DELETED":
            pods.pop(name, None)
        else:
            pods[name] = obj
        return PodState(pods, new_rv, self.applied + 1, self.stale)
