"""Routing changes as published to Envoy, for listeners inside the process (the relay feed).

Shape: the control plane calls every registered listener with one :class:`RoutingChange` per node
whose published routing (EDS health status or effective state) changed, right after the
ClusterLoadAssignment carrying it went into the snapshot cache, so a listener hears it no later
than Envoy does. Listeners must not block: they run on the control plane's event loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["RoutingChange", "RoutingListener"]


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
