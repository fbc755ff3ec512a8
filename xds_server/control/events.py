"""Health events as kept for ``/events`` and written to the log: a bounded ring buffer.

Every reason is clipped to ``max_reason_chars`` before it is stored (agent and operator text can
be long) and escaped (:func:`~xds_server.process.untrusted.for_log`) before it reaches a log line.
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from xds_server.process.counters import Counters
from xds_server.process.untrusted import clip, for_log

__all__ = ["EventLog", "EventRecord"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EventRecord:
    """An event as kept for ``/events``: wall time (unix s), cluster, node, kind and reason.

    ``kind`` is "transition" (then ``from_state``/``to_state`` are set) or a cluster-policy
    kind: "outlier_ejected", "outlier_returned", "held_back", "fail_static_on", "fail_static_off".
    """

    wall_time_s: float
    cluster: str
    node_id: str
    kind: str
    reason: str
    from_state: str | None = None
    to_state: str | None = None

    def to_json(self) -> dict[str, float | str | None]:
        """JSON-able form."""
        return {
            "time": self.wall_time_s,
            "cluster": self.cluster,
            "node": self.node_id,
            "kind": self.kind,
            "from": self.from_state,
            "to": self.to_state,
            "reason": self.reason,
        }


class EventLog:
    """The last ``maxlen`` events; each one counted in ``counters.events`` and logged
    (transitions at INFO, cluster-policy events at WARNING)."""

    def __init__(self, maxlen: int, counters: Counters, max_reason_chars: int = 512) -> None:
        self._buf: collections.deque[EventRecord] = collections.deque(maxlen=maxlen)
        self._counters = counters
        self.max_reason_chars = max_reason_chars

    def record(self, wall_s: float, cluster: str, node_id: str, kind: str, reason: str,
               from_state: str | None = None, to_state: str | None = None) -> EventRecord:
        """Store, count and log one event; returns the stored record (reason clipped)."""
        rec = EventRecord(wall_s, cluster, node_id, kind, clip(reason, self.max_reason_chars),
                          from_state, to_state)
        self._buf.append(rec)
        self._counters.events[kind if kind != "transition" else f"to_{to_state}"] += 1
        if kind == "transition":
            log.info("node %s: %s -> %s (%s)", for_log(node_id), from_state, to_state, for_log(rec.reason, 256),
                     extra={"node": node_id, "cluster": cluster, "reason": rec.reason})
        else:
            log.warning("%s %s: %s (%s)", kind, for_log(node_id), cluster, for_log(rec.reason, 256),
                        extra={"node": node_id, "cluster": cluster, "reason": rec.reason})
        return rec

    def recent(self, limit: int) -> list[EventRecord]:
        """The newest ``limit`` events, oldest first (``limit`` >= 0; 0 gives none)."""
        if limit <= 0:
            return []
        return list(self._buf)[-limit:]

    def __iter__(self) -> Iterator[EventRecord]:
        return iter(self._buf)

    def __len__(self) -> int:
        return len(self._buf)
