"""Routing changes as published to Envoy, for listeners inside the process (the relay feed).

Shape: the control plane calls every registered listener with one :class:`RoutingChange` per node
whose published routing (EDS health status or effective state) changed, right after the
ClusterLoadAssignment carrying it went into the snapshot cache, so a listener hears it no later
than Envoy does. Listeners must not block: they run on the control plane's event loop.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from xds_server.config import NodeConfig
from xds_server.health.records import NodeHealth
from xds_server.health.routing import Routing

__all__ = ["RoutingChange", "RoutingListener", "RoutingNotifier"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoutingChange:
    """One node's routing as just published.

    ``address``: host:port Envoy routes to (the LbEndpoint). ``routable``: published HEALTHY.
    ``state``: effective health state (DRAINING overrides). ``eds_health_status``: HEALTHY,
    UNHEALTHY or DRAINING. ``weight``: load_balancing_weight (>= 1). ``eds_version``: version of
    the cluster's ClusterLoadAssignment that carries this. ``wall_time_s``: unix seconds.
    """

    node_id: str
    cluster: str
    address: str
    routable: bool
    state: str
    eds_health_status: str
    weight: int
    reason: str
    eds_version: str
    wall_time_s: float


RoutingListener = Callable[[RoutingChange], None]


class RoutingNotifier:
    """The registered listeners and what each node was last announced as.

    For each node of a cluster just published, ``changed(node_id, key)`` (``key``: what counts
    as a change, EDS health status and effective state) says whether it differs from the last
    one announced; ``announce(change)`` tells the listeners. A listener that raises is logged
    and the others still run.
    """

    def __init__(self) -> None:
        self.listeners: list[RoutingListener] = []
        self._announced: dict[str, tuple] = {}

    def forget(self, node_id: str) -> None:
        """The node left (or is another server now): its next change is announced whatever it is."""
        self._announced.pop(node_id, None)

    def changed(self, node_id: str, key: tuple) -> bool:
        """Whether ``key`` differs from what ``node_id`` was last announced as (then it is
        recorded as announced): build a :class:`RoutingChange` only for these."""
        if self._announced.get(node_id) == key:
            return False
        self._announced[node_id] = key
        return True

    def announce_changes(self, cluster: str, nodes: Sequence[NodeConfig], routing: Mapping[str, Routing],
                         health: Mapping[str, NodeHealth], version: str, wall: float) -> None:
        """Tell the listeners of each node of ``cluster`` whose published status or state changed
        (``routing``/``health``: node id -> Routing / NodeHealth; ``version``: the CLA's)."""
        if not self.listeners:
            return
        for n in nodes:
            r, h = routing[n.id], health[n.id]
            state = h.effective_state.value
            if self.changed(n.id, (r.health_status, state)):  # objects only for changes
                self.announce(RoutingChange(n.id, cluster, n.address, r.health_status == "HEALTHY", state,
                                            r.health_status, r.weight, h.reason, version, wall))

    def announce(self, change: RoutingChange) -> None:
        """Tell every listener about ``change``."""
        for listener in list(self.listeners):
            try:
                listener(change)
            except Exception:  # a listener's bug must not stop publishing
                log.exception("routing listener failed for %s", change.node_id)
