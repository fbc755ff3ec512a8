"""Discovered nodes merged with a config's static nodes, and what a change of node set means.

Pure: no I/O, no clock. Shape::

    serving, problems = merge_discovered(static_cfg, {"llm": (node, ...)})   # SentinelConfig, (str, ...)
    d = diff_node_sets(current, desired)    # NodeSetDiff: added, removed, readdressed, changed
    cfg = without_nodes(cfg, {"pod-a"})     # the config less those node ids

Rules: static nodes win over discovered ones with the same id (any cluster); a discovered node
whose id is already taken, or whose priority would leave a gap in its cluster's priorities
(Envoy priorities run 0..N without skipping), is left out and named in ``problems``. A node whose
``address`` or ``probe_address`` changed is another server: it is removed and added again
(``readdressed``), not kept with its old health.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from xds_server.config import NodeConfig, SentinelConfig
from xds_server.config.tls import implicit_agent_plaintext

__all__ = ["NodeSetDiff", "diff_node_sets", "drop_readdressed", "merge_discovered", "node_map", "without_nodes"]


@dataclass(frozen=True, slots=True)
class NodeSetDiff:
    """Node ids, each in at most one field: ``added`` (only in desired), ``removed`` (only in
    current), ``readdressed`` (in both, address or probe address differs: remove + add),
    ``changed`` (in both, same addresses, another field differs: locality, priority, capacity,
    cluster)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    readdressed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.readdressed or self.changed)


def node_map(cfg: SentinelConfig) -> dict[str, tuple[str, NodeConfig]]:
    """Node id -> (cluster name, node) of every node in ``cfg``."""
    return {n.id: (c.name, n) for c in cfg.clusters for n in c.nodes}


def diff_node_sets(current: Mapping[str, tuple[str, NodeConfig]],
                   desired: Mapping[str, tuple[str, NodeConfig]]) -> NodeSetDiff:
    """What turns ``current`` into ``desired`` (both node id -> (cluster, node)); ids in the
    order of ``desired`` (``removed``: of ``current``)."""
    added = tuple(i for i in desired if i not in current)
    removed = tuple(i for i in current if i not in desired)
    readdressed, changed = [], []
    for i, (cluster, n) in desired.items():
        if i not in current:
            continue
        oc, o = current[i]
        if (o.address, o.probe_address) != (n.address, n.probe_address):
            readdressed.append(i)
        elif (oc, o) != (cluster, n):
            changed.append(i)
    return NodeSetDiff(added, removed, tuple(readdressed), tuple(changed))


def merge_discovered(static: SentinelConfig,
                     found: Mapping[str, Sequence[NodeConfig]]) -> tuple[SentinelConfig, tuple[str, ...]]:
    """``static`` with each cluster's discovered nodes (cluster name -> nodes, in source order)
    appended after its static ones; returns the config and the problems (one line per node left
    out, naming cluster, node id and reason). Clusters not in ``static`` are ignored (named in
    problems). Without an explicit ``tls.agents.mode`` a node whose probe address is not loopback
    is left out (:func:`~xds_server.config.tls.implicit_agent_plaintext`, the static nodes' rule).
    Not re-validated: every node was valid on its own and the rules above keep the cluster-level
    invariants (unique ids, contiguous priorities)."""
    problems: list[str] = []
    taken = {n.id: c.name for c in static.clusters for n in c.nodes}
    names = {c.name for c in static.clusters}
    problems += [f"discovery for unknown cluster {name!r} ignored" for name in found if name not in names]
    clusters = []
    for c in static.clusters:
        extra = list(found.get(c.name, ()))
        if not extra:
            clusters.append(c)
            continue
        fresh: list[NodeConfig] = []
        for n in extra:
            plain = None if n.probe_address is None else implicit_agent_plaintext(static.tls, n.probe_address)
            if plain:
                problems.append(f"cluster {c.name!r}: discovered node {n.id!r} left out: probe address {plain}")
                continue
            owner = taken.get(n.id)
            if owner is not None:
                where = "this cluster" if owner == c.name else f"cluster {owner!r}"
                problems.append(f"cluster {c.name!r}: discovered node {n.id!r} left out: id already "
                                f"used in {where}")
                continue
            taken[n.id] = c.name
            fresh.append(n)
        fresh, gaps = _contiguous(c.nodes, fresh)
        problems += [f"cluster {c.name!r}: discovered node {n.id!r} left out: priority {n.priority} "
                     f"leaves a gap (priorities run 0..N without skipping)" for n in gaps]
        clusters.append(c.model_copy(update={"nodes": [*c.nodes, *fresh]}) if fresh else c)
    return static.model_copy(update={"clusters": clusters}), tuple(problems)


def _contiguous(static: Iterable[NodeConfig], extra: list[NodeConfig]) -> tuple[list[NodeConfig], list[NodeConfig]]:
    """Split ``extra`` into the nodes whose priority lies in the run 0..k that all priorities of
    ``static`` + ``extra`` fill without a gap, and the rest."""
    prios = {n.priority for n in static} | {n.priority for n in extra}
    top = -1
    while top + 1 in prios:
        top += 1
    return [n for n in extra if n.priority <= top], [n for n in extra if n.priority > top]


def without_nodes(cfg: SentinelConfig, ids: Iterable[str]) -> SentinelConfig:
    """``cfg`` without the nodes of those ids (their clusters stay, possibly empty)."""
    gone = set(ids)
    if not gone:
        return cfg
    return cfg.model_copy(update={"clusters": [
        c.model_copy(update={"nodes": [n for n in c.nodes if n.id not in gone]}) for c in cfg.clusters]})


def drop_readdressed(declared: SentinelConfig, leaving: Mapping[str, tuple], serving: SentinelConfig,
                     new: SentinelConfig) -> tuple[SentinelConfig, dict[str, tuple], tuple[str, ...]]:
    """The reload path's first step when nodes changed address: ``(declared, leaving)`` (the
    accepted config, node id -> (cluster, node) still draining) without every node that
    ``serving`` (what runs now) and ``new`` both have under another address or probe address,
    and those ids. Serving the result drops them, so ``new`` adds them back COLD."""
    gone = diff_node_sets(node_map(serving), node_map(new)).readdressed
    if not gone:
        return declared, dict(leaving), ()
    return (without_nodes(declared, gone), {i: v for i, v in leaving.items() if i not in gone}, gone)
