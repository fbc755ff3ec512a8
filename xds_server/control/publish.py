"""What to publish and when: coalescing, the warm-up gate, fail-static hold, outlier wake-ups.

Pure: no clock reads, no timers, no I/O; every method takes the caller's monotonic time ``now_s``
(seconds). The caller (:class:`~xds_server.control.core.ControlCore`) arms the timers this asks
for and writes the results into the snapshot cache.

Shape::

    p = PublishPlanner(config)
    at = p.mark_dirty("llm", warm=True, now_s=t)    # when to call publish(); None: keep what is armed
    out = p.publish(now_s, health, fail_static, floor_s)   # -> [ClusterPublish], one per dirty cluster
    p.outlier_wake_s["llm"]                         # when an outlier ejection ends (re-mark dirty)

Rules:

- warm-up gate: a cluster is held back until none of its nodes is COLD or WARMING (``warm``),
  or until :meth:`open_gate` (the ``xds.publish.warmup_timeout`` timer) opens it;
- at most one publish per ``xds.publish.coalesce_window``: a change after a quiet window is due at
  once; changes within the window after a publish are due at its end, as one publish; the window
  is stretched to ``xds.publish.build_ratio`` x the last publish's build time (``last_build_s``,
  measured by the caller) when that is longer (a large cluster in a burst of changes);
- how soon a change is due depends on its :class:`Urgency`: a node leaving routing on hard
  evidence (lost, failed probes, engine fatal: ``URGENT``) after the window alone, not the
  stretched gap, unless the last publish already came early that way: Envoy must stop routing to
  a dead node now, and a burst of them still leaves the loop at least half of its time (an early
  build, then one after the gap, in turn; at 2,000 endpoints a build takes ~45 ms, so the gap
  alone kept a frozen node routed up to ~135 ms past its verdict). The publish armed for such a
  change (given ``published``, the caller's armed one), early or after a quiet gap, is the last
  assignment with the lost nodes UNHEALTHY, not a policy walk over the cluster (the walk is most of
  a ~45 ms build under load; at 2,000 nodes, our read of a lost stream -> the publish with the node
  out: median 55 ms when a full publish took it out after a quiet gap, 32 ms with the patch,
  benchmarks/RESULTS.md); the decision follows one gap, and at least :func:`loss_spread_s`, after the first
  such patch (:meth:`PublishPlanner.follow_up`), however many follow, also beside other clusters' decisions.
  Other changes dirty meanwhile wait for it too. A patch costs a few ms, so the next lost node is patched after the
  window or ``build_ratio`` x the last patch's time, not after the full gap (measured: the second
  node of a frozen pair waited ~170 ms for it). A change of measures alone
  (``REFRESH``: RTT, TTFT, GPU free memory) after ``xds.publish.measure_refresh``; any other
  (``NEXT``) after the gap. A sooner change moves an armed publish earlier;
- fail-static: while active, a cluster keeps the last assignment published before the burst of
  losses began (:class:`LastGoodHistory`);
- outlier ejections: one wake-up time per cluster, the earliest ejection end (+1 ms).
"""
from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from xds_server.config import ClusterConfig, HealthConfig, NodeConfig, SentinelConfig
from xds_server.control.last_good import LastGoodHistory
from xds_server.health import model as hm
from xds_server.health.pipeline import RoutingKey, leaves_routing, measures_only
from xds_server.policy import cluster_routing as hp

__all__ = ["ClusterPublish", "PublishPlanner", "Urgency", "change_urgency", "loss_spread_s"]


class Urgency(enum.Enum):
    """How soon a change must reach Envoy (module docstring)."""

    URGENT = "urgent"    # a node left routing on hard evidence: after the window
    NEXT = "next"        # a change of state or routing: after the gap
    REFRESH = "refresh"  # measures alone (weights, outlier judgement): after measure_refresh


def loss_spread_s(config: SentinelConfig) -> float:
    """How long a frozen host's streams are still being lost after its first (s): ``probe.dial_in.keepalive
    + ping_timeout`` (each is cut at its own next PING, all within a keepalive; the timeout covers our reads).
    The decision after a patch waits this long, not to hold the loop while the freeze's next nodes are
    patched (benchmarks/RESULTS.md); dialled nodes' are judged within a heartbeat interval (100 ms)."""
    d = config.probe.dial_in
    return d.keepalive.s + d.ping_timeout.s


def change_urgency(prev: RoutingKey | None, key: RoutingKey) -> Urgency:
    """How soon a node's routing key moving from ``prev`` (None: none yet) to ``key`` is due."""
    if leaves_routing(prev, key):
        return Urgency.URGENT
    return Urgency.REFRESH if measures_only(prev, key) else Urgency.NEXT


@dataclass(frozen=True, slots=True)
class ClusterPublish:
    """One cluster's assignment to publish: routing per node id, why each unrouted node is not
    routed, the cluster-policy events, ``held`` (True: fail-static kept an older routing) and
    ``patched``: when not empty, this is the last assignment with these nodes taken out (the urgent
    lane, :meth:`PublishPlanner.publish`), not a new decision of cluster policy."""

    cluster: str
    routing: Mapping[str, hm.Routing]
    why_not_routed: Mapping[str, str]
    events: tuple[hp.PolicyEvent, ...]
    held: bool = False
    patched: tuple[str, ...] = ()


class PublishPlanner:
    """Publish bookkeeping for every cluster of a config (see module docstring)."""

    def __init__(self, config: SentinelConfig, history_max_entries: int | None = None) -> None:
        self.config = config
        self._clusters = {c.name: c for c in config.clusters}
        self._timings(config)
        self.last_build_s = 0.0         # how long the last publish took to build (s; the caller's clock)
        self.gate_open: set[str] = set()
        self.dirty: set[str] = set()
        self.due_s = float("inf")       # when the publish the caller armed is due (inf: none armed)
        self.last_publish_s = float("-inf")
        self.last_early = False         # the last publish came before min_gap_s() (an URGENT change)
        self.last_patched = False       # the last publish only took lost nodes out (the urgent lane)
        self.last_patch_build_s = 0.0   # how long that took (s; the caller's clock)
        self._decide_by = float("inf")  # the decision the first patch since the last one deferred is due
        self.outliers: dict[str, dict[str, hp.OutlierState]] = {}
        self.why_not_routed: dict[str, str] = {}
        # node id -> the soft ejection the max-ejection cap held back (the node stays routed)
        self.held_back: dict[str, str] = {}
        # clusters whose last publish kept an older assignment (fail-static)
        self.fail_static_held: set[str] = set()
        # cluster -> nodes whose latest real traffic succeeds (load reports), and the silent
        # nodes the last publish kept routed because nothing else was (cluster_routing 3b)
        self.serving: dict[str, frozenset[str]] = {}
        self.kept_silent: dict[str, tuple[str, ...]] = {}
        self.outlier_wake_s: dict[str, float] = {}
        n = history_max_entries if history_max_entries is not None else config.xds.publish.fail_static_history_max
        self._history = {c: LastGoodHistory(n) for c in self._clusters}
        # cluster -> its nodes the last publish did not route / held back (the entries of
        # why_not_routed and held_back to change at its next publish, not every node's)
        self._not_routed: dict[str, tuple[str, ...]] = {}
        self._held: dict[str, tuple[str, ...]] = {}
        self._leaving: dict[str, set[str]] = {}  # cluster -> nodes of its URGENT changes since the last publish
        # node id -> (record, health config, its node_routing): recomputed only for a new record
        self._views: dict[str, tuple[hm.NodeHealth, HealthConfig, hm.NodeRouting]] = {}

    def _timings(self, config: SentinelConfig) -> None:
        self.window_s = config.xds.publish.coalesce_window.s
        self.build_ratio = config.xds.publish.build_ratio
        self.refresh_s = config.xds.publish.measure_refresh.s
        self.spread_s = loss_spread_s(config)

    def set_serving(self, cluster: str, node_ids: frozenset[str]) -> bool:
        """The nodes of ``cluster`` whose latest real traffic succeeds; True when the set changed
        (the caller marks the cluster dirty: the set decides only while nothing else is routable,
        and an unchanged assignment publishes nothing new)."""
        if self.serving.get(cluster, frozenset()) == node_ids:
            return False
        self.serving[cluster] = node_ids
        return True

    def reconfigure(self, config: SentinelConfig, dropped_nodes: list[str]) -> None:
        """Plan for ``config`` from now on (a reload): new clusters get an empty fail-static
        look-back and a closed warm-up gate, a cluster whose node set changed a fresh look-back;
        state of clusters and nodes no longer served is dropped."""
        old_ids = {c.name: [n.id for n in c.nodes] for c in self.config.clusters}
        self.config = config
        self._clusters = {c.name: c for c in config.clusters}
        self._timings(config)
        n = config.xds.publish.fail_static_history_max
        # a look-back recorded for another node set cannot be published for this one
        self._history = {name: self._history[name] if old_ids.get(name) == [x.id for x in c.nodes]
                         else LastGoodHistory(n) for name, c in self._clusters.items()}
        for name in [c for c in self.outliers if c not in self._clusters]:
            del self.outliers[name]
        for store in (self.outlier_wake_s, self.serving, self.kept_silent, self._not_routed, self._held,
                      self._leaving):
            for name in [c for c in store if c not in self._clusters]:
                del store[name]
        self.gate_open &= set(self._clusters)
        self.dirty &= set(self._clusters)
        for node_id in dropped_nodes:
            self.why_not_routed.pop(node_id, None)
            self.held_back.pop(node_id, None)
            self._views.pop(node_id, None)
            for outs in self.outliers.values():
                outs.pop(node_id, None)

    def mark_dirty(self, cluster: str, warm: bool, now_s: float, urgency: Urgency = Urgency.NEXT,
                   node_id: str | None = None) -> float | None:
        """Note that ``cluster`` must be rebuilt. ``warm``: none of its nodes is COLD/WARMING;
        ``urgency``: how soon (module docstring); ``node_id``: the node whose change it is (an
        URGENT one is remembered: the publish armed for it takes it out of the last assignment).

        Returns the time (s) at which the caller must call :meth:`publish`, when a publish has
        to be armed now (replacing one armed for later: an urgent change moves it earlier);
        None when the gate holds the cluster or the armed one is due soon enough.
        """
        if cluster not in self.gate_open:
            if not warm:
                return None
            self.gate_open.add(cluster)
        self.dirty.add(cluster)
        if urgency is Urgency.URGENT and node_id is not None:
            self._leaving.setdefault(cluster, set()).add(node_id)
        if urgency is Urgency.URGENT and self.last_patched:  # a patch after a patch: spaced by its own cost
            gap = max(self.window_s, self.build_ratio * self.last_patch_build_s)
        elif urgency is Urgency.URGENT and not self.last_early:
            gap = self.window_s
        elif urgency is Urgency.REFRESH:
            gap = max(self.refresh_s, self.min_gap_s())
        else:
            gap = self.min_gap_s()
        due = max(now_s, self.last_publish_s + gap)
        if urgency is not Urgency.URGENT and self._decide_by != float("inf"):  # the deferred decision takes it
            due = max(due, self._decide_by)
        if due >= self.due_s:
            return None
        self.due_s = due
        return due

    @property
    def scheduled(self) -> bool:
        """A publish is due and the caller has armed it."""
        return self.due_s != float("inf")

    def disarm(self) -> None:
        """The caller will not call :meth:`publish` for the armed time (no timer to arm): the next
        change asks again."""
        self.due_s = float("inf")

    def follow_up(self) -> float | None:
        """After a publish that left clusters dirty (the urgent lane patched, the rest waits): the
        time (s) the caller must arm the next :meth:`publish` for, one gap and at least
        :func:`loss_spread_s` after the first patch since the last decision (later patches never
        push the decision further); None when nothing
        is dirty or one is armed already."""
        if not self.dirty or self.scheduled:
            return None
        self.due_s = self._decide_by if self._decide_by != float("inf") else self.last_publish_s + self.min_gap_s()
        return self.due_s

    def built(self, seconds: float) -> None:
        """The caller's measure of the publish it just made (s): a full one's spaces the next
        publish (:meth:`min_gap_s`), a patch's the next patch."""
        if self.last_patched:
            self.last_patch_build_s = seconds
        else:
            self.last_build_s = seconds

    def min_gap_s(self) -> float:
        """The least time (s) from one publish to the next: the coalescing window, or
        ``publish_build_ratio`` x the last build time when longer."""
        return max(self.window_s, self.build_ratio * self.last_build_s)

    def open_gate(self, cluster: str) -> bool:
        """Open the warm-up gate (timeout). Returns True if it was closed."""
        if cluster in self.gate_open:
            return False
        self.gate_open.add(cluster)
        return True

    def _views_of(self, nodes: list[NodeConfig], health: Mapping[str, hm.NodeHealth], cfg: HealthConfig,
                  ) -> tuple[list[tuple[str, int, hm.NodeHealth]], dict[str, hm.NodeRouting]]:
        """The policy's input rows ``(node id, capacity, record)`` and each node's own routing view
        (:func:`~xds_server.health.routing.node_routing`), computed again only for a record or config
        that is not the one it was computed from (records are immutable; a steady node's stays the
        same object between publishes)."""
        cache: dict[str, tuple[hm.NodeHealth, HealthConfig, hm.NodeRouting]] = self._views
        rows, out = [], {}
        for n in nodes:
            nid = n.id
            nh = health[nid]
            rows.append((nid, n.capacity, nh))
            c = cache.get(nid)
            if c is None or c[0] is not nh or c[1] is not cfg:
                c = cache[nid] = (nh, cfg, hm.node_routing(nh, cfg))
            out[nid] = c[2]
        return rows, out

    def _lost(self, c: ClusterConfig, leaving: Collection[str], health: Mapping[str, hm.NodeHealth],
              published: Mapping[str, hm.Routing]) -> list[str]:
        """The nodes of ``leaving`` (URGENT changes) still out on hard evidence and published HEALTHY,
        in config order."""
        cfg = self.config.health
        return [n.id for n in c.nodes if n.id in leaving and (r := published.get(n.id)) is not None
                and r.health_status is hm.RoutingStatus.HEALTHY and hm.node_routing(health[n.id], cfg).hard]

    def _patch(self, c: ClusterConfig, lost: list[str], health: Mapping[str, hm.NodeHealth],
               fail_static: hp.FailStaticState, published: Mapping[str, hm.Routing], now_s: float,
               floor_s: float) -> ClusterPublish | None:
        """``c``'s last assignment with ``lost`` UNHEALTHY at full weight (as cluster policy publishes
        a node out on hard evidence), or None when the full decision must be taken now
        (:meth:`publish`)."""
        if fail_static.active or c.name in self.fail_static_held or c.name in self.kept_silent:
            return None
        out_now, routing, routed = set(lost), {}, False
        for n in c.nodes:
            r = published.get(n.id)
            if r is None:  # never published whole: decide
                return None
            if n.id in out_now:
                r = hm.Routing(hm.full_weight(n.capacity), hm.RoutingStatus.UNHEALTHY)
            routing[n.id] = r
            routed = routed or r.health_status is hm.RoutingStatus.HEALTHY
        if not routed:
            return None
        for nid in lost:
            nh = health[nid]
            self.why_not_routed[nid] = f"{nh.state.value}: {nh.reason}"
            self.held_back.pop(nid, None)
        self._not_routed[c.name] = (*self._not_routed.get(c.name, ()), *lost)
        self._history[c.name].record(now_s, routing, floor_s)
        return ClusterPublish(c.name, routing, {nid: self.why_not_routed[nid] for nid in self._not_routed[c.name]},
                              (), patched=tuple(lost))

    def history(self, cluster: str) -> LastGoodHistory:
        """The fail-static look-back of one cluster."""
        return self._history[cluster]

    def publish(self, now_s: float, health: Mapping[str, hm.NodeHealth], fail_static: hp.FailStaticState,
                floor_s: float, published: Mapping[str, hm.Routing] | None = None) -> list[ClusterPublish]:
        """Build the assignment of every dirty cluster (in config order) and clear the dirty set.

        ``health``: node id -> NodeHealth; its ``heartbeat`` records are not read (the caller may
        pass records whose folded heartbeats are not settled: ``HealthTable.unsettled``).
        ``floor_s``: the earliest fail-static look-back limit still possible (passed to
        :meth:`LastGoodHistory.record`).

        The urgent lane: ``published`` (node id -> Routing as last published) is given by the publish
        the caller armed. With it, early (before the gap, for an URGENT change) or not, a cluster
        with nodes out on hard evidence gets its last assignment with those nodes UNHEALTHY
        (``ClusterPublish.patched``): the policy walk over every node is skipped (at 2,000 endpoints
        a full publish holds the loop ~45 ms under load, a patch a few ms) and the full decision
        follows one gap and at least :func:`loss_spread_s` after the first patch (the cluster stays
        dirty: :meth:`follow_up`; an urgent change with nothing left to take out decides sooner); other
        dirty clusters wait for it too. A full decision is taken at once instead when fail-static
        holds or keeps silent nodes routed, when no node would stay routed (cluster policy's "never
        nothing because of silence" may keep one), or when there is nothing to take out (the node
        is out already): the urgent lane never publishes nothing.
        """
        self.last_early = now_s < self.last_publish_s + self.min_gap_s() - 1e-9
        patch_from = published if now_s < self._decide_by - 1e-9 else None
        self.due_s = float("inf")
        self.last_publish_s = now_s
        dirty, self.dirty = self.dirty, set()
        leaving, self._leaving = self._leaving, {}
        cfg = self.config.health
        # cluster with nodes to take out -> its patch (None: decide it now)
        patches: dict[str, ClusterPublish | None] = {}
        if patch_from is not None:
            for c in self.config.clusters:
                if c.name in dirty and (lost := self._lost(c, leaving.get(c.name, ()), health, patch_from)):
                    patches[c.name] = self._patch(c, lost, health, fail_static, patch_from, now_s, floor_s)
        taking_out = any(p is not None for p in patches.values())
        out: list[ClusterPublish] = []
        for c in self.config.clusters:
            if c.name not in dirty:
                continue
            patch = patches.get(c.name)
            if patch is not None or (taking_out and c.name not in patches):  # the rest at the decision
                self.dirty.add(c.name)
                if patch is not None:
                    out.append(patch)
                continue
            rows, views = self._views_of(c.nodes, health, cfg)
            held_before = self._held.get(c.name, ())
            decision = hp.cluster_routing(
                rows, self.outliers.get(c.name, {}), now_s, cfg, held_before,
                self.serving.get(c.name, frozenset()), self.kept_silent.get(c.name, ()), views)
            if decision.kept_silent:
                self.kept_silent[c.name] = decision.kept_silent
            else:
                self.kept_silent.pop(c.name, None)
            self.outliers[c.name] = dict(decision.outliers)
            for nid in self._not_routed.get(c.name, ()):
                self.why_not_routed[nid] = ""  # routable again, unless the update below says otherwise
            self.why_not_routed.update(decision.why_not_routed)
            self._not_routed[c.name] = tuple(decision.why_not_routed)
            for nid in held_before:
                self.held_back.pop(nid, None)
            self._held[c.name] = decision.held_back
            for nid in decision.held_back:
                out_st = decision.outliers.get(nid)
                self.held_back[nid] = (views[nid].soft_block
                                       or (out_st.reason if out_st is not None else "") or "soft ejection")
            routing: Mapping[str, hm.Routing] = dict(decision.routing)
            held = False
            hist = self._history[c.name]
            if fail_static.active:
                # Keep the last assignment published before the burst of losses began.
                good = hist.before(fail_static.burst_start_s + hm.miss_after_s(cfg))
                if good is not None:
                    routing, held = dict(good), True
            else:
                hist.record(now_s, routing, floor_s)
            if held:
                self.fail_static_held.add(c.name)
            else:
                self.fail_static_held.discard(c.name)
            ends = [o.until_s for o in decision.outliers.values() if o.until_s > now_s]
            if ends:
                self.outlier_wake_s[c.name] = min(ends) + 0.001
            else:
                self.outlier_wake_s.pop(c.name, None)
            out.append(ClusterPublish(c.name, routing, dict(decision.why_not_routed), decision.events, held))
        self.last_patched = bool(out) and all(p.patched for p in out)
        if not self.dirty:
            self._decide_by = float("inf")
        elif any(p.patched for p in out) and self._decide_by == float("inf"):  # a patch, maybe beside decisions
            self._decide_by = now_s + max(self.min_gap_s(), self.spread_s)
        return out

