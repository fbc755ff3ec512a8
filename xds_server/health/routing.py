"""A node's routing from its health: status, weight factor, soft block, and the EDS weight.

The one home of the weight formula (:func:`weight`): cluster policy and :func:`route` both use it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from xds_server.config import HealthConfig
from xds_server.health.outcome import refusal_evidence
from xds_server.health.records import ROUTED_STATES, NodeHealth, NodeState, awaits_verdict

__all__ = [
    "WEIGHT_PER_CAPACITY",
    "NodeRouting",
    "Routing",
    "RoutingStatus",
    "full_weight",
    "node_routing",
    "route",
    "weight",
]

WEIGHT_PER_CAPACITY = 100
"""Full weight per unit of ``capacity``: a 1 % ramp step is still an integer weight (NodeConfig)."""


class RoutingStatus(enum.StrEnum):
    """The EDS health status a node is published with (never UNKNOWN, which Envoy routes to)."""

    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    DRAINING = "DRAINING"


@dataclass(frozen=True, slots=True)
class NodeRouting:
    """A node's own routing view before cluster policy.

    ``status``: HEALTHY (routable), UNHEALTHY (not routed) or DRAINING.
    ``factor``: share of full weight from the state (DEGRADED 0.3, PROBATION ramp %, queue
    warning), 0..1. ``soft_block``: a reason the node should not get new traffic that cluster
    policy may hold back under ``max_ejection_percent`` (GPU memory, queue), else "".
    ``hard``: not routed on hard evidence (never held back).
    """

    status: RoutingStatus
    factor: float
    soft_block: str = ""
    hard: bool = False


@dataclass(frozen=True, slots=True)
class Routing:
    """What Envoy gets for a node: ``weight`` >= 1 and an EDS health status.

    ``health_status`` accepts the enum or its name; another value raises ValueError.
    """

    weight: int
    health_status: RoutingStatus

    def __post_init__(self) -> None:
        if not isinstance(self.health_status, RoutingStatus):
            try:
                object.__setattr__(self, "health_status", RoutingStatus(self.health_status))
            except ValueError:
                raise ValueError(f"Routing.health_status: {self.health_status!r} is not one of "
                                 "HEALTHY, UNHEALTHY, DRAINING") from None


def full_weight(capacity: int) -> int:
    """Weight of a node at 100 %: ``capacity`` x 100."""
    return capacity * WEIGHT_PER_CAPACITY


def weight(capacity: int, factor: float, score_factor: float = 1.0) -> int:
    """Integer EDS weight >= 1: full weight x state factor x score factor, rounded.

    Weight is never the way to eject (Envoy NACKs 0): a node that is not routed keeps its full
    weight and is published UNHEALTHY or DRAINING.
    """
    return max(1, round(full_weight(capacity) * factor * score_factor))


def node_routing(nh: NodeHealth, cfg: HealthConfig) -> NodeRouting:
    """This node's routing before cluster policy (see :class:`NodeRouting`).

    DEGRADED keeps ``degraded_weight_factor`` (seed 001: cut by 70 %); PROBATION keeps its ramp
    percentage; more than ``queue_warning`` waiting multiplies by ``queue_warning_weight_factor``.
    REFUSING (every probe refused for ``busy.refusal_block``), GPU free memory under
    ``gpu_min_free_ratio`` or more than ``queue_critical`` waiting is a soft block; REFUSING
    keeps the DEGRADED factor for when the ``max_ejection_percent`` cap holds its block back.
    COLD, WARMING and UNHEALTHY are not routed (never published UNKNOWN, which Envoy treats as
    healthy), nor is a PROBATION waiting for its switch-back verdict before its first request.
    """
    if nh.drain.active:
        return NodeRouting(RoutingStatus.DRAINING, 1.0)
    st = nh.state
    if st not in ROUTED_STATES or awaits_verdict(nh):
        return NodeRouting(RoutingStatus.UNHEALTHY, 1.0, hard=True)  # (or switch-back validation first)
    factor = 1.0
    refusing = ""
    if st is NodeState.REFUSING:  # a soft block; if the cap holds it back, routed as DEGRADED
        factor = cfg.probes.degraded_weight_factor
        refusing = refusal_evidence(nh) if nh.probe.refused_since_s is not None else f"REFUSING: {nh.reason}"
    elif st is NodeState.DEGRADED:
        factor = cfg.probes.degraded_weight_factor
    elif st is NodeState.PROBATION:
        factor = max(nh.ramp.percent, cfg.probation.ramp_start_percent) / 100.0
    soft = refusing
    e = nh.engine
    w = e.requests_waiting
    if w is not None and w > cfg.load.queue_critical:
        soft = soft or f"queue: {w:.0f} waiting > {cfg.load.queue_critical:g}"
    elif w is not None and w > cfg.load.queue_warning:
        factor *= cfg.load.queue_warning_weight_factor
    if not soft and e.gpu_free_ratio is not None and e.gpu_free_ratio < cfg.load.gpu_min_free_ratio:
        soft = f"GPU memory free {e.gpu_free_ratio * 100:.1f} % < {cfg.load.gpu_min_free_ratio * 100:g} %"
    return NodeRouting(RoutingStatus.HEALTHY, factor, soft_block=soft)


def route(nh: NodeHealth, capacity: int, cfg: HealthConfig) -> Routing:
    """A node's Routing on its own (no cluster policy): :func:`weight` of its state factor, or
    full weight with status UNHEALTHY (soft block, not routed) or DRAINING."""
    nr = node_routing(nh, cfg)
    if nr.status is not RoutingStatus.HEALTHY:
        return Routing(full_weight(capacity), nr.status)
    if nr.soft_block:
        return Routing(full_weight(capacity), RoutingStatus.UNHEALTHY)
    return Routing(weight(capacity, nr.factor), RoutingStatus.HEALTHY)
