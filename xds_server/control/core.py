"""The control plane's decisions: observations -> health -> assignments to publish.

:class:`ControlCore` owns the per-node :class:`~xds_server.health.model.NodeHealth`, feeds each
observation through the pure model, records events, decides fail-static and asks its
:class:`~xds_server.control.publish.PublishPlanner` what to publish and when. It does no I/O: time
comes from the injected :class:`~xds_server.process.clock.Clock` (timers included), and each
assignment is handed to ``on_publish`` (the server writes it into the snapshot cache). With a
:class:`~xds_server.process.clock.ManualClock` it runs without an event loop.

Shape::

    core = ControlCore(config, clock, on_publish=lambda cp: ...)
    core.begin()                                   # nodes COLD, warm-up timer armed
    next_tick_s = core.observe("gpu-a", HeartbeatObserved(...), clock.now())
    core.drain("gpu-a", True, "maintenance")       # publishes at once
    core.end()                                     # a parked decision handed over, every timer cancelled
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Sequence

from xds_server.config import NodeConfig, SentinelConfig
from xds_server.control.events import EventLog
from xds_server.control.node_table import HealthTable
from xds_server.control.publish import ClusterPublish, PublishPlanner, Urgency, change_urgency
from xds_server.control.publish_turns import PublishTurns
from xds_server.control.wakes import OutlierWakes
from xds_server.health import model as hm
from xds_server.health.pipeline import (
    Advanced,
    RoutingKey,
    advance,
    probe_result_key,
    routing_key,
    same_routing_inputs,
)
from xds_server.health.queue_levels import QueueWatch
from xds_server.policy import cluster_routing as hp
from xds_server.policy.silence_starts import SilenceStarts
from xds_server.process.clock import Clock
from xds_server.process.counters import Counters

__all__ = ["ControlCore"]

log = logging.getLogger(__name__)

_NOT_WARM = (hm.NodeState.COLD, hm.NodeState.WARMING)


class ControlCore:
    """Health state, events, fail-static and publish scheduling for every node of a config.

    Readable state: ``health`` (node id -> NodeHealth), ``routing`` (node id -> Routing as last
    published), ``fail_static``, ``planner`` (gate, why-not-routed), ``events``, ``counters``,
    ``node_cfg``, ``node_cluster``. ``on_publish(ClusterPublish)`` is called once per cluster
    publish, after ``routing`` was updated.
    """

    def __init__(self, config: SentinelConfig, clock: Clock,
                 on_publish: Callable[[ClusterPublish], None] | None = None,
                 counters: Counters | None = None,
                 forward_fail_static_end: Callable[[float], Collection[str]] | None = None) -> None:
        self.config = config
        self.clock = clock
        self.on_publish = on_publish
        self.counters = counters if counters is not None else Counters()
        self.events = EventLog(config.admin.events_buffer, self.counters, config.admin.event_reason_max_chars)
        self.node_cluster: dict[str, str] = {}
        self.node_cfg: dict[str, NodeConfig] = {}
        for cname, n in config.nodes():
            self.node_cluster[n.id] = cname
            self.node_cfg[n.id] = n
        self._cluster_nodes = {c.name: [n.id for n in c.nodes] for c in config.clusters}
        self.health = HealthTable()
        self.routing: dict[str, hm.Routing] = {}
        self.fail_static = hp.FailStaticState()
        self._counted_silent = SilenceStarts()  # nodes hp.counted_silent: the walk's lower bound
        self.planner = PublishPlanner(config)
        self._keys: dict[str, RoutingKey] = {}
        self._wakes = OutlierWakes(clock, self.mark_dirty)
        self._turns = PublishTurns(clock, lambda: self.publish(True), self._finish, self._open_all_gates)
        self._running = False
        self.started_s = 0.0
        self.restored: dict[str, hm.NodeHealth] = {}  # resumed at the node's first heartbeat
        # until then (monotonic s) a kept state is still given to a node added later (discovery)
        self.restored_until_s = float("-inf")
        self.forward_fail_static_end = forward_fail_static_end  # probe workers: burst start -> ids forwarded
        self._steady_lane = True  # observe's steady-heartbeat lane (tests turn it off to compare)
        self.steady_beats = 0     # heartbeats that took it
        self.queues = QueueWatch()  # seed 002's queue levels, judged on each node's own telemetry

    # -- lifecycle ---------------------------------------------------------------------------

    def begin(self) -> None:
        """Every node COLD at ``clock.now()``; arm the warm-up timeout (``xds.publish.warmup_timeout``)."""
        now = self.clock.now()
        self.started_s = now
        for node_id in self.node_cfg:
            self.health[node_id] = hm.initial(node_id, now)
        self._running = True
        self._turns.open_gates_at(now + self.config.xds.publish.warmup_timeout.s)
        # A cluster without nodes is warm at once (no node can leave COLD to mark it): publish it
        # now, not at the warm-up timeout.
        for name, ids in self._cluster_nodes.items():
            if not ids:
                self.mark_dirty(name)

    def end(self) -> None:
        """Hand a parked decision over, cancel every timer; later observations still update state but
        schedule nothing."""
        self._running = False
        self._turns.end()
        self._wakes.cancel_all()

    # -- observations -> health ----------------------------------------------------------------

    def observe(self, node_id: str, obs: hm.Observation, now_s: float) -> float | None:
        """Feed one observation for a node (from probe sources and the admin API), through the
        per-node pipeline the probe workers run too (:func:`~xds_server.health.pipeline.advance`).

        Returns when the node's next :class:`~xds_server.health.model.Tick` is due (the clock's
        monotonic time, s), or None. KeyError for a node id not in the config.
        """
        cfg = self.config.health
        beat = type(obs) is hm.HeartbeatObserved
        steady_lane = self._steady_lane and not self.fail_static.active
        if beat and steady_lane and (run := self.health.runs.get(node_id)) is not None:
            due = run.fold(obs, now_s, cfg)  # type: ignore[arg-type]  # beat: obs is a heartbeat
            if due is not None:  # a steady node's repeated heartbeat: folded into its run
                self.counters.heartbeats[node_id] += 1
                self.steady_beats += 1
                return due
        prev = self.health[node_id]
        if beat:
            self.counters.heartbeats[node_id] += 1
        elif isinstance(obs, hm.ProbeObserved):
            self.counters.probe_results[(node_id, *probe_result_key(prev, obs, cfg, now_s))] += 1
        kept = self.restored.pop(node_id, None) if beat else None
        adv = advance(prev, obs, now_s, cfg, kept=kept, steady_lane=steady_lane and kept is None,
                      wall_offset_s=self._wall_offset_s if self.config.xds.ramp_anchor == "wall_clock" else None)
        if adv.steady:
            self._steady(node_id, prev, adv)
        else:
            for ev in adv.resumed:
                self._transition(self.node_cluster[node_id], ev)
            self._settle(node_id, prev, adv.nh, adv.events, now_s)
        return adv.due_s

    def _wall_offset_s(self) -> float:
        """Unix time - monotonic time (s), to ms: where ramps are anchored (``xds.ramp_anchor``)."""
        return round(self.clock.wall() - self.clock.now(), 3)

    def _steady(self, node_id: str, prev: hm.NodeHealth, adv: Advanced) -> None:
        """Store a quiet heartbeat's record (:attr:`Advanced.steady`): it changed no state, ramp, miss count
        or stream record, so of :meth:`_settle` only the routing key and the queue level are left; its run
        folds the node's next repeated heartbeats (:class:`~xds_server.control.node_table.HealthTable`)."""
        nh = adv.nh
        self.health[node_id] = nh
        if adv.run is not None:
            self.health.runs[node_id] = adv.run
        self.steady_beats += 1
        self._queue_level(node_id, prev, nh)
        if not (node_id in self._keys and same_routing_inputs(prev, nh)):
            self._rekey(node_id, nh, self.node_cluster[node_id])

    def adopt(self, node_id: str, nh: hm.NodeHealth, events: list[hm.Event], now_s: float) -> None:
        """Take a node's health as a probe worker's model decided it (with the transitions since
        its last report): events recorded, ejections counted, cluster marked dirty when its
        routing key changed, fail-static checked. The drain record stays this process's (the
        operator's overlay is decided here); a node whose heartbeats flow is kept with
        ``heartbeat.last_s`` None (the worker watches its freshness; fail-static reads only
        silent nodes' last heartbeats). Ignored for a node no longer in the config."""
        prev = self.health.get(node_id)
        if prev is None:
            return
        hb = nh.heartbeat
        if hb.consecutive_misses == 0 and not hb.stream_closed and hb.last_s is not None:
            hb = dataclasses.replace(hb, last_s=None)
        nh = dataclasses.replace(nh, heartbeat=hb, drain=prev.drain)
        if nh.state is not hm.NodeState.COLD:
            self.restored.pop(node_id, None)
        self._settle(node_id, prev, nh, events, now_s)

    def _settle(self, node_id: str, prev: hm.NodeHealth, nh: hm.NodeHealth,
                events: Sequence[hm.Event], now_s: float) -> None:
        """Store a node's new health: events, ejection counts, dirty cluster, fail-static.
        ``prev``: the health this step started from (what the node's routing key was last
        computed from)."""
        self.health[node_id] = nh
        cluster = self.node_cluster[node_id]
        self._queue_level(node_id, prev, nh)
        for ev in events:
            self._transition(cluster, ev)
            if ev.to_state is hm.NodeState.UNHEALTHY and nh.ejection.cause is not None:
                self.counters.ejections[(node_id, nh.ejection.cause.value)] += 1
        if not (node_id in self._keys and same_routing_inputs(prev, nh)):
            self._rekey(node_id, nh, cluster)
        if ((prev.heartbeat.consecutive_misses > 0) != (nh.heartbeat.consecutive_misses > 0)
                or prev.heartbeat.stream_closed != nh.heartbeat.stream_closed
                or (self.fail_static.active and self._silent_by_time(prev, now_s)
                    and not self._silent_by_time(nh, now_s))):
            # the last: a node fail-static counted as silent by time alone (its Tick not run yet)
            # is heard again; no miss count changes, but the episode may be over.
            # hp.counted_silent changes only with the first two (a heartbeat sets last_s and clears
            # both), so the set is kept here, off the quiet heartbeat's path
            added = None
            if hp.counted_silent(nh) and (start := nh.heartbeat.last_s) is not None:  # (counted: heard once)
                added = start if self._counted_silent.add(node_id, start) else None
            else:
                self._counted_silent.discard(node_id)
            self._check_fail_static(now_s, added)

    def _rekey(self, node_id: str, nh: hm.NodeHealth, cluster: str) -> None:
        """A changed routing key marks the cluster dirty, as soon as :func:`change_urgency` says."""
        key = routing_key(nh, self.config.health)
        old = self._keys.get(node_id)
        if key != old:
            self._keys[node_id] = key
            self.mark_dirty(cluster, change_urgency(old, key), node_id)

    def _queue_level(self, node_id: str, prev: hm.NodeHealth, nh: hm.NodeHealth) -> None:
        """Record a ``queue_*`` event when new engine telemetry changed the node's queue level."""
        if nh.engine is not prev.engine and (
                change := self.queues.change(node_id, nh.engine.requests_waiting, self.config.health)):
            self.events.record(self.clock.wall(), self.node_cluster[node_id], node_id, *change)

    def _silent_by_time(self, nh: hm.NodeHealth, now_s: float) -> bool:
        """Silent as :func:`~xds_server.policy.cluster_routing.fail_static` counts it by time: the last
        heartbeat at least interval + grace before ``now_s`` (s)."""
        last = nh.heartbeat.last_s
        return last is not None and not nh.heartbeat.vouched and now_s - last >= hm.miss_after_s(self.config.health)

    def drain(self, node_id: str, drain: bool, reason: str) -> None:
        """Operator drain/undrain (enters the model as an observation), published at once.

        KeyError if the node id is unknown.
        """
        if node_id not in self.node_cfg:
            raise KeyError(node_id)
        self.observe(node_id, hm.DrainRequested(drain, reason), self.clock.now())
        if self.planner.dirty:
            self.publish()  # operator actions are rare: publish now, so the answer shows the result

    def reconfigure(self, config: SentinelConfig) -> tuple[list[str], list[str]]:
        """Serve ``config`` from now on (a reload): thresholds apply at the next observation,
        nodes not known yet start COLD, nodes no longer in ``config`` are forgotten, every
        cluster is rebuilt. Returns ``(added, dropped)`` node ids. Draining a node before it is
        dropped is the caller's job (:mod:`xds_server.control.reload`)."""
        now = self.clock.now()
        self._turns.flush()  # decided for the config before
        old_ids = set(self.node_cfg)
        self.config = config
        self.node_cluster, self.node_cfg = {}, {}
        for cname, n in config.nodes():
            self.node_cluster[n.id] = cname
            self.node_cfg[n.id] = n
        self._cluster_nodes = {c.name: [n.id for n in c.nodes] for c in config.clusters}
        added = [i for i in self.node_cfg if i not in old_ids]
        dropped = [i for i in old_ids if i not in self.node_cfg]
        for node_id in added:
            self.health[node_id] = hm.initial(node_id, now)
        for node_id in dropped:
            for d in (self.health, self.routing, self.restored):
                d.pop(node_id, None)
            self.queues.forget(node_id)
        self._recount_silent()
        if now > self.restored_until_s:  # the state file is too old for a node that appears only now
            for node_id in added:
                self.restored.pop(node_id, None)
        self._keys.clear()  # thresholds may have changed: every key is computed again
        self.planner.reconfigure(config, dropped)
        if self._running and any(c.name not in self.planner.gate_open for c in config.clusters):
            self._turns.open_gates_at(now + config.xds.publish.warmup_timeout.s)
        for c in config.clusters:
            self.mark_dirty(c.name)
        return added, dropped

    def _transition(self, cluster: str, ev: hm.Event) -> None:
        self.events.record(self.clock.wall(), cluster, ev.node_id, "transition", ev.reason,
                           ev.from_state.value, ev.to_state.value)

    def fail_static_floor_s(self) -> float:
        """The earliest look-back limit a fail-static episode starting from now can use: the
        oldest last heartbeat of any node + interval + grace (-inf before any heartbeat)."""
        oldest = self.health.oldest_heartbeat_s()
        return float("-inf") if oldest is None else oldest + hm.miss_after_s(self.config.health)

    def _check_fail_static(self, now_s: float, added_s: float | None) -> None:
        """The fail-static walk, where it may change the state. ``added_s``: the start of the silence
        just counted, None if none; off, only it can complete a window (silences by time alone
        count from their Tick on: ``hp.fail_static_may_change``), so the walk runs near it only."""
        cfg = self.config.health
        if not hp.fail_static_may_change(self.fail_static, len(self.health), len(self._counted_silent), cfg):
            return
        if not self.fail_static.active and (added_s is None or not self._counted_silent.near_window(
                added_s, hp.fail_static_need(len(self.health), cfg), cfg.fail_static.window.s)):
            return
        st, evs = hp.fail_static(self.fail_static, self.health, now_s, self.config.health)
        if st == self.fail_static:
            return
        ended = self.fail_static.active and not st.active
        burst_start = self.fail_static.burst_start_s
        self.fail_static = st
        for pev in evs:
            self.events.record(self.clock.wall(), "*", "*", pev.kind, pev.reason)
        if ended:
            forwarded = set(self.forward_fail_static_end(burst_start)) if self.forward_fail_static_end else set()
            for node_id in self.health:
                if node_id in forwarded:
                    continue
                nh, events = hm.step(self.health[node_id], hm.FailStaticEnded(burst_start), now_s,
                                     self.config.health)
                self.health[node_id] = nh
                for ev in events:
                    self._transition(self.node_cluster[node_id], ev)
                self._keys[node_id] = routing_key(nh, self.config.health)
            self._recount_silent()
        for c in self.config.clusters:
            self.mark_dirty(c.name)

    def _recount_silent(self) -> None:
        self._counted_silent = SilenceStarts({node_id: nh.heartbeat.last_s for node_id, nh in self.health.items()
                                              if hp.counted_silent(nh) and nh.heartbeat.last_s is not None})

    # -- publishing ----------------------------------------------------------------------------

    def mark_dirty(self, cluster: str, urgency: Urgency = Urgency.NEXT, node_id: str | None = None) -> None:
        """Rebuild ``cluster`` at the next publish (held by the warm-up gate until warm; :class:`Urgency`;
        ``node_id``: whose change it is)."""
        # warmth only matters while the warm-up gate holds the cluster (it opens once)
        warm = cluster in self.planner.gate_open or all(
            self.health[n].state not in _NOT_WARM for n in self._cluster_nodes[cluster])
        self._arm(self.planner.mark_dirty(cluster, warm, self.clock.now(), urgency, node_id))

    def _arm(self, at: float | None) -> None:
        """Arm the planner's publish for ``at`` (None: keep what is armed)."""
        if at is not None:
            if self._running:
                self._turns.arm(at)  # armed for later: a sooner change re-arms it
            else:
                self.planner.disarm()

    def _open_all_gates(self) -> None:
        for c in self.config.clusters:
            if c.name in self.planner.gate_open:
                continue
            cold = [n.id for n in c.nodes if self.health[n.id].state in _NOT_WARM]
            log.warning("warm-up timeout: publishing %s with %d node(s) still COLD or WARMING: %s%s",
                        c.name, len(cold), ", ".join(cold[:20]), " ..." if len(cold) > 20 else "")
            self.planner.open_gate(c.name)
            self.mark_dirty(c.name)

    def publish(self, armed: bool = False) -> list[ClusterPublish]:
        """Build every dirty cluster now; hand each to ``on_publish`` (into ``routing``); (re)arm outlier wake-ups.
        ``armed``: the planner's armed publish (the timer): it may take the urgent lane (PublishPlanner.publish),
        and its full decision, if over the coalescing window, is handed over a moment later (publish_turns.py)."""
        try:
            self._turns.settle()  # a decision not handed over yet goes first
        finally:  # (a hand-over that raised: this publish does not run, the next change arms one)
            self.planner.disarm()
        now = self.clock.now()
        out = self.planner.publish(now, self.health.unsettled, self.fail_static, self.fail_static_floor_s(),
                                   self.routing if armed else None)
        decided = max(0.0, self.clock.now() - now)  # the loop's clock moves while we compute (a ManualClock's: 0)
        if armed and self._running and out and decided > self.planner.window_s and not any(p.patched for p in out):
            self.planner.built(decided)  # spaces what is armed meanwhile; the hand-over adds its own
            self._turns.park(out, decided)
        else:
            self._finish(out, decided)
        return out

    def _finish(self, out: list[ClusterPublish], decided_s: float) -> None:
        """Hand ``out`` over, arm what the planner asks next; ``decided_s`` + the hand-over space the next."""
        start = self.clock.now()
        try:
            self._hand_over(out)
        finally:
            self.planner.built(decided_s + max(0.0, self.clock.now() - start))
        self._arm(self.planner.follow_up())

    def _hand_over(self, out: list[ClusterPublish]) -> None:
        """Record each publish's events and routing, hand it to ``on_publish``, arm wake-ups."""
        wall = self.clock.wall()
        for p in out:
            for ev in p.events:
                self.events.record(wall, p.cluster, ev.node_id, ev.kind, ev.reason)
                if ev.kind == "outlier_ejected":
                    self.counters.ejections[(ev.node_id, "outlier")] += 1
            for n in self._cluster_nodes[p.cluster]:
                self.routing[n] = p.routing[n]
            if self.on_publish is not None:
                self.on_publish(p)
            if self._running:
                self._wakes.arm(p.cluster, self.planner.outlier_wake_s.get(p.cluster))

    def wake_timer_count(self) -> int:
        """Outlier wake-up timers armed (at most one per cluster)."""
        return len(self._wakes)
