"""Fleet-wide passive ejection applied: real-traffic evidence (LRS) -> verdicts
(:func:`~xds_server.policy.traffic_ejection.traffic_verdicts`, pure) -> the health model, through the
control core like every other observation (:class:`~xds_server.health.records.TrafficFailing`).

A node held back (by ``max_ejection_percent``, ``min_reporters``, its own busy evidence or a
cluster failure) gets one ``traffic_held_back`` event per episode, not one per report. A cluster
where most nodes fail alike gets one ``cluster_failure`` event when it starts (or its scope
changes) and one ``cluster_failure_cleared`` when no scope fails alike any more.
"""
from __future__ import annotations

from collections.abc import Mapping

from xds_server.control.core import ControlCore
from xds_server.health import model as hm
from xds_server.policy.traffic_ejection import ClusterFailure, Evidence, traffic_verdicts

__all__ = ["TrafficEjector"]


class TrafficEjector:
    """``apply(cluster, evidence, now_s)`` after each load report; ``held`` and ``ejected``
    (node id -> reason, the latest) and ``cluster_failures`` (cluster -> (its failing scopes,
    since when, wall s)) for the views."""

    def __init__(self, core: ControlCore) -> None:
        self.core = core
        self.held: dict[str, str] = {}
        self.ejected: dict[str, str] = {}
        self.cluster_failures: dict[str, tuple[tuple[ClusterFailure, ...], float]] = {}

    def apply(self, cluster: str, evidence: Mapping[str, Evidence], now_s: float) -> list[str]:
        """Judge one cluster's nodes on ``evidence`` (node id -> Evidence over the window since
        each entered its current state); returns the node ids ejected now."""
        core = self.core
        cfg = core.config
        ids = [nid for nid, c in core.node_cluster.items() if c == cluster and nid in core.health]
        rows = [(nid, core.health[nid], evidence.get(nid, Evidence(0, 0, 0, 0.0))) for nid in ids]
        verdicts = traffic_verdicts(rows, cfg.lrs.traffic_ejection, cfg.health.outlier.max_ejection_percent,
                                    {nid: core.node_cfg[nid].priority for nid in ids if nid in core.node_cfg})
        self._cluster_failure(cluster, verdicts.cluster_failure)
        for nid in ids:
            if nid not in verdicts.held:
                self.held.pop(nid, None)
        for nid, why in verdicts.held.items():
            if nid not in self.held:
                core.events.record(core.clock.wall(), cluster, nid, "traffic_held_back", why)
            self.held[nid] = why
        for nid, why in verdicts.eject.items():
            self.ejected[nid] = why
            core.observe(nid, hm.TrafficFailing(why), now_s)
        return list(verdicts.eject)

    def serving(self, cluster: str, node_ids: frozenset[str]) -> None:
        """The nodes of ``cluster`` whose latest real traffic succeeds (for the rule that keeps
        silent nodes routed when nothing else is: :func:`~xds_server.policy.cluster_routing.cluster_routing`)."""
        if self.core.planner.set_serving(cluster, node_ids):
            self.core.mark_dirty(cluster)

    def _cluster_failure(self, cluster: str, found: tuple[ClusterFailure, ...]) -> None:
        core = self.core
        before = self.cluster_failures.get(cluster)
        if found:
            scopes = [f.scope for f in found]
            if before is None or [f.scope for f in before[0]] != scopes:
                core.events.record(core.clock.wall(), cluster, "*", "cluster_failure",
                                   "; ".join(f.describe() for f in found))
                self.cluster_failures[cluster] = (found, core.clock.wall())
            else:
                self.cluster_failures[cluster] = (found, before[1])
        elif before is not None:
            del self.cluster_failures[cluster]
            core.events.record(core.clock.wall(), cluster, "*", "cluster_failure_cleared",
                               "fewer nodes fail real requests alike: traffic ejection judges each node again")

    def cluster_view(self, cluster: str) -> dict[str, object] | None:
        """JSON for ``/clusters``: the scopes failing alike, their shares and since when (wall s)."""
        got = self.cluster_failures.get(cluster)
        if got is None:
            return None
        found, since = got
        return {"since": since, "scopes": [{"scope": f.scope, "failing_nodes": f.failing, "nodes": f.nodes,
                                            "failure_ratio": round(f.pooled_ratio, 4), "reason": f.describe()}
                                           for f in found]}
