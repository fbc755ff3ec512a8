"""One node's observation through the health model: the per-node pipeline that the control
core (:class:`~xds_server.control.core.ControlCore`, nodes watched in-process) and the probe
workers' detector (:mod:`xds_server.probing.workers`) both run, so the two cannot drift apart.

Shape::

    run = runs.get(node_id)                      # a steady node's folded heartbeats, if any
    due = run.fold(obs, now_s, cfg) if run ...    # a repeated quiet heartbeat: nothing else to do
    adv = advance(prev, obs, now_s, cfg, kept=kept, steady_lane=True, wall_offset_s=offset_fn)
    # adv.nh: the new record; adv.resumed + adv.events: transitions; adv.due_s: next Tick;
    # adv.run: a run to fold the next repeated heartbeats into (steady only)

Also here: the routing key cluster policy is recomputed on, the key a probe result is counted
under, and the resumption of a kept state after a restart. Pure: observations and a time
argument (the caller's monotonic clock, s) in, records out.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from xds_server.config import HealthConfig
from xds_server.health import model as hm
from xds_server.health.anchor import anchor_ramp

__all__ = ["Advanced", "RoutingKey", "advance", "leaves_routing", "measures_only", "probe_result_key",
           "resume_kept", "routing_key", "same_routing_inputs"]

RoutingKey = tuple[hm.NodeRouting, hm.NodeState, int | None, int | None, float | None]
"""What :func:`routing_key` gives: node routing, state, RTT and TTFT buckets, GPU free ratio."""


def routing_key(nh: hm.NodeHealth, cfg: HealthConfig) -> RoutingKey:
    """What cluster policy reads from a node, coarsened so noise does not trigger recomputes:
    (node routing, state, RTT and TTFT EWMA in 10 % log buckets, GPU free ratio to 0.01)."""
    nr = hm.node_routing(nh, cfg)

    def bucket(v: float | None) -> int | None:
        return None if v is None else int(math.log1p(max(v, 0.0)) / math.log(1.1))

    free = nh.engine.gpu_free_ratio
    return (nr, nh.state, bucket(nh.rtt.ewma_ms), bucket(nh.probe.ewma_ttft_ms),
            None if free is None else round(free, 2))


def leaves_routing(prev: RoutingKey | None, key: RoutingKey) -> bool:
    """A node routable by its own view under ``prev`` is out on hard evidence under ``key`` (lost,
    failed probes, engine fatal: :attr:`~xds_server.health.model.NodeRouting.hard`): cluster policy
    never holds that back, so the publish is urgent. Soft blocks and drains are not."""
    return prev is not None and prev[0].status is hm.RoutingStatus.HEALTHY and key[0].hard


def measures_only(prev: RoutingKey | None, key: RoutingKey) -> bool:
    """Only the node's measures moved between ``prev`` and ``key`` (RTT or TTFT bucket, GPU free
    ratio): its own routing view and state are the same, so only weights and outlier judgement
    can change (published at ``xds.publish.measure_refresh``)."""
    return prev is not None and prev[0] == key[0] and prev[1] is key[1]


def same_routing_inputs(prev: hm.NodeHealth, nh: hm.NodeHealth) -> bool:
    """Nothing :func:`routing_key` reads changed between ``prev`` and ``nh``: the records it
    reads are the same (immutable) values, or equal engine load and GPU memory."""
    if not (nh.state is prev.state and nh.drain is prev.drain and nh.ramp is prev.ramp
            and nh.rtt is prev.rtt and nh.probe is prev.probe):
        return False
    a, b = prev.engine, nh.engine
    return a is b or (a.requests_waiting == b.requests_waiting and a.gpu_free_ratio == b.gpu_free_ratio)


def probe_result_key(prev: hm.NodeHealth, obs: hm.ProbeObserved, cfg: HealthConfig,
                     now_s: float) -> tuple[str, str]:
    """(kind, outcome) a probe result is counted under in ``counters.probe_results`` (a token
    later than ``probes.ttft_timeout`` counts as kind TIMEOUT)."""
    outcome, _ = hm.classify_probe(prev, obs, cfg, now_s)
    kind = obs.kind
    if kind is hm.ProbeResultKind.OK and obs.ttft_ms >= cfg.probes.ttft_timeout.ms:
        kind = hm.ProbeResultKind.TIMEOUT
    return kind.value, outcome.value


def resume_kept(kept: hm.NodeHealth, prev: hm.NodeHealth, now_s: float) -> tuple[hm.NodeHealth, list[hm.Event]]:
    """The kept state of a node (from the state file) at its first heartbeat after a restart:
    its state, ejection back-off, ramp and drain, with this process's liveness records, and the
    "resumed" transition. ``prev`` unchanged (no event) when it left COLD meanwhile."""
    if prev.state is not hm.NodeState.COLD:
        return prev, []
    if prev.drain.active:  # an operator drained it since the restart
        kept = dataclasses.replace(kept, drain=prev.drain)
    ev = hm.Event(now_s, prev.node_id, prev.state, kept.state, f"resumed after restart: {kept.reason}")
    return dataclasses.replace(kept, heartbeat=prev.heartbeat, engine=prev.engine, probe=prev.probe), [ev]


@dataclass(frozen=True, slots=True)
class Advanced:
    """What :func:`advance` made of one observation.

    ``nh``: the node's new record. ``resumed``: the "resumed after restart" transition when a kept
    state was taken; ``events``: the step's transitions. ``due_s``: when the node's next Tick is
    due (monotonic s), None when none is. ``steady``: the quiet heartbeat's fast path was taken
    (no state, ramp, miss count or stream record changed); ``run``: then, a run to fold the next
    repeated heartbeats into (:class:`~xds_server.health.beats.BeatRun`), or None.
    """

    nh: hm.NodeHealth
    resumed: tuple[hm.Event, ...]
    events: tuple[hm.Event, ...]
    due_s: float | None
    steady: bool
    run: hm.BeatRun | None


def advance(prev: hm.NodeHealth, obs: hm.Observation, now_s: float, cfg: HealthConfig, *,
            kept: hm.NodeHealth | None = None, steady_lane: bool = True,
            wall_offset_s: Callable[[], float] | None = None) -> Advanced:
    """Step ``prev`` by ``obs`` at ``now_s``.

    ``kept``: a state-file state to resume, taken only by a heartbeat (:func:`resume_kept`);
    ``steady_lane``: a quiet heartbeat may take the fast path (:func:`~xds_server.health.beats.steady_heartbeat`,
    the same record :func:`~xds_server.health.rules.step` would build); ``wall_offset_s``: gives
    Unix time - monotonic time (s) when PROBATION ramps are anchored to the Unix-time grid
    (``xds.ramp_anchor: wall_clock``), None when they are not; called only when a ramp is
    entered or renewed, never on a quiet heartbeat.
    """
    hb = obs if type(obs) is hm.HeartbeatObserved else None
    resumed: list[hm.Event]
    nh, resumed = prev, []
    if kept is not None and hb is not None:
        nh, resumed = resume_kept(kept, nh, now_s)
    steady = hm.steady_heartbeat(nh, hb, now_s, cfg) if steady_lane and hb is not None and not resumed else None
    events: list[hm.Event] = []
    if steady is not None:
        nh, due = steady
    else:
        nh, events = hm.step(nh, obs, now_s, cfg)
    if wall_offset_s is not None and (nh.ramp is not prev.ramp or nh.state is not prev.state):
        # steps on Unix-time multiples of ramp_step_s, so replicas step together; a ramp kept as it
        # was in the same state is on the grid already (a resumed one is new), so no work per beat
        nh = anchor_ramp(nh, cfg.probation.ramp_step.s, wall_offset_s()) if nh.state is hm.NodeState.PROBATION else nh
    if steady is not None:
        assert hb is not None
        return Advanced(nh, (), (), due, True, hm.BeatRun.start(nh, hb, cfg))
    return Advanced(nh, tuple(resumed), tuple(events), hm.tick_due_s(nh, cfg, now_s), False, None)
