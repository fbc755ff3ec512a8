"""Cluster policy: from every node's health to the weights and statuses Envoy gets. Pure.

Per cluster (:func:`cluster_routing`):

1. each node's own view (:func:`~xds_server.health.model.node_routing`);
2. outlier ejection: a routed node whose EWMA TTFT or EWMA RTT is far above the cluster median
   (``outlier_factor`` x median and at least ``outlier_min_gap_*`` above it) is ejected for
   ``outlier.ejection``, doubling on each repeat up to ``outlier.ejection_max`` (as Envoy's
   own outlier detection grows its ejection time);
3. ``max_ejection_percent``: soft ejections (outliers, GPU memory, queue, REFUSING) are held
   back once ejected nodes would exceed that share of the cluster; hard evidence (lost
   heartbeats, failed probes, engine fatal) is never held back, since a node that cannot answer
   must not get traffic (field case fc04);
4. weight (:func:`~xds_server.health.routing.weight`) = capacity x 100 x state factor x score
   factor, integer >= 1, where the seed score (seed 000) is
   ``0.7 x EWMA RTT ms + 0.3 x (1 - GPU free ratio) x 100`` (lower is better) and the score
   factor is ``(best + slack) / (score + slack)`` clamped to [score_min_factor, 1] and quantized
   to ``score_step`` so measurement noise does not churn EDS. Unknown values are
   neutral: they take the median of the known ones (fc11).

Never nothing because of silence: when no node of a cluster would be routable and some are out
only because their agents went silent (ejected for missed heartbeats, no probe failure) while
their latest real traffic succeeds (``serving``, from the load reports), those stay routed
(``fail_static_kept`` events, one per episode): their engines answer Envoy, so an empty cluster
would refuse what they serve. They are ejected as usual once real traffic or a probe shows them
broken (a frozen host stops completing requests within one report interval, and then leaves
``serving``), or once another node is routable. Silence past ``max_ejection_percent`` is still
hard evidence: a frozen host must leave within the freeze-detection bound, before any load report
could speak for it.

Across the fleet (:func:`fail_static`): when more than ``fail_static_fraction`` of all nodes lost
their heartbeats within ``fail_static.window`` of each other (and the fleet has at least
``fail_static_min_nodes``), suspect our own network: keep publishing the last good assignment
and alert, until fewer than that share are still lost.
"""
from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from xds_server.config import HealthConfig
from xds_server.health.clocks import miss_after_s
from xds_server.health.records import SUSPICIONS, EjectionCause, NodeHealth, NodeState
from xds_server.health.routing import NodeRouting, Routing, RoutingStatus, full_weight, node_routing, weight

__all__ = [
    "ClusterDecision",
    "FailStaticState",
    "OutlierState",
    "PolicyEvent",
    "PolicyEventKind",
    "cluster_routing",
    "counted_silent",
    "fail_static",
    "fail_static_may_change",
    "fail_static_need",
    "score",
]


@dataclass(frozen=True, slots=True)
class OutlierState:
    """Outlier bookkeeping of one node: ejected until ``until_s``; ``count`` ejections so far."""

    until_s: float = 0.0
    count: int = 0
    reason: str = ""


class PolicyEventKind(enum.StrEnum):
    """What a cluster-policy event reports."""

    OUTLIER_EJECTED = "outlier_ejected"
    OUTLIER_RETURNED = "outlier_returned"
    HELD_BACK = "held_back"
    FAIL_STATIC_ON = "fail_static_on"
    FAIL_STATIC_OFF = "fail_static_off"
    KEPT_SILENT = "fail_static_kept"
    KEPT_SILENT_ENDED = "fail_static_kept_ended"


_NO_OUTLIER = OutlierState()


@dataclass(frozen=True, slots=True)
class PolicyEvent:
    """A cluster-policy decision worth an event line (outlier ejection/return, held back,
    fail-static on/off; ``node_id`` "*" for the fleet)."""

    at_s: float
    node_id: str
    kind: PolicyEventKind
    reason: str


@dataclass(frozen=True, slots=True)
class ClusterDecision:
    """Result of :func:`cluster_routing`: routing per node, why each unrouted node is not routed,
    and the outlier state of the nodes ever outlier-ejected (a node absent never was)."""

    routing: Mapping[str, Routing]
    why_not_routed: Mapping[str, str]
    outliers: Mapping[str, OutlierState]
    events: tuple[PolicyEvent, ...]
    held_back: tuple[str, ...]
    kept_silent: tuple[str, ...] = ()


def score(ewma_rtt_ms: float, gpu_free_ratio: float, cfg: HealthConfig) -> float:
    """Seed 000 score: ``0.7 x EWMA RTT ms + 0.3 x (1 - GPU free ratio) x 100``; lower is better."""
    return cfg.score.rtt_weight * ewma_rtt_ms + cfg.score.gpu_weight * (1.0 - gpu_free_ratio) * 100.0


def _outlier_metrics(cfg: HealthConfig) -> tuple[tuple[Callable[[NodeHealth], float | None], float, str], ...]:
    """(EWMA metric of a node, minimum gap above the median in ms, label) for outlier detection."""
    return ((lambda nh: nh.probe.ewma_ttft_ms, cfg.outlier.min_gap_ttft.ms, "TTFT"),
            (lambda nh: judged_rtt_ms(nh, cfg), cfg.outlier.min_gap_rtt.ms, "RTT"))


def judged_rtt_ms(nh: NodeHealth, cfg: HealthConfig) -> float | None:
    """The node's EWMA RTT (ms) once it has ``outlier.min_rtt_samples`` pings behind it, else None
    (judged as unknown, for outliers and for the score's weights alike)."""
    return nh.rtt.ewma_ms if nh.rtt.samples >= cfg.outlier.min_rtt_samples else None


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def cluster_routing(
    nodes: Sequence[tuple[str, int, NodeHealth]],
    outliers: Mapping[str, OutlierState],
    now_s: float,
    cfg: HealthConfig,
    held_before: Collection[str] = (),
    serving: Collection[str] = (),
    kept_before: Collection[str] = (),
    views: Mapping[str, NodeRouting] | None = None,
) -> ClusterDecision:
    """Routing for one cluster. ``nodes``: (node id, capacity, health). Deterministic.

    ``outliers``: the previous decision's :attr:`ClusterDecision.outliers` (node id -> state; a
    node absent has never been outlier-ejected). ``held_before``: the nodes the previous decision
    held back (``ClusterDecision.held_back``); a HELD_BACK event is given once per episode, when a
    node starts being held back, not at every recompute while it stays held (that was 4 events a
    second for one node). ``serving``: nodes whose latest real traffic succeeds (load reports);
    ``kept_before``: the silent nodes the previous decision kept routed
    (``ClusterDecision.kept_silent``). ``views``: each node's
    :func:`~xds_server.health.routing.node_routing` under ``cfg``, when the caller keeps them (a
    publish recomputes only the changed records'); computed here when None.

    One publish of a 2,000-node cluster walks it a few times, so the steps below share their
    passes: per node, what later steps read is read once.
    """
    if views is None:
        views = {nid: node_routing(nh, cfg) for nid, _, nh in nodes}
    n = len(nodes)
    events: list[PolicyEvent] = []
    why: dict[str, str] = {}
    min_rtt = cfg.outlier.min_rtt_samples

    # 1. one pass: the routable candidates (their judged RTT kept for step 4), the metrics of the
    # routed ones for step 2, hard ejections for step 3.
    candidates: list[tuple[str, int, NodeHealth, NodeRouting, float | None]] = []
    ttfts: dict[str, float] = {}
    rtts_routed: dict[str, float] = {}
    hard_n = 0
    for nid, cap_units, nh in nodes:
        view = views[nid]
        if view.status is RoutingStatus.HEALTHY:
            rt = nh.rtt
            rtt = rt.ewma_ms if rt.samples >= min_rtt else None  # judged_rtt_ms
            candidates.append((nid, cap_units, nh, view, rtt))
            if nh.state is NodeState.HEALTHY or nh.state is NodeState.DEGRADED:
                if (ttft := nh.probe.ewma_ttft_ms) is not None:
                    ttfts[nid] = ttft
                if rtt is not None:
                    rtts_routed[nid] = rtt
        elif view.hard:  # UNHEALTHY (counted against the cap) or COLD/WARMING (not counted)
            why[nid] = f"{nh.state.value}: {nh.reason}"
            if nh.state is NodeState.UNHEALTHY:
                hard_n += 1

    # 2. outlier detection against the cluster median (TTFT first: its reason wins).
    outlier_now: dict[str, str] = {}
    for vals, gap, label in ((ttfts, cfg.outlier.min_gap_ttft.ms, "TTFT"),
                             (rtts_routed, cfg.outlier.min_gap_rtt.ms, "RTT")):
        if len(vals) < cfg.outlier.min_nodes:
            continue
        med = statistics.median(vals.values())
        over = med * cfg.outlier.factor
        for nid, v in vals.items():
            if v > over and v - med >= gap and nid not in outlier_now:
                outlier_now[nid] = f"outlier: EWMA {label} {v:.0f} ms vs cluster median {med:.0f} ms"
    new_out: dict[str, OutlierState] = {}
    for nid, _, _ in nodes:
        st = outliers.get(nid)
        if st is None:
            if nid not in outlier_now:
                continue
            st = _NO_OUTLIER
        if st.until_s > now_s:
            new_out[nid] = st  # still serving its ejection time
        elif nid in outlier_now:
            dur = min(cfg.outlier.ejection.s * (2 ** st.count), cfg.outlier.ejection_max.s)
            new_out[nid] = OutlierState(now_s + dur, st.count + 1, f"{outlier_now[nid]}; ejected {dur:.0f} s")
            events.append(PolicyEvent(now_s, nid, PolicyEventKind.OUTLIER_EJECTED, new_out[nid].reason))
        elif st.reason:
            new_out[nid] = replace(st, reason="")
            events.append(PolicyEvent(now_s, nid, PolicyEventKind.OUTLIER_RETURNED, "outlier ejection time over"))
        elif st.count or st.until_s:
            new_out[nid] = st  # its count doubles the next ejection

    # 3. max ejection percent: hard ejections count first, soft ones fill the rest of the cap.
    soft: list[tuple[str, str]] = []
    for nid, _, _, view, _ in candidates:
        if view.soft_block:
            soft.append((nid, view.soft_block))
        elif (o := new_out.get(nid)) is not None and o.reason and o.until_s > now_s:
            soft.append((nid, o.reason))
    cap = math.floor(n * cfg.outlier.max_ejection_percent / 100.0 + 1e-9)
    room = max(0, cap - hard_n)
    soft.sort(key=lambda x: x[0])
    held = tuple(nid for nid, _ in soft[room:])
    for i, (nid, reason) in enumerate(soft):
        if i < room:
            why[nid] = reason
        elif nid not in held_before:
            events.append(PolicyEvent(now_s, nid, PolicyEventKind.HELD_BACK,
                                      f"{reason}; not ejected: {hard_n + min(room, len(soft))} of {n} already out "
                                      f"(max_ejection_percent {cfg.outlier.max_ejection_percent:g})"))

    # 3b. never nothing because of silence (module docstring).
    routable = [c for c in candidates if c[0] not in why]
    kept: tuple[str, ...] = ()
    if (not routable and serving) or kept_before:
        health = {nid: nh for nid, _, nh in nodes}
        if not routable and serving:
            kept = tuple(nid for nid, _, nh in nodes if nid in serving and _silent_only(nh) and not nh.drain.active)
            for nid in kept:
                del why[nid]
                if nid not in kept_before:
                    events.append(PolicyEvent(
                        now_s, nid, PolicyEventKind.KEPT_SILENT,
                        f"no node of the cluster is routable: kept routed while its agent is silent and its "
                        f"real traffic succeeds (fail-static; {health[nid].reason})"))
        for nid in kept_before:
            if nid not in kept and nid in health:
                events.append(PolicyEvent(now_s, nid, PolicyEventKind.KEPT_SILENT_ENDED,
                                          "no longer kept: another node is routable, or its agent, a probe or its "
                                          "real traffic decided"))

    # 4. weights among routable nodes from the seed score.
    rtt_mid = _median([own for c in routable if (own := c[4]) is not None]) or 0.0
    free_mid = _median([free for c in routable if (free := c[2].engine.gpu_free_ratio) is not None])
    free_unknown = free_mid if free_mid is not None else 1.0
    scores: dict[str, float] = {}
    for nid, _, nh, _, own in routable:
        gpu_free = nh.engine.gpu_free_ratio
        scores[nid] = score(rtt_mid if own is None else own, free_unknown if gpu_free is None else gpu_free, cfg)
    best = min(scores.values()) if scores else 0.0
    slack, min_factor, step = cfg.score.slack, cfg.score.min_factor, cfg.score.step
    routing: dict[str, Routing] = {}
    made: dict[tuple[int, RoutingStatus], Routing] = {}  # equal Routings are one object (immutable)
    for nid, cap_units, _ in nodes:
        view = views[nid]
        if view.status is RoutingStatus.DRAINING:
            key = (full_weight(cap_units), RoutingStatus.DRAINING)
        elif nid in kept:
            key = (full_weight(cap_units), RoutingStatus.HEALTHY)
        elif (sc := scores.get(nid)) is None:  # not routable: ejected, held out, or not routed
            key = (full_weight(cap_units), RoutingStatus.UNHEALTHY)
        else:
            sf = (best + slack) / (sc + slack) if sc + slack > 0 else 1.0
            sf = min(1.0, max(min_factor, sf))
            sf = max(min_factor, round(sf / step) * step)
            key = (weight(cap_units, view.factor, min(sf, 1.0)), RoutingStatus.HEALTHY)
        r = made.get(key)
        routing[nid] = r if r is not None else made.setdefault(key, Routing(*key))
    return ClusterDecision(routing, why, new_out, tuple(events), held, kept)


def _silent_only(nh: NodeHealth) -> bool:
    """Out only because its agent went silent: ejected for missed heartbeats (or their phi
    suspicion), with no probe failing."""
    return (nh.state is NodeState.UNHEALTHY
            and (nh.ejection.cause is EjectionCause.HEARTBEAT or nh.ejection.cause in SUSPICIONS)
            and nh.probe.consecutive_failures == 0)


@dataclass(frozen=True, slots=True)
class FailStaticState:
    """Fleet-wide fail-static state: ``active`` since ``since_s`` with ``reason``;
    ``burst_start_s`` is the last heartbeat of the first node lost in the burst."""

    active: bool = False
    since_s: float = 0.0
    reason: str = ""
    burst_start_s: float = 0.0


def fail_static(
    state: FailStaticState,
    health: Mapping[str, NodeHealth],
    now_s: float,
    cfg: HealthConfig,
) -> tuple[FailStaticState, list[PolicyEvent]]:
    """Decide fail-static from the nodes' heartbeat state (see module docstring).

    Enter when more than ``fail_static_fraction`` of all nodes are currently silent (their last
    heartbeat at least interval + grace old, the instant the model counts a miss, unless their
    transport vouches for them; or their stream closed) and their silences began
    within ``fail_static.window`` of each other; leave when fewer than that share are silent.
    """
    total = len(health)
    if total < cfg.fail_static.min_nodes:
        return (FailStaticState(), []) if state.active else (state, [])
    need = fail_static_need(total, cfg)
    limit = miss_after_s(cfg)
    silent_since = sorted(
        last for nh in health.values()
        if (last := nh.heartbeat.last_s) is not None
        and ((now_s - last >= limit and not nh.heartbeat.vouched) or nh.heartbeat.stream_closed)
    )
    events: list[PolicyEvent] = []
    if not state.active:
        window = cfg.fail_static.window.s
        for i in range(len(silent_since) - need + 1):
            if silent_since[i + need - 1] - silent_since[i] <= window:
                reason = (f"{len(silent_since)} of {total} nodes lost heartbeats within "
                          f"{cfg.fail_static.window.ms:.0f} ms: suspect the control plane's own network; "
                          "keeping the last good assignment")
                events.append(PolicyEvent(now_s, "*", PolicyEventKind.FAIL_STATIC_ON, reason))
                return FailStaticState(True, now_s, reason, silent_since[i]), events
        return state, events
    if len(silent_since) < need:
        events.append(PolicyEvent(now_s, "*", PolicyEventKind.FAIL_STATIC_OFF,
                                  f"heartbeats back ({len(silent_since)} of {total} silent): normal decisions resume"))
        return FailStaticState(), events
    return state, events


def fail_static_need(total: int, cfg: HealthConfig) -> int:
    """Silent nodes that make "more than ``fail_static_fraction``" of ``total``."""
    return math.floor(total * cfg.fail_static.fraction + 1e-9) + 1


def counted_silent(nh: NodeHealth) -> bool:
    """Silent as the model has counted it: heard at least once, and a miss counted since or its
    stream closed. Such a node is silent for :func:`fail_static` too (a miss is counted only once
    the last heartbeat is interval + grace old), so these nodes are a lower bound of its count."""
    hb = nh.heartbeat
    return hb.last_s is not None and (hb.consecutive_misses > 0 or hb.stream_closed)


def fail_static_may_change(state: FailStaticState, total: int, counted: int, cfg: HealthConfig) -> bool:
    """Whether :func:`fail_static` is worth running (its walk is O(nodes) and runs on every
    silence transition: under a mass silence, O(nodes^2)), given ``counted`` nodes
    :func:`counted_silent` of ``total``. False when:

    - active and ``counted`` alone makes the need: more are silent by time, so it stays on
      (exactly what the walk would say);
    - not active and ``counted`` is below the need: entry is judged once the model has counted
      misses for that many nodes (within one Tick of their silence; a node is ejected for
      silence only ``consecutive_misses`` Ticks after its first miss, so the entry still comes
      before the ejections it holds back). Nodes silent by time whose Tick has not run yet (a
      loop behind) count from their Tick on.
    """
    if total < cfg.fail_static.min_nodes:
        return state.active
    need = fail_static_need(total, cfg)
    return counted < need if state.active else counted >= need
