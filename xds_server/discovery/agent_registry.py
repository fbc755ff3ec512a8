"""Nodes that registered themselves: agents dialling in to a cluster with ``discovery.agents``.

One :class:`AgentRegistry` per control plane. The probe hub (:mod:`xds_server.probing.hub`) calls
:meth:`~AgentRegistry.register` when it accepts a registration and :meth:`~AgentRegistry.stream`
when a registered node's stream opens or ends; :class:`~xds_server.discovery.manager.Discovery`
merges :meth:`~AgentRegistry.found` with the other sources' nodes (static nodes win, as for every
source). A node whose agent has had no stream open for its cluster's ``forget_after`` is dropped
(:meth:`~AgentRegistry.expire`, run by the discovery loop); while it is away it is ejected like
any silent node, so forgetting it changes only what the config lists.

Shape::

    reg = AgentRegistry(on_change)          # on_change(): the node sets changed
    reg.register("llm", node, now_s)        # True: new or changed
    reg.stream("gpu-a", True, now_s)        # its stream opened (False: ended)
    reg.expire(now_s, forget_after_s={"llm": 600.0})  # ids dropped
    reg.found()                             # {"llm": [NodeConfig, ...]}
    reg.status("llm")                       # JSON-able
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

from xds_server.config import NodeConfig

__all__ = ["AgentRegistry"]


class AgentRegistry:
    """Registered nodes by id: (cluster, node, open streams, when the last one ended (s))."""

    def __init__(self, on_change: Callable[[], None]) -> None:
        self.on_change = on_change
        self._nodes: dict[str, tuple[str, NodeConfig]] = {}
        self._open: dict[str, int] = {}
        self._ended_s: dict[str, float] = {}
        self.registrations = 0

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def ids(self) -> frozenset[str]:
        return frozenset(self._nodes)

    def register(self, cluster: str, node: NodeConfig, now_s: float) -> bool:
        """Record ``node`` in ``cluster`` (replacing what the id registered before); True when
        that changed the node sets (``on_change`` called)."""
        self.registrations += 1
        self._ended_s.setdefault(node.id, now_s)
        if self._nodes.get(node.id) == (cluster, node):
            return False
        self._nodes[node.id] = (cluster, node)
        self.on_change()
        return True

    def stream(self, node_id: str, opened: bool, now_s: float) -> None:
        """A stream of ``node_id`` opened (``opened``) or ended at ``now_s`` (s)."""
        n = self._open.get(node_id, 0) + (1 if opened else -1)
        self._open[node_id] = max(0, n)
        if n <= 0:
            self._ended_s[node_id] = now_s

    def expire(self, now_s: float, forget_after_s: Mapping[str, float]) -> list[str]:
        """Drop the nodes with no stream open for their cluster's ``forget_after_s`` (cluster name
        -> s; a cluster not named no longer takes registrations: its nodes go at once)."""
        gone = []
        for nid, (cluster, _) in list(self._nodes.items()):
            after = forget_after_s.get(cluster)
            if after is None or (self._open.get(nid, 0) == 0 and now_s - self._ended_s.get(nid, now_s) >= after):
                gone.append(nid)
                del self._nodes[nid]
                self._open.pop(nid, None)
                self._ended_s.pop(nid, None)
        if gone:
            self.on_change()
        return gone

    def found(self) -> dict[str, list[NodeConfig]]:
        """Cluster name -> registered nodes, in registration order."""
        out: dict[str, list[NodeConfig]] = {}
        for cluster, node in self._nodes.values():
            out.setdefault(cluster, []).append(node)
        return out

    def status(self, cluster: str) -> dict[str, object]:
        """JSON-able, for one cluster, in the shape of every discovery source's status: its
        registered nodes, those with a stream open, the registrations accepted so far (all
        clusters), and no errors (a refused claim is counted with the refusals, never here)."""
        ids = [nid for nid, (c, _) in self._nodes.items() if c == cluster]
        return {"source": "agents", "nodes": ids, "connected": [i for i in ids if self._open.get(i, 0) > 0],
                "registrations": self.registrations, "error": None, "errors": 0}
