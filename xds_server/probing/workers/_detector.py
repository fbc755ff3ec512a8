"""The per-node detector a probe worker runs: the health model for its share of the nodes,
reporting only changes. Pure: observations and a time argument in, reports out; no I/O.

Shape::

    d = Detector(health_cfg)
    d.add("gpu-a", mirror=nh, kept=None, now_s=t, grace_s=3.0)   # the main process's copy
    next_tick_s = d.observe("gpu-a", HeartbeatObserved(...), t)   # the ProbeSession sink
    if d.urgent: send(d.take(full=False))                         # state changes: at once
    every report interval: send(d.take(full=True))                # plus telemetry-only changes

Every observation goes through :func:`xds_server.health.model.step` here, as it would in the
main process (heartbeat freshness, phi suspicion, stall, probes, ramps); a steady node's
repeated heartbeat is folded in place (:class:`~xds_server.health.beats.BeatRun`), as in the
main process's core. A step is *urgent*
when it made transitions, changed the reason, flipped a fail-static input (a miss counted or cleared, the stream
closed or reopened), changed the ejection record or changed the node's routing key
(:func:`~xds_server.health.pipeline.routing_key`) or its queue level (seed 002's ``queue_*`` events,
which the main process records from what it adopts); urgent nodes are reported at the next
:meth:`take`. Other changes (load, RTT inside its bucket, GPU memory, heartbeat counts) wait for
a full take.

Handover: ``add`` starts a node from the main process's copy. A node that was not COLD gets a
virtual last heartbeat ``grace_s`` in the future (no miss is counted before then, so a
replaced worker's nodes are not ejected while it re-dials) and its first real heartbeat is not
an inter-arrival sample (the phi estimate keeps the history the main process last got: the
estimate itself is never urgent, it travels with the node's next material report). ``kept`` is the state-file state
resumed at the first heartbeat (:func:`~xds_server.health.pipeline.resume_kept`).
"""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

from xds_server.config import HealthConfig
from xds_server.health import model as hm
from xds_server.health.pipeline import advance, probe_result_key, routing_key
from xds_server.health.queue_levels import queue_level

__all__ = ["Detector", "NodeReport"]


@dataclass(frozen=True, slots=True)
class NodeReport:
    """One node's health as the worker's model has it, with the transitions since the last report."""

    node_id: str
    health: hm.NodeHealth
    events: tuple[hm.Event, ...] = ()


class _Node:
    """One node's model in the worker. ``nh`` settles a run of folded heartbeats (``run``,
    :class:`~xds_server.health.beats.BeatRun`) on read; setting it ends the run."""

    __slots__ = ("_nh", "events", "handover", "kept", "key", "run", "sent")

    def __init__(self, nh: hm.NodeHealth, kept: hm.NodeHealth | None = None, handover: bool = False,
                 key: tuple | None = None, sent: tuple | None = None) -> None:
        self._nh = nh
        self.run: hm.BeatRun | None = None
        self.kept = kept
        self.handover = handover      # the next heartbeat is the first since add(): no gap sample
        self.key = key                # routing key as last reported
        self.sent = sent              # _material() as last reported
        self.events: list[hm.Event] = []

    @property
    def nh(self) -> hm.NodeHealth:
        if self.run is not None:
            self._nh, self.run = self.run.settled(), None
        return self._nh

    @nh.setter
    def nh(self, nh: hm.NodeHealth) -> None:
        self._nh, self.run = nh, None

    def material(self) -> tuple:
        """:func:`_material` of the node; a run's base has the settled record's (a fold moves
        only the last arrival and the phi estimate, which it leaves out)."""
        return _material(self._nh if self.run is None else self.run.base)


def _flags(nh: hm.NodeHealth) -> tuple[bool, bool]:
    """The fail-static inputs: a miss counted, the stream closed."""
    return nh.heartbeat.consecutive_misses > 0, nh.heartbeat.stream_closed


def _material(nh: hm.NodeHealth) -> tuple:
    """What the main process shows or decides on, without what moves at every heartbeat (the
    last arrival, the phi estimate; the progress time rounded to 1 s)."""
    e, hb = nh.engine, nh.heartbeat
    progress = None if e.progress_at_s is None else round(e.progress_at_s)
    return (nh.state, nh.reason, hb.consecutive_misses, hb.stream_closed, hb.suspicion_clears, nh.rtt,
            nh.probe, dataclasses.replace(e, progress_at_s=progress), nh.ejection, nh.ramp)


class Detector:
    """The health model of one worker's nodes. ``urgent``: a node has a change to report now.
    ``heartbeats`` / ``probe_results``: counts since the last full take (per node id; per
    (node id, kind, outcome), as :class:`~xds_server.process.counters.Counters` keeps them)."""

    def __init__(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        # wall clock - loop clock (s) when ramps are anchored to Unix time (xds.ramp_anchor); None: not
        self.wall_offset_s: float | None = None
        self.nodes: dict[str, _Node] = {}
        self.urgent = False
        self._urgent: set[str] = set()
        self._touched: set[str] = set()
        self.heartbeats: collections.Counter[str] = collections.Counter()
        self.probe_results: collections.Counter[tuple[str, str, str]] = collections.Counter()

    def add(self, node_id: str, mirror: hm.NodeHealth | None, kept: hm.NodeHealth | None,
            now_s: float, grace_s: float) -> None:
        """Watch ``node_id`` from the main process's copy ``mirror`` (None: a new node, COLD)."""
        nh = mirror if mirror is not None else hm.initial(node_id, now_s)
        handover = nh.state is not hm.NodeState.COLD
        if handover:
            hb = nh.heartbeat
            nh = dataclasses.replace(nh, heartbeat=hm.Heartbeats(now_s + grace_s, 0, False, hb.arrivals,
                                                                  hb.suspicion_clears))
        else:
            nh = dataclasses.replace(nh, heartbeat=hm.Heartbeats(arrivals=nh.heartbeat.arrivals))
        self.nodes[node_id] = _Node(nh, kept, handover, routing_key(nh, self.cfg), _material(nh))
        self._touched.add(node_id)

    def remove(self, node_id: str) -> None:
        """Forget ``node_id`` (its unsent changes too)."""
        self.nodes.pop(node_id, None)
        self._urgent.discard(node_id)
        self._touched.discard(node_id)
        self.heartbeats.pop(node_id, None)

    def observe(self, node_id: str, obs: hm.Observation, now_s: float) -> float | None:
        """Step the node's model (a ProbeSession's sink). Returns when its next Tick is due."""
        n = self.nodes[node_id]
        hb = obs if type(obs) is hm.HeartbeatObserved else None  # None: another kind of observation
        if hb is not None and n.run is not None:
            due = n.run.fold(hb, now_s, self.cfg)  # a steady node's repeated heartbeat: nothing to report
            if due is not None:
                self.heartbeats[node_id] += 1
                self._touched.add(node_id)
                return due
        prev = nh = n.nh
        kept = None
        if hb is not None:
            self.heartbeats[node_id] += 1
            if n.handover:
                n.handover = False
                nh = dataclasses.replace(nh, heartbeat=dataclasses.replace(nh.heartbeat, last_s=None))
            kept, n.kept = n.kept, None
        elif isinstance(obs, hm.ProbeObserved):
            self.probe_results[(node_id, *probe_result_key(nh, obs, self.cfg, now_s))] += 1
        adv = advance(nh, obs, now_s, self.cfg, kept=kept,
                      wall_offset_s=self._wall_offset if self.wall_offset_s is not None else None)
        nh, events, step_events = adv.nh, adv.resumed, adv.events
        n.nh = nh
        if adv.steady:
            n.run = adv.run
        self._touched.add(node_id)
        if events or step_events:
            n.events.extend(events)
            n.events.extend(step_events)
            self._mark(node_id)
        elif _flags(nh) != _flags(prev) or nh.ejection is not prev.ejection or nh.reason != prev.reason:
            self._mark(node_id)
        elif (nh.state is not prev.state or nh.ramp is not prev.ramp or nh.probe is not prev.probe
              or nh.rtt is not prev.rtt or nh.engine.requests_waiting != prev.engine.requests_waiting
              or nh.engine.gpu_free_ratio != prev.engine.gpu_free_ratio):
            if routing_key(nh, self.cfg) != n.key or queue_level(nh.engine.requests_waiting, self.cfg) != \
                    queue_level(prev.engine.requests_waiting, self.cfg):  # seed 002's levels: an event each
                self._mark(node_id)
        return adv.due_s

    def _wall_offset(self) -> float:
        assert self.wall_offset_s is not None  # passed to advance only when set
        return self.wall_offset_s

    def fail_static_ended(self, burst_start_s: float, now_s: float) -> None:
        """Fleet-wide fail-static ended (decided by the main process): step every node."""
        for node_id in self.nodes:
            self.observe(node_id, hm.FailStaticEnded(burst_start_s), now_s)

    def _mark(self, node_id: str) -> None:
        self._urgent.add(node_id)
        self.urgent = True

    def take(self, full: bool) -> list[NodeReport]:
        """Reports to send: the urgent nodes; with ``full`` also every node whose material
        state changed since its last report. Clears what it returns (counts are read and
        cleared by the caller)."""
        ids = self._urgent | self._touched if full else self._urgent
        out: list[NodeReport] = []
        for node_id in ids:
            n = self.nodes.get(node_id)
            if n is None:
                continue
            mat = n.material()
            if node_id not in self._urgent and mat == n.sent:
                continue
            nh = n.nh
            n.sent, n.key = mat, routing_key(nh, self.cfg)
            out.append(NodeReport(node_id, nh, tuple(n.events)))
            n.events.clear()
        self._urgent.clear()
        if full:
            self._touched.clear()
        self.urgent = False
        return out
