"""Fleet-wide passive ejection from real traffic (LRS). Pure: evidence in, verdicts out.

Every Envoy reports each node's real requests (:mod:`xds_server.load`); summed over all of them a
node that fails real requests while its probes pass is seen long before any one Envoy's own
outlier detection could (5 consecutive 5xx *per Envoy*, or 100 requests per Envoy and interval).
A routed node is a candidate when, with at least ``min_requests`` completed in the window:

- its failure share (errored / completed) is at least ``failure_ratio``; or
- success-rate style: its success ratio is below the mean of the *other* routed nodes with volume
  minus ``stdev_factor`` x their standard deviation (leave-one-out, so one bad node in a small
  cluster does not widen the spread it is judged by), with ``min_hosts`` such nodes, and below
  the absolute ``success_floor_ratio``, so a 99 %-successful node is never ejected however
  tight the spread at high volume (envoy#37723).

Corroboration: with ``min_reporters`` above 1, a candidate is ejected only when at least that many
distinct reporters (Envoy node ids, each through ``tls.node_allow``) saw its requests fail in the
window; otherwise it is held, naming who did. One reporter, forged or confused, then ejects
nothing. The reason of an ejection names the reporters that saw failures.

Candidates are ejected worst first while the cluster's ejected nodes (any cause) stay within
``max_ejection_percent`` (:class:`~xds_server.config.HealthConfig`); the rest are held back. An
ejection goes through the health model (signal ``real traffic failing``,
:class:`~xds_server.health.records.TrafficFailing`): UNHEALTHY, then the same half-open
probation and ramp as every other cause once its probes have been clean for the clean period.
Evidence counts only from when the node entered its current state, so the errors that ejected it
do not eject it again as soon as it is back in PROBATION.

A node whose own evidence says it is busy (DEGRADED by load rather than by a failure, REFUSING, or
a probe timeout with progress not judged yet) is held, not ejected: its errors are Envoy's per-try
timeouts of requests queued behind a long prefill, load that weights and shedding answer, and a
busy node is never taken for a dead one. Once it is HEALTHY again its evidence counts from then.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xds_server.config import TrafficEjectionConfig
from xds_server.health.records import ROUTED_STATES, NodeHealth, NodeState

__all__ = ["Evidence", "TrafficVerdicts", "traffic_verdicts"]


@dataclass(frozen=True, slots=True)
class Evidence:
    """A node's real traffic over ``window_s`` (s), summed over ``reporters`` Envoys;
    ``failing``: the node ids of the Envoys that reported errors on it."""

    succeeded: int
    errored: int
    reporters: int
    window_s: float
    failing: tuple[str, ...] = ()

    @property
    def completed(self) -> int:
        return self.succeeded + self.errored

    @property
    def success_ratio(self) -> float:
        return self.succeeded / self.completed if self.completed else 1.0


@dataclass(frozen=True, slots=True)
class TrafficVerdicts:
    """``eject``: node id -> reason (the evidence named); ``held``: node id -> why not ejected."""

    eject: Mapping[str, str]
    held: Mapping[str, str]


def _reason(ev: Evidence, nh: NodeHealth, rule: str) -> str:
    probes = "probes OK" if nh.probe.consecutive_failures == 0 else \
        f"{nh.probe.consecutive_failures} probe(s) failed"
    envoys = "1 Envoy" if ev.reporters == 1 else f"{ev.reporters} Envoys"
    seen = f", failures seen by {_names(ev.failing)}" if ev.failing else ""
    return (f"real traffic: {ev.errored} of {ev.completed} requests failed in {ev.window_s:.0f} s across "
            f"{envoys}{seen} ({rule}); {probes}")


def _names(ids: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(ids[:most])
    return shown if len(ids) <= most else f"{shown} and {len(ids) - most} more"


def _busy(nh: NodeHealth) -> bool:
    """The node's own evidence says load, not failure (see module docstring)."""
    return ((nh.state is NodeState.DEGRADED and not nh.probe.degraded_not_busy) or nh.state is NodeState.REFUSING
            or nh.probe.busy_timeout_s is not None)


def traffic_verdicts(nodes: Sequence[tuple[str, NodeHealth, Evidence]], cfg: TrafficEjectionConfig,
                     max_ejection_percent: float) -> TrafficVerdicts:
    """Verdicts for one cluster (see module docstring). ``nodes``: (node id, health, evidence)
    for every node of the cluster. Deterministic; no I/O."""
    if not cfg.enabled or not nodes:
        return TrafficVerdicts({}, {})
    volume = {nid: ev for nid, nh, ev in nodes if nh.state in ROUTED_STATES and not nh.drain.active
              and ev.completed >= cfg.min_requests}
    health = {nid: nh for nid, nh, _ in nodes}
    candidates: dict[str, str] = {}
    for nid, ev in volume.items():
        fail_share = ev.errored / ev.completed
        if fail_share >= cfg.failure_ratio:
            candidates[nid] = f"failure share {fail_share * 100:.0f} % >= {cfg.failure_ratio * 100:g} %"
            continue
        others = [o.success_ratio for oid, o in volume.items() if oid != nid]
        if len(others) + 1 < cfg.min_hosts or not others or ev.success_ratio >= cfg.success_floor_ratio:
            continue
        mean = statistics.fmean(others)
        sd = statistics.pstdev(others) if len(others) > 1 else 0.0
        threshold = mean - cfg.stdev_factor * sd
        if ev.success_ratio < threshold:
            candidates[nid] = (f"success {ev.success_ratio * 100:.1f} % < peers' {mean * 100:.1f} % - "
                               f"{cfg.stdev_factor:g} sd ({threshold * 100:.1f} %)")
    busy = {nid: f"{_reason(volume[nid], health[nid], why)}; not ejected: busy (its own evidence shows load)"
            for nid, why in candidates.items() if _busy(health[nid])}
    if cfg.min_reporters > 1:
        busy.update({nid: f"{_reason(volume[nid], health[nid], why)}; not ejected: failures seen by "
                          f"{len(volume[nid].failing)} reporter(s), min_reporters {cfg.min_reporters}"
                     for nid, why in candidates.items()
                     if nid not in busy and len(volume[nid].failing) < cfg.min_reporters})
    for nid in busy:
        del candidates[nid]
    if not candidates:
        return TrafficVerdicts({}, busy)
    cap = math.floor(len(nodes) * max_ejection_percent / 100.0 + 1e-9)
    out = sum(1 for _, nh, _ in nodes if nh.state is NodeState.UNHEALTHY)
    room = max(0, cap - out)
    order = sorted(candidates, key=lambda nid: (volume[nid].success_ratio, nid))
    eject = {nid: _reason(volume[nid], health[nid], candidates[nid]) for nid in order[:room]}
    held = {nid: (f"{_reason(volume[nid], health[nid], candidates[nid])}; not ejected: {out + len(eject)} of "
                  f"{len(nodes)} already out (max_ejection_percent {max_ejection_percent:g})")
            for nid in order[room:]}
    return TrafficVerdicts(eject, {**held, **busy})
