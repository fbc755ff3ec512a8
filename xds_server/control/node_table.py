"""The control plane's node health table: node id -> NodeHealth, steady heartbeats folded in place.

A steady node's quiet heartbeats are folded into a :class:`~xds_server.health.beats.BeatRun`
(``runs``) instead of building its record at every heartbeat (three records per
heartbeat were a third of the control plane's share). Every read of a node's health through the
mapping settles its run first, so a reader (views, fail-static, the state file, metrics, tests)
sees exactly the record the health step would have built; writing a node's health ends its run.
Only :meth:`ControlCore.observe <xds_server.control.core.ControlCore.observe>` touches ``runs``.

A reader of no heartbeat record (cluster policy at each publish, the relay's announcements) reads
``unsettled`` instead and leaves the runs open: a run folds only heartbeats, so every other record
of its base is current. Settling 2,000 runs at each publish cost ~5 ms, and made each node's next
heartbeat take the full health step again.
"""
from __future__ import annotations

import types
from collections.abc import Iterator, Mapping, MutableMapping

from xds_server.health.beats import BeatRun
from xds_server.health.records import NodeHealth

__all__ = ["HealthTable"]


class HealthTable(MutableMapping[str, NodeHealth]):
    """A mapping node id -> :class:`NodeHealth` whose reads settle open runs (module docstring)."""

    __slots__ = ("_nh", "runs", "unsettled")

    def __init__(self) -> None:
        self._nh: dict[str, NodeHealth] = {}
        self.runs: dict[str, BeatRun] = {}
        # node id -> its record with an open run's heartbeats not folded in: every record but
        # ``heartbeat`` current (module docstring); read only, follows the table
        self.unsettled: Mapping[str, NodeHealth] = types.MappingProxyType(self._nh)

    def oldest_heartbeat_s(self) -> float | None:
        """The earliest last heartbeat of any node (s, monotonic; open runs' folded ones count),
        None before any heartbeat. Settles no run."""
        runs = self.runs
        oldest: float | None = None
        for node_id, nh in self._nh.items():
            run = runs.get(node_id)
            last = run.last_s if run is not None else nh.heartbeat.last_s
            if last is not None and (oldest is None or last < oldest):
                oldest = last
        return oldest

    def __getitem__(self, node_id: str) -> NodeHealth:
        run = self.runs.pop(node_id, None)
        if run is not None:
            nh = self._nh[node_id] = run.settled()
            return nh
        return self._nh[node_id]

    def __setitem__(self, node_id: str, nh: NodeHealth) -> None:
        self.runs.pop(node_id, None)
        self._nh[node_id] = nh

    def __delitem__(self, node_id: str) -> None:
        self.runs.pop(node_id, None)
        del self._nh[node_id]

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nh

    def __iter__(self) -> Iterator[str]:
        return iter(self._nh)

    def __len__(self) -> int:
        return len(self._nh)

    def __repr__(self) -> str:
        return f"HealthTable({len(self._nh)} nodes, {len(self.runs)} runs open)"
