"""The dashboard's memory: a bounded recent history of every node's shown state, weight, RTT and
TTFT, kept by the control plane (not the browser), so a page opened during an incident shows
what led there: ``GET /history`` is fetched with the first page load and fills the sparklines
and the per-cluster timeline at once.

:class:`History` is a ring of ``capacity`` samples (``admin.history / admin.history_interval``,
default 15 min at 2 s = 450), pure: :meth:`History.add` takes the sample's wall time and rows,
:meth:`History.to_json` the answer; no clock reads, no I/O. Memory is bounded by capacity x
nodes: per node one ``array`` per series (8-byte times shared by all nodes, 1-byte state,
4-byte weight, 8-byte RTT and TTFT): ~9.5 KB per node at the default capacity, 10 MB measured
for 1,000 nodes. An answer holds at most ~250,000 numbers (a larger fleet gets every k-th
sample) and is encoded once per sample, whatever the number of browsers that load it.
A node added by a reload gets an empty past (``-1``); a removed one is forgotten.

Wire format (``GET /history``)::

    {"interval_s": 2.0, "window_s": 900, "states": [DISPLAY_STATES...],
     "t": [unix s, oldest first],
     "nodes": {id: {"cluster", "full_weight", "state": [index into states, -1 = no sample],
                    "weight": [published weight, -1 = not routed ("-")],
                    "rtt_ms": [EWMA RTT, -1 = none], "ttft_ms": [last TTFT, -1 = none]}}}
"""
from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from xds_server.admin.display import DISPLAY_STATES

__all__ = ["History", "HistoryRow"]

_STATE_INDEX = {s: i for i, s in enumerate(DISPLAY_STATES)}


@dataclass(frozen=True, slots=True)
class HistoryRow:
    """One node in one sample: ``state`` (a shown state), ``weight`` (None when not routed),
    ``rtt_ms`` / ``ttft_ms`` (None when unknown), ``full_weight`` (its weight at full capacity)."""

    node_id: str
    cluster: str
    state: str
    weight: int | None
    full_weight: int
    rtt_ms: float | None
    ttft_ms: float | None


def _num(v: float | None) -> float:
    return -1.0 if v is None or not math.isfinite(v) else round(float(v), 2)


class _Series:
    __slots__ = ("cluster", "full_weight", "rtt", "state", "ttft", "weight")

    def __init__(self, capacity: int, cluster: str, full_weight: int) -> None:
        self.cluster, self.full_weight = cluster, full_weight
        self.state = array("b", [-1]) * capacity
        self.weight = array("i", [-1]) * capacity
        self.rtt = array("d", [-1.0]) * capacity
        self.ttft = array("d", [-1.0]) * capacity


class History:
    """A ring of the last ``capacity`` samples taken every ``interval_s`` (see module docstring)."""

    def __init__(self, capacity: int, interval_s: float) -> None:
        if capacity < 1 or not interval_s > 0:
            raise ValueError(f"history: capacity must be >= 1 and interval_s > 0, got {capacity}, {interval_s}")
        self.capacity, self.interval_s = capacity, interval_s
        self._t = array("d", [0.0]) * capacity
        self._nodes: dict[str, _Series] = {}
        self._next = 0  # slot of the next sample
        self._count = 0  # samples held (<= capacity)
        self.added = 0  # samples added so far (a cache of the answer is good while this holds)

    def __len__(self) -> int:
        return self._count

    def add(self, t: float, rows: Iterable[HistoryRow]) -> None:
        """Record one sample taken at wall time ``t`` (unix s); nodes not in ``rows`` are forgotten."""
        i = self._next
        self._t[i] = t
        seen = set()
        for r in rows:
            s = self._nodes.get(r.node_id)
            if s is None:
                s = self._nodes[r.node_id] = _Series(self.capacity, r.cluster, r.full_weight)
            s.cluster, s.full_weight = r.cluster, r.full_weight
            s.state[i] = _STATE_INDEX.get(r.state, -1)
            s.weight[i] = -1 if r.weight is None else int(r.weight)
            s.rtt[i], s.ttft[i] = _num(r.rtt_ms), _num(r.ttft_ms)
            seen.add(r.node_id)
        for gone in [n for n in self._nodes if n not in seen]:
            del self._nodes[gone]
        self._next = (i + 1) % self.capacity
        self._count = min(self._count + 1, self.capacity)
        self.added += 1

    def _ordered(self, a: array, step: int) -> list:
        """``a``'s held samples, oldest first, every ``step``-th ending with the newest."""
        held = a[:self._count] if self._count < self.capacity else a[self._next:] + a[:self._next]
        return held[(len(held) - 1) % step::step].tolist()

    def to_json(self, max_values: int = 250_000) -> dict:
        """The ``GET /history`` answer (module docstring). At most ~``max_values`` numbers in all:
        a fleet too large for every sample gets every k-th (``interval_s`` says the resulting
        step), so one answer stays ~50 ms of encoding and a few MB (ours: 1,000 nodes x 450
        samples would be 9 MB and ~270 ms on the event loop)."""
        per_node = max(1, max_values // (4 * max(1, len(self._nodes))))
        step = max(1, -(-self._count // per_node))
        return {
            "interval_s": self.interval_s * step,
            "window_s": self.capacity * self.interval_s,
            "states": list(DISPLAY_STATES),
            "t": [round(t, 3) for t in self._ordered(self._t, step)],
            "nodes": {nid: {"cluster": s.cluster, "full_weight": s.full_weight,
                            "state": self._ordered(s.state, step), "weight": self._ordered(s.weight, step),
                            "rtt_ms": self._ordered(s.rtt, step), "ttft_ms": self._ordered(s.ttft, step)}
                      for nid, s in self._nodes.items()},
        }
