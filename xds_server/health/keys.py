"""Pure helpers over one node's health shared by the control core and the probe workers'
detector (:mod:`xds_server.probing.workers`): the routing key cluster policy is recomputed on,
the key a probe result is counted under, the resumption of a kept state after a restart.
"""
from __future__ import annotations

import dataclasses
import math

from xds_server.config import HealthConfig
from xds_server.health import model as hm

__all__ = ["RoutingKey", "probe_result_key", "resume_kept", "routing_key", "same_routing_inputs"]

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
    later than ``ttft_timeout_ms`` counts as kind TIMEOUT)."""
    outcome, _ = hm.classify_probe(prev, obs, cfg, now_s)
    kind = obs.kind
    if kind is hm.ProbeResultKind.OK and obs.ttft_ms >= cfg.ttft_timeout_ms:
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
