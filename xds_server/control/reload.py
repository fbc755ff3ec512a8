"""What a config reload changes: a pure diff of two configs and the config to serve meanwhile.

Pure: no I/O, no clock; the server (:meth:`xds_server.server.ControlPlane.reload`) applies it.

Shape::

    d = diff_configs(running, new)          # ConfigDiff: added, removed, changed, restart_needed
    serving = serving_config(new, leaving)  # new + removed nodes still draining, in their clusters
    done = drained(nh, now_s, cfg.health.drain_timeout_s)

Rules (issue 13 item 2): nodes added start COLD (WARMING once their agent answers; neither is
routed nor counted as failing); removed nodes are drained (published DRAINING) and dropped once
drained; changed thresholds apply at once; listen addresses and ``xds.replica_id`` need a restart
(reported in ``restart_needed``, the running values stay).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from xds_server.config import ClusterConfig, NodeConfig, SentinelConfig
from xds_server.health import model as hm

__all__ = ["ConfigDiff", "diff_configs", "drained", "serving_config"]

_RESTART_FIELDS = (("xds", "listen"), ("admin", "listen"), ("xds", "replica_id"))


@dataclass(frozen=True, slots=True)
class ConfigDiff:
    """Node ids added / removed / changed (address, probe address, cluster, locality, ...), and
    the dotted names of changed fields that only a restart applies."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]
    restart_needed: tuple[str, ...]

    def to_json(self) -> dict:
        return {"added": list(self.added), "removed": list(self.removed), "changed": list(self.changed),
                "restart_needed": list(self.restart_needed)}


def _nodes(cfg: SentinelConfig) -> dict[str, tuple[str, NodeConfig]]:
    return {n.id: (c, n) for c, n in cfg.nodes()}


def diff_configs(old: SentinelConfig, new: SentinelConfig) -> ConfigDiff:
    """The node and restart-only differences from ``old`` to ``new`` (node ids in config order)."""
    o, n = _nodes(old), _nodes(new)
    added = tuple(i for i in n if i not in o)
    removed = tuple(i for i in o if i not in n)
    changed = tuple(i for i in n if i in o and o[i] != n[i])
    restart = tuple(f"{a}.{b}" for a, b in _RESTART_FIELDS
                    if getattr(getattr(old, a), b) != getattr(getattr(new, a), b))
    return ConfigDiff(added, removed, changed, restart)


def serving_config(new: SentinelConfig, leaving: Mapping[str, tuple[ClusterConfig, NodeConfig]]) -> SentinelConfig:
    """``new`` with each leaving node (node id -> (its old cluster, its NodeConfig)) appended to its
    cluster, the cluster itself re-added (as it was) if ``new`` dropped it. Not re-validated: every
    part was valid in a config that was."""
    if not leaving:
        return new
    clusters = list(new.clusters)
    index = {c.name: i for i, c in enumerate(clusters)}
    for cluster, node in leaving.values():
        i = index.get(cluster.name)
        if i is None:
            clusters.append(cluster.model_copy(update={"nodes": [node]}))
            index[cluster.name] = len(clusters) - 1
        elif all(n.id != node.id for n in clusters[i].nodes):
            clusters[i] = clusters[i].model_copy(update={"nodes": [*clusters[i].nodes, node]})
    return new.model_copy(update={"clusters": clusters})


def drained(nh: hm.NodeHealth, now_s: float, drain_timeout_s: float) -> bool:
    """A draining node is done when its engine reports nothing running, or after
    ``drain_timeout_s`` (``health.drain_timeout_s``, fc10), or when its agent is silent (no
    requests can be finishing on a node we cannot see) - the same rule as the admin view's
    ``drained`` plus the silent case."""
    if not nh.drain.active or nh.drain.since_s is None:
        return False
    running = nh.engine.requests_running
    if running is not None and running <= 0:
        return True
    if nh.state is hm.NodeState.COLD or (nh.state is hm.NodeState.UNHEALTHY
                                         and nh.heartbeat.consecutive_misses > 0):
        return True
    return now_s - nh.drain.since_s >= drain_timeout_s
