"""What a config reload changes: a pure diff of two configs and the config to serve meanwhile.

Pure: no I/O, no clock; the server (:meth:`xds_server.server.ControlPlane.reload`) applies it.

Shape::

    d = diff_configs(running, new)          # ConfigDiff: added, removed, changed, restart_needed
    p = plan_reload(running, leaving, new)  # ReloadPlan: diff, declared, leaving, newly_leaving, returning
    serving = serving_config(new, leaving)  # new + removed nodes still draining, in their clusters
    done = drained(nh, now_s, cfg.health.drain_timeout.s)

Rules: nodes added start COLD (WARMING once their agent answers; neither is
routed nor counted as failing); removed nodes are drained (published DRAINING) and dropped once
drained; changed thresholds apply at once; listen addresses, ``xds.replica_id`` and the ADS port's
TLS mode and file paths need a restart (reported in ``restart_needed``, the running values stay;
the files' content is reloaded when it changes, see :mod:`xds_server.process.tls`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from xds_server.config import ClusterConfig, NodeConfig, SentinelConfig
from xds_server.health import model as hm

__all__ = ["ConfigDiff", "ReloadPlan", "diff_configs", "drained", "plan_reload", "serving_config"]

_RESTART_FIELDS = (("xds", "listen"), ("admin", "listen"), ("xds", "replica_id"), ("tls", "mode"),
                   ("tls", "cert_file"), ("tls", "key_file"), ("tls", "client_ca_file"))


@dataclass(frozen=True, slots=True)
class ConfigDiff:
    """Node ids added / removed / changed (address, probe address, cluster, locality, ...), and
    the dotted names of changed fields that only a restart applies."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]
    restart_needed: tuple[str, ...]

    def to_json(self) -> dict[str, list[str]]:
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


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What a reload does: ``diff``; ``declared``, the new config with the restart-only fields at
    their running values; ``leaving`` (node id -> (old cluster, node) still draining out, as
    :func:`serving_config` takes it); the node ids to drain now (``newly_leaving``) and those
    back before they were dropped (``returning``, to undrain)."""

    diff: ConfigDiff
    declared: SentinelConfig
    leaving: dict[str, tuple[ClusterConfig, NodeConfig]]
    newly_leaving: tuple[str, ...]
    returning: tuple[str, ...]


def plan_reload(declared: SentinelConfig, leaving: Mapping[str, tuple[ClusterConfig, NodeConfig]],
                new: SentinelConfig) -> ReloadPlan:
    """The plan for serving ``new`` where ``declared`` was accepted last and ``leaving`` drains."""
    diff = diff_configs(declared, new)
    keep = {"xds": new.xds.model_copy(update={"listen": declared.xds.listen, "replica_id": declared.xds.replica_id}),
            "admin": new.admin.model_copy(update={"listen": declared.admin.listen}),
            "tls": new.tls.model_copy(update=declared.tls.listener())}
    new = new.model_copy(update=keep)
    old_nodes = {n.id: (c, n) for c in declared.clusters for n in c.nodes}
    out = dict(leaving)
    newly_leaving = tuple(i for i in diff.removed if i not in out)
    out.update({i: old_nodes[i] for i in diff.removed})
    new_ids = {n.id for _, n in new.nodes()}
    returning = tuple(i for i in out if i in new_ids)
    for i in returning:
        del out[i]
    return ReloadPlan(diff, new, out, newly_leaving, returning)


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
    ``drain_timeout_s`` (``health.drain_timeout``, fc10), or when its agent is silent (no
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
