"""The control plane's node health table: node id -> NodeHealth, steady heartbeats folded in place.

A steady node's quiet heartbeats are folded into a :class:`~xds_server.health.beats.BeatRun`
(``runs``) instead of building its record at every heartbeat (three records per
heartbeat were a third of the control plane's share). Every read of a node's health through the
mapping settles its run first, so a reader (views, fail-static, the state file, metrics, tests)
sees exactly the record the health step would have built; writing a node's health ends its run.
Only :meth:`ControlCore.observe <xds_server.control.core.ControlCore.observe>` touches ``runs``.
"""
from __future__ import annotations

from collections.abc import Iterator, MutableMapping

from xds_server.health.beats import BeatRun
from xds_server.health.records import NodeHealth

__all__ = ["HealthTable"]


class HealthTable(MutableMapping[str, NodeHealth]):
    """A mapping node id -> :class:`NodeHealth` whose reads settle open runs (module docstring)."""

    __slots__ = ("_nh", "runs")

    def __init__(self) -> None:
        self._nh: dict[str, NodeHealth] = {}
        self.runs: dict[str, BeatRun] = {}

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
