"""Seed 002's queue thresholds as events: a node whose engine reports more than
``health.queue_warning`` (50) waiting requests gets a ``queue_warning`` event, more than
``health.queue_critical`` (100) a ``queue_critical`` event (it is then saturated: a soft block,
no new share, see :func:`~xds_server.health.routing.node_routing`), and ``queue_ok`` when it is
back at or under the warning. One event per change of level, not per heartbeat."""
from __future__ import annotations

from collections.abc import Iterable

from xds_server.config import HealthConfig
from xds_server.control.core import ControlCore

__all__ = ["QueueWatch", "queue_level"]


def queue_level(waiting: float | None, cfg: HealthConfig) -> str:
    """"ok", "warning" (> queue_warning) or "critical" (> queue_critical); "ok" when unknown."""
    if waiting is None or waiting <= cfg.queue_warning:
        return "ok"
    return "critical" if waiting > cfg.queue_critical else "warning"


class QueueWatch:
    """``check(core, node_ids)``: record an event for each node whose queue level changed."""

    def __init__(self) -> None:
        self.levels: dict[str, str] = {}

    def check(self, core: ControlCore, cluster: str, node_ids: Iterable[str]) -> None:
        cfg = core.config.health
        for nid in node_ids:
            nh = core.health.get(nid)
            if nh is None:
                continue
            waiting = nh.engine.requests_waiting
            level = queue_level(waiting, cfg)
            if self.levels.get(nid, "ok") != level:
                why = ("back at or under" if level == "ok" else "over") + \
                    f" {cfg.queue_critical if level == 'critical' else cfg.queue_warning:g} waiting"
                core.events.record(core.clock.wall(), cluster, nid, f"queue_{level}",
                                   f"queue: {waiting or 0:.0f} waiting, {why} (seed 002)")
            self.levels[nid] = level
