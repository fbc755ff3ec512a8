"""Seed 002's queue thresholds as events: a node whose engine reports more than
``health.load.queue_warning`` (50) waiting requests gets a ``queue_warning`` event, more than
``health.load.queue_critical`` (100) a ``queue_critical`` event (it is then saturated: a soft block,
no new share, see :func:`~xds_server.health.routing.node_routing`), and ``queue_ok`` when it is
back at or under the warning. One event per change of level, not per heartbeat.

Judged on the node's own telemetry (its heartbeats), whatever Envoy's load reports are doing:
the control core calls :meth:`QueueWatch.change` whenever it stores a node record with new
engine telemetry. Pure: no clock, no I/O; the caller records the event.
"""
from __future__ import annotations

from xds_server.config import HealthConfig

__all__ = ["QueueWatch", "queue_level"]


def queue_level(waiting: float | None, cfg: HealthConfig) -> str:
    """"ok", "warning" (> queue_warning) or "critical" (> queue_critical); "ok" when unknown."""
    if waiting is None or waiting <= cfg.load.queue_warning:
        return "ok"
    return "critical" if waiting > cfg.load.queue_critical else "warning"


class QueueWatch:
    """Each node's last queue level (absent: "ok").

    ``change(node_id, waiting, cfg)`` -> ``(kind, reason)`` when the level changed
    (kind ``queue_ok`` / ``queue_warning`` / ``queue_critical``), else None.
    """

    def __init__(self) -> None:
        self.levels: dict[str, str] = {}

    def change(self, node_id: str, waiting: float | None, cfg: HealthConfig) -> tuple[str, str] | None:
        level = queue_level(waiting, cfg)
        if self.levels.get(node_id, "ok") == level:
            return None
        if level == "ok":
            del self.levels[node_id]
            why = f"back at or under {cfg.load.queue_warning:g} waiting"
        else:
            self.levels[node_id] = level
            why = f"over {cfg.load.queue_critical if level == 'critical' else cfg.load.queue_warning:g} waiting"
        return f"queue_{level}", f"queue: {waiting or 0:.0f} waiting, {why} (seed 002)"

    def forget(self, node_id: str) -> None:
        """A node no longer in the config."""
        self.levels.pop(node_id, None)
