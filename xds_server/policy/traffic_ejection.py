"""Fleet-wide passive ejection from real traffic (LRS). Pure: evidence in, verdicts out.

Every Envoy reports each node's real requests (:mod:`xds_server.load`); summed over all of them a
node that fails real requests while its probes pass is seen long before any one Envoy's own
outlier detection could (5 consecutive 5xx *per Envoy*, or 100 requests per Envoy and interval).

**Judged on counts, not ratios.** A routed node with at least ``min_requests`` completed in the
window is a candidate when its failures are significant: the chance of seeing this many failures
or more from a node failing at its peers' pooled rate plus ``tolerance`` is at most
``confidence_p`` (:func:`failure_p_value`, a one-sided binomial tail). The peers are the other
routed nodes with volume, pooled (errored / completed over all of them), so a node is compared with
what the same requests did elsewhere; with no such peer the rate is ``tolerance`` alone. What this
changes from ratio rules: 1 failure in 10 among peers at 100 % is p = 0.18 against a 2 % rate, not
"below the mean"; a 1 %-failing node is never ejected at any volume; a node failing 35 % of its
requests is ejected once ~10 of them were seen.

**Failing alike is the requests' fault.** When more than ``cluster_failure_share`` of the nodes with
volume in the cluster, or in one priority, each fail significantly above ``tolerance`` alone (the
same test against a 0 % baseline), the nodes are failing alike: a query of death, a bad model push,
a dependency they share. None of them is ejected for traffic (it would move the same requests onto
the next node and empty the cluster); :attr:`TrafficVerdicts.cluster_failure` names the scope and
the share, and the control plane raises one ``cluster_failure`` event until the share falls. A
failure confined to one locality while another serves the same requests is the locality's nodes:
they are compared with their peers and ejected under the cap. Envoy's outlier detection stays the
second line (docs/real-traffic.md: its settings).

Corroboration: with ``min_reporters`` above 1, a candidate is ejected only when at least that many
distinct reporters (Envoy node ids, each through ``tls.node_allow``) saw its requests fail in the
window; otherwise it is held, naming who did. One reporter, forged or confused, then ejects
nothing. The reason of an ejection names the reporters that saw failures and the test's numbers.

Candidates are ejected most significant first while the cluster's ejected nodes (any cause) stay
within ``max_ejection_percent`` (:class:`~xds_server.config.HealthConfig`); the rest are held
back. An ejection goes through the health model (signal ``real traffic failing``,
:class:`~xds_server.health.records.TrafficFailing`): UNHEALTHY, then the same half-open probation
and ramp as every other cause once its probes have been clean for the clean period. Evidence
counts only from when the node entered its current state, so the errors that ejected it do not
eject it again as soon as it is back in PROBATION.

A node whose own evidence says it is busy (DEGRADED by load rather than by a failure, REFUSING, or
a probe timeout with progress not judged yet) is held, not ejected: its errors are Envoy's per-try
timeouts of requests queued behind a long prefill, load that weights and shedding answer, and a
busy node is never taken for a dead one. Once it is HEALTHY again its evidence counts from then.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from xds_server.config import TrafficEjectionConfig
from xds_server.health.records import ROUTED_STATES, NodeHealth, NodeState

__all__ = ["ClusterFailure", "Evidence", "TrafficVerdicts", "failure_p_value", "traffic_verdicts"]


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
    def failure_ratio(self) -> float:
        return self.errored / self.completed if self.completed else 0.0


@dataclass(frozen=True, slots=True)
class ClusterFailure:
    """Most nodes with volume in ``scope`` (``cluster`` or ``priority N``) fail alike: ``failing``
    of ``nodes`` each fail significantly; ``pooled_ratio`` is their pooled failure share (0..1)."""

    scope: str
    failing: int
    nodes: int
    pooled_ratio: float

    def describe(self) -> str:
        return (f"{self.failing} of {self.nodes} nodes with traffic in the {self.scope} fail real requests alike "
                f"({self.pooled_ratio * 100:.0f} % of their requests failed): the requests are failing, not the "
                "nodes; none ejected for traffic")


@dataclass(frozen=True, slots=True)
class TrafficVerdicts:
    """``eject``: node id -> reason (the evidence named); ``held``: node id -> why not ejected;
    ``cluster_failure``: the scopes where most nodes fail alike (empty: none)."""

    eject: Mapping[str, str]
    held: Mapping[str, str]
    cluster_failure: tuple[ClusterFailure, ...] = field(default=())


def failure_p_value(errored: int, completed: int, rate: float) -> float:
    """P(X >= ``errored``) for X ~ Binomial(``completed``, ``rate``): the chance that a node
    failing each request with probability ``rate`` (0..1) shows this many failures or more. Exact
    (terms summed from ``errored`` up until they stop mattering); 1.0 when ``errored`` is 0."""
    if errored <= 0:
        return 1.0
    if errored > completed:
        return 0.0
    if rate <= 0.0:
        return 0.0
    if rate >= 1.0:
        return 1.0
    n, k = completed, errored
    if k <= n * rate:  # at or below the mean: not evidence; the tail is at least ~1/2
        return min(1.0, 1.0 - _cdf_below(k, n, rate))
    term = math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                    + k * math.log(rate) + (n - k) * math.log1p(-rate))
    total, odds = term, rate / (1.0 - rate)
    for j in range(k, n):
        term *= (n - j) / (j + 1) * odds
        total += term
        if term < total * 1e-12:
            break
    return min(1.0, total)


def _cdf_below(k: int, n: int, rate: float) -> float:
    """P(X < k) for X ~ Binomial(n, rate), k at or below the mean (summed from 0 up)."""
    log_term = n * math.log1p(-rate)
    total, odds = 0.0, rate / (1.0 - rate)
    term = math.exp(log_term)
    for j in range(k):
        total += term
        term *= (n - j) / (j + 1) * odds
    return total


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


def _failing_alike(volume: Mapping[str, Evidence], priority: Mapping[str, int],
                   cfg: TrafficEjectionConfig) -> tuple[set[str], tuple[ClusterFailure, ...]]:
    """The nodes in scopes where most nodes fail alike, and those scopes (module docstring)."""
    failing = {nid for nid, ev in volume.items()
               if failure_p_value(ev.errored, ev.completed, cfg.tolerance) <= cfg.confidence_p}
    scopes: list[tuple[str, list[str]]] = [("cluster", list(volume))]
    prios = sorted({priority.get(nid, 0) for nid in volume})
    if len(prios) > 1:
        scopes += [(f"priority {p}", [nid for nid in volume if priority.get(nid, 0) == p]) for p in prios]
    alike: set[str] = set()
    found: list[ClusterFailure] = []
    for scope, members in scopes:
        bad = [nid for nid in members if nid in failing]
        if len(members) >= 2 and len(bad) > len(members) * cfg.cluster_failure_share and not set(bad) <= alike:
            err = sum(volume[nid].errored for nid in bad)
            done = sum(volume[nid].completed for nid in bad)
            found.append(ClusterFailure(scope, len(bad), len(members), err / done if done else 0.0))
            alike.update(bad)
    return alike, tuple(found)


def traffic_verdicts(nodes: Sequence[tuple[str, NodeHealth, Evidence]], cfg: TrafficEjectionConfig,
                     max_ejection_percent: float, priority: Mapping[str, int] | None = None) -> TrafficVerdicts:
    """Verdicts for one cluster (see module docstring). ``nodes``: (node id, health, evidence)
    for every node of the cluster; ``priority``: node id -> its Envoy priority (absent: 0).
    Deterministic; no I/O."""
    if not cfg.enabled or not nodes:
        return TrafficVerdicts({}, {})
    volume = {nid: ev for nid, nh, ev in nodes if nh.state in ROUTED_STATES and not nh.drain.active
              and ev.completed >= cfg.min_requests}
    health = {nid: nh for nid, nh, _ in nodes}
    alike, cluster_failure = _failing_alike(volume, priority or {}, cfg)
    err_all = sum(ev.errored for ev in volume.values())
    done_all = sum(ev.completed for ev in volume.values())
    candidates: dict[str, tuple[float, str]] = {}  # node id -> (p, the test's numbers)
    for nid, ev in volume.items():
        peers_done = done_all - ev.completed
        base = (err_all - ev.errored) / peers_done if peers_done else 0.0
        rate = min(base + cfg.tolerance, 0.999)
        p = failure_p_value(ev.errored, ev.completed, rate)
        if p <= cfg.confidence_p:
            peers = f"peers' {base * 100:.1f} %" if peers_done else "no peers with traffic: 0 %"
            candidates[nid] = (p, f"{ev.failure_ratio * 100:.0f} % failed vs {peers} + {cfg.tolerance * 100:g} % "
                                  f"tolerated: p = {p:.1e} <= {cfg.confidence_p:g}")
    held: dict[str, str] = {}
    for nid, (_, why) in list(candidates.items()):
        reason = _reason(volume[nid], health[nid], why)
        if nid in alike:
            held[nid] = f"{reason}; not ejected: most nodes fail alike (cluster_failure)"
        elif _busy(health[nid]):
            held[nid] = f"{reason}; not ejected: busy (its own evidence shows load)"
        elif cfg.min_reporters > 1 and len(volume[nid].failing) < cfg.min_reporters:
            held[nid] = (f"{reason}; not ejected: failures seen by {len(volume[nid].failing)} reporter(s), "
                         f"min_reporters {cfg.min_reporters}")
        else:
            continue
        del candidates[nid]
    if not candidates:
        return TrafficVerdicts({}, held, cluster_failure)
    cap = math.floor(len(nodes) * max_ejection_percent / 100.0 + 1e-9)
    out = sum(1 for _, nh, _ in nodes if nh.state is NodeState.UNHEALTHY)
    room = max(0, cap - out)
    order = sorted(candidates, key=lambda nid: (candidates[nid][0], nid))
    eject = {nid: _reason(volume[nid], health[nid], candidates[nid][1]) for nid in order[:room]}
    for nid in order[room:]:
        held[nid] = (f"{_reason(volume[nid], health[nid], candidates[nid][1])}; not ejected: {out + len(eject)} "
                     f"of {len(nodes)} already out (max_ejection_percent {max_ejection_percent:g})")
    return TrafficVerdicts(eject, held, cluster_failure)
