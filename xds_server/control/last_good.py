"""The fail-static look-back of one cluster: the assignments it published outside fail-static,
kept only while one can still be the answer to "what was published before this burst of losses".

Shape::

    hist = LastGoodHistory(max_entries=64)
    hist.record(now_s, routing, floor_s)     # after each publish outside fail-static
    hist.before(limit_s)                     # the newest routing recorded before limit_s, or None
"""
from __future__ import annotations

import collections
from collections.abc import Mapping

from xds_server.health import model as hm

__all__ = ["LastGoodHistory"]


class LastGoodHistory:
    """Assignments of one cluster published outside fail-static, as ``(time_s, routing)``.

    :meth:`before` answers "the last assignment published before ``limit_s``" (strictly: one
    published at the very instant a node can first be judged missing may already carry that
    judgment). Only entries that can still be that answer are kept: ``floor_s`` passed to
    :meth:`record` is the earliest limit any future fail-static can ask for (see
    :meth:`ControlCore.fail_static_floor_s`), so of the entries before it only the newest is kept.
    Beyond ``max_entries`` the oldest *newer* entries are dropped, never the oldest one: a long
    burst of publishes can make the answer older, never make it missing (the bug where a bounded
    look-back of 64 publishes let a long burst publish the bad state).
    """

    def __init__(self, max_entries: int) -> None:
        if max_entries < 2:
            raise ValueError(f"max_entries must be >= 2, got {max_entries}")
        self.max_entries = max_entries
        self._entries: collections.deque[tuple[float, Mapping[str, hm.Routing]]] = collections.deque()

    def record(self, now_s: float, routing: Mapping[str, hm.Routing], floor_s: float) -> None:
        """Remember ``routing`` published at ``now_s``."""
        e = self._entries
        e.append((now_s, routing))
        while len(e) >= 2 and e[1][0] < floor_s:
            e.popleft()
        while len(e) > self.max_entries:
            del e[1]

    def before(self, limit_s: float) -> Mapping[str, hm.Routing] | None:
        """The newest routing recorded before ``limit_s`` (None if there is none)."""
        for t, r in reversed(self._entries):
            if t < limit_s:
                return r
        return None

    def __len__(self) -> int:
        return len(self._entries)
