"""Where each node of a cluster sits while a shift moves a share of its traffic (pure).

Envoy splits traffic between priorities by health and overprovisioning, never by weight, so an
exact share cannot be set across priorities. While a shift is between 0 and 100 %, the target's
nodes are moved into priority 0 next to the source's priority-0 nodes, in localities of their
own, and the split is set by locality weights (Envoy's locality-weighted load balancing, which
the Cluster must enable: ``common_lb_config.locality_weighted_lb_config``). Envoy picks a locality
by weight x its healthy share first, then a host inside it, so the share is exact whatever the
LB policy while the localities are healthy.

- 0 % (pending, cancelled): the base layout (the config's priorities, or the layout a finished
  shift left), no locality weights;
- 0 < share < 100: target localities in priority 0 share ``share`` of :data:`WEIGHT_TOTAL`, the
  source's priority-0 localities the rest, each in proportion to its capacity; the source's
  lower priorities keep their order below;
- 100 % (done): the target alone in priority 0, the source's priorities below it in their order,
  no locality weights (the finished layout becomes the cluster's new base).

A target locality equal to a source locality in priority 0 gets ``sub_zone`` + :data:`TARGET_MARK`
(a locality appears once per priority). While weights are on, a node without a locality gets one
(sub_zone :data:`SOURCE_MARK` or :data:`TARGET_MARK`): Envoy 1.40 routes nothing to a locality
without a name, whatever its weight (measured: its weight reads 0 in Envoy's config dump).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["SOURCE_MARK", "TARGET_MARK", "WEIGHT_TOTAL", "Layout", "NodeSpot", "check_shiftable", "layout",
           "target_nodes"]

WEIGHT_TOTAL = 10_000
"""Sum of the locality weights in priority 0 during a shift: 0.01 % resolution."""
TARGET_MARK = "~shift-target"
SOURCE_MARK = "~shift-source"
_NO_LOCALITY = ("", "", "")

LocalityKey = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class NodeSpot:
    """One node as input: id, base priority, locality (region, zone, sub_zone), capacity."""

    id: str
    priority: int
    locality: LocalityKey
    capacity: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Output: ``priority`` and ``locality`` per node id; ``locality_weights`` per
    (priority, locality) in use, or None when locality weighting is off (0 % and 100 %)."""

    priority: Mapping[str, int]
    locality: Mapping[str, LocalityKey]
    locality_weights: Mapping[tuple[int, LocalityKey], int] | None


def target_nodes(nodes: Sequence[NodeSpot], to_kind: str, to: str, config_priority: Mapping[str, int]) -> set[str]:
    """Ids of the shift's target: the nodes whose configured priority is ``to`` (an integer
    string) or whose region is ``to``. ValueError naming the field when ``to`` names none."""
    if to_kind == "priority":
        try:
            p = int(to)
        except ValueError:
            raise ValueError(f"to: priority {to!r} is not an integer") from None
        ids = {n.id for n in nodes if config_priority.get(n.id, n.priority) == p}
        if not ids:
            raise ValueError(f"to: no node of the cluster has priority {p}")
        return ids
    ids = {n.id for n in nodes if n.locality[0] == to}
    if not ids:
        raise ValueError(f"to: no node of the cluster is in region {to!r}")
    return ids


def check_shiftable(nodes: Sequence[NodeSpot], target: set[str]) -> None:
    """ValueError naming ``to`` when a shift to ``target`` cannot move anything: the target is
    every node, or the source has no node in the base priority 0 (the target is already primary)."""
    if all(n.id in target for n in nodes):
        raise ValueError("to: the target is every node of the cluster; there is no source to shift from")
    if min(n.priority for n in nodes if n.id not in target) > min(n.priority for n in nodes):
        raise ValueError("to: the target already holds priority 0 (it is the primary); nothing to shift")


def _compress(prios: Mapping[str, int]) -> dict[str, int]:
    ranks = {p: i for i, p in enumerate(sorted(set(prios.values())))}
    return {k: ranks[p] for k, p in prios.items()}


def layout(nodes: Sequence[NodeSpot], target: set[str], share_percent: float) -> Layout:
    """The placement of every node at ``share_percent`` (clamped to 0..100) of traffic on
    ``target`` (see module docstring). Node priorities in ``nodes`` are the base layout."""
    share = min(100.0, max(0.0, share_percent))
    loc = {n.id: n.locality for n in nodes}
    if share <= 0:
        return Layout(_compress({n.id: n.priority for n in nodes}), loc, None)
    source = [n for n in nodes if n.id not in target]
    if share >= 100:
        prios = {n.id: (0 if n.id in target else n.priority + 1) for n in nodes}
        return Layout(_compress(prios), loc, None)
    top = min((n.priority for n in source), default=0)
    prios = {n.id: (0 if n.id in target else (0 if n.priority == top else n.priority + 1)) for n in nodes}
    src_locs = {n.locality for n in source if n.priority == top}
    for n in nodes:
        if n.id in target and (n.locality in src_locs or n.locality == _NO_LOCALITY):
            loc[n.id] = (n.locality[0], n.locality[1], n.locality[2] + TARGET_MARK)
        elif n.locality == _NO_LOCALITY:  # Envoy 1.40 gives a locality without a name no weight (measured)
            loc[n.id] = ("", "", SOURCE_MARK)
    prios = _compress(prios)
    cap_t: dict[LocalityKey, int] = {}
    cap_s: dict[LocalityKey, int] = {}
    for n in nodes:
        if prios[n.id] != 0:
            continue
        side = cap_t if n.id in target else cap_s
        side[loc[n.id]] = side.get(loc[n.id], 0) + n.capacity
    weights: dict[tuple[int, LocalityKey], int] = {}
    for side, part in ((cap_t, share / 100.0), (cap_s, 1.0 - share / 100.0)):
        total = sum(side.values())
        for k, cap in side.items():
            weights[(0, k)] = max(1, round(WEIGHT_TOTAL * part * cap / total))
    # every other priority gets weights too: with locality weighting on, a locality without one gets nothing
    per_prio: dict[tuple[int, LocalityKey], int] = {}
    for n in nodes:
        if prios[n.id] != 0:
            key = (prios[n.id], loc[n.id])
            per_prio[key] = per_prio.get(key, 0) + n.capacity
    weights.update(per_prio)
    return Layout(prios, loc, weights)
