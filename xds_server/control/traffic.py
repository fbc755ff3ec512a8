"""Fleet-wide passive ejection applied: real-traffic evidence (LRS) -> verdicts
(:func:`~xds_server.policy.traffic_ejection.traffic_verdicts`, pure) -> the health model, through the
control core like every other observation (:class:`~xds_server.health.records.TrafficFailing`).

A node held back by ``max_ejection_percent`` gets one ``traffic_held_back`` event per episode (as
the cluster policy's ``held_back``), not one per report.
"""
from __future__ import annotations

from collections.abc import Mapping

from xds_server.control.core import ControlCore
from xds_server.health import model as hm
from xds_server.policy.traffic_ejection import Evidence, traffic_verdicts

__all__ = ["TrafficEjector"]


class TrafficEjector:
    """``apply(cluster, evidence, now_s)`` after each load report; ``held`` and ``ejected``
    (node id -> reason, the latest) for the views."""

    def __init__(self, core: ControlCore) -> None:
        self.core = core
        self.held: dict[str, str] = {}
        self.ejected: dict[str, str] = {}

    def apply(self, cluster: str, evidence: Mapping[str, Evidence], now_s: float) -> list[str]:
        """Judge one cluster's nodes on ``evidence`` (node id -> Evidence over the window since
        each entered its current state); returns the node ids ejected now."""
        core = self.core
        cfg = core.config
        ids = [nid for nid, c in core.node_cluster.items() if c == cluster and nid in core.health]
        rows = [(nid, core.health[nid], evidence.get(nid, Evidence(0, 0, 0, 0.0))) for nid in ids]
        verdicts = traffic_verdicts(rows, cfg.lrs.traffic_ejection, cfg.health.max_ejection_percent)
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
