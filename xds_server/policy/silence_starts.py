"""When the silences counted so far began, kept sorted, and whether one more may complete a
fail-static window. Pure (no I/O, no clock).

:func:`~xds_server.policy.cluster_routing.fail_static` enters when ``need`` silences began within
``fail_static.window`` of each other; its walk reads every node and sorts the silent ones' starts,
O(n log n). The control core runs it whenever a node's miss state changes and enough nodes are
counted silent, so in a mass silence that comes in waves (more than ``fail_static.fraction``
silent, but never ``need`` of them within one window) it ran O(n) times: measured in a 2,000-node
collapse, 395 walks took 3.0 of 29 profiled seconds, on the loop that reads liveness.

A window that did not exist before one silence was added contains that silence's start ``t``, so
its first start lies in ``[t - window_s, t]``. :meth:`SilenceStarts.near_window` looks only there:
O(log n + need). It may also say True for a window that existed before (the walk then decides, as
before); it never says False where a window holds ``t``.

Shape::

    s = SilenceStarts()     # or SilenceStarts({"n1": 10.02, ...})
    s.add("n1", 10.02)      # True: n1 counted silent, its silence began at its last heartbeat, 10.02 s
    s.discard("n1")         # heard again (or removed)
    len(s), "n1" in s, s.nodes()
    s.near_window(10.02, need=3, window_s=0.5)   # bool: 3 starts within 0.5 s, the first in [9.52, 10.02]
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping

__all__ = ["SilenceStarts"]


class SilenceStarts:
    """Node id -> the start of its counted silence (s, the clock of the heartbeats), and the starts
    sorted. ``add`` of a node already in moves its start."""

    __slots__ = ("_at", "_sorted")

    def __init__(self, starts: Mapping[str, float] | None = None) -> None:
        self._at: dict[str, float] = dict(starts or {})
        self._sorted: list[float] = sorted(self._at.values())

    def add(self, node_id: str, start_s: float) -> bool:
        """Whether ``start_s`` is new here (the node was not in, or had another start)."""
        old = self._at.get(node_id)
        if old == start_s:
            return False
        if old is not None:
            self._remove(old)
        self._at[node_id] = start_s
        bisect.insort(self._sorted, start_s)
        return True

    def discard(self, node_id: str) -> None:
        old = self._at.pop(node_id, None)
        if old is not None:
            self._remove(old)

    def _remove(self, start_s: float) -> None:
        del self._sorted[bisect.bisect_left(self._sorted, start_s)]  # present: every start kept is in _at

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._at

    def nodes(self) -> set[str]:
        return set(self._at)

    def near_window(self, at_s: float, need: int, window_s: float) -> bool:
        """Whether ``need`` starts lie within ``window_s`` (inclusive) of each other, the first of
        them in ``[at_s - window_s, at_s]``: every such window that holds ``at_s`` is found."""
        s, last = self._sorted, len(self._sorted) - need
        for p in range(bisect.bisect_left(s, at_s - window_s), bisect.bisect_right(s, at_s)):
            if p > last:
                return False
            if s[p + need - 1] - s[p] <= window_s:
                return True
        return False
