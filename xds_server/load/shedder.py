"""Overload shedding at each load report: the cluster's drop (:func:`~xds_server.policy.overload_drop.shed_step`)
from its routable nodes' queues and KV-cache usage and its LRS demand, and with request classes
(``lrs.shed.classes``) that drop spread over the class clusters, lowest class first
(:func:`~xds_server.policy.request_classes.class_percents`, each class's demand = its own Envoy
cluster's issued + dropped requests over ``lrs.shed.window``).

Every changed drop marks the cluster for a new assignment; the parent cluster's publish writes
its class clusters' assignments too (:func:`~xds_server.xds.resources.build_cla` with
:meth:`Shedder.cla_args` of each name).
"""
from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from xds_server.config import SentinelConfig
from xds_server.control.core import ControlCore
from xds_server.health.records import NodeState, ProbeResultKind
from xds_server.load.aggregate import LoadAggregator
from xds_server.policy.overload_drop import ShedInputs, ShedState, shed_step
from xds_server.policy.request_classes import class_percents
from xds_server.policy.slot_admission import Admission, admission_step
from xds_server.xds.resources import AdmissionArgs, DropArgs

__all__ = ["Shedder", "class_aliases", "finished_from_sessions", "kv_from_sessions"]

log = logging.getLogger(__name__)

_TTFT_SAMPLES = 512
_TTFT_KEEP_S = 600.0
_MIN_TTFT_SAMPLES = 20
_MIN_BUDGET_S = 0.05
"""The unloaded TTFT behind ``lrs.shed.ttft_budget_ratio``: the last 512 successful probes of
the cluster's routable nodes in 10 min while it was unloaded, used from 20 on; a budget of at
least 50 ms (a smaller one would shed to near idle for a wait no client notices). Ours."""

_LITTLE_WINDOW_S = 10.0
"""The window (s) over which a node's mean running count and finished rate give the time a
request runs (Little's law): ~10 samples at one evaluation per LRS report. Ours."""


def class_aliases(config: SentinelConfig) -> dict[str, str]:
    """Request-class Envoy cluster -> the configured cluster it serves (empty with classes off)."""
    cc = config.lrs.shed.classes
    if not cc.enabled:
        return {}
    return {name: c.name for c in config.clusters for _, name, _ in cc.lower_first(c.name) if name != c.name}


class Shedder:
    """Drop state per cluster (``shed``) and per class cluster (``classes``: Envoy cluster name ->
    its drop; the standard class is the cluster's own name). ``kv_usage(node id)``: the node's last
    reported KV-cache usage (0..1, None: unknown), set by the control plane."""

    def __init__(self) -> None:
        self.shed: dict[str, ShedState] = {}
        self.classes: dict[str, ShedState] = {}
        self.admission: dict[str, Admission] = {}  # cluster -> its admission by slots (limit None: off)
        self.kv_usage: Callable[[str], float | None] = lambda _node_id: None
        self.finished: Callable[[str], tuple[float, float] | None] = lambda _node_id: None
        self._inflight: dict[str, deque[tuple[float, float]]] = {}  # node -> (s, waiting + running) samples
        # node -> (heartbeat arrival s, finished count, running at the evaluation) samples
        self._finished: dict[str, deque[tuple[float, float, float]]] = {}
        self._slots: dict[str, float] = {}  # node -> the most requests seen running
        self._seen: dict[str, float] = {}  # node -> when it was last evaluated routable (s)
        # cluster -> (s, ms) of successful probes' TTFT while it was not shedding and no queue
        # stood (its unloaded TTFT, for lrs.shed.ttft_budget_ratio); node -> probes seen
        self._ttft: dict[str, deque[tuple[float, float]]] = {}
        self._probes_seen: dict[str, int] = {}

    def read_sessions(self, sessions: Mapping[str, Any]) -> None:
        """Read ``kv_usage`` (``lrs.shed.kv_saturated_ratio``) and ``finished``
        (``lrs.shed.capacity_source``) from the probe sources (node id -> source)."""
        self.kv_usage, self.finished = kv_from_sessions(sessions), finished_from_sessions(sessions)

    def _growth(self, node_id: str, inflight: float | None, now: float, window_s: float) -> float | None:
        """How fast the node's in-flight count grew over the last ``window_s`` (per s, from its
        samples at each evaluation; None: unknown or under a quarter of the window seen)."""
        q = self._inflight.setdefault(node_id, deque())
        if inflight is None:
            q.clear()
            return None
        q.append((now, inflight))
        while len(q) > 1 and q[1][0] <= now - window_s:
            q.popleft()
        t0, v0 = q[0]
        return None if now - t0 < window_s / 4 else (inflight - v0) / (now - t0)

    def _finishing(self, node_id: str, running: float | None, window_s: float
                   ) -> tuple[float | None, float | None, float | None]:
        """(requests per s the node's engine finished over the last ``window_s`` by its own
        counter, its slots, the time a request runs on it in s): each None when unknown (the
        rate also under a quarter of the window seen).

        Slots: the most requests seen running at an evaluation (a lower bound until the node is
        full, which it is whenever a request waits). The time a request runs is Little's law on
        the running set over :data:`_LITTLE_WINDOW_S`: its mean running count over its finished
        rate, true at any load. A counter that went back (an engine restart) starts the history
        and the slots afresh."""
        q = self._finished.setdefault(node_id, deque())
        got = self.finished(node_id)
        if got is None or running is None:
            q.clear()
            return None, None, None
        at, count = got
        if q and (count < q[-1][1] or at < q[-1][0]):
            q.clear()
            self._slots.pop(node_id, None)
        if running > self._slots.get(node_id, 0.0):
            self._slots[node_id] = running
        if not q or at > q[-1][0]:
            q.append((at, count, running))
        while len(q) > 1 and q[1][0] <= at - max(window_s, _LITTLE_WINDOW_S):
            q.popleft()
        # the window's start: its last sample at or before at - window_s (else the oldest)
        t0, c0, _ = next((x for x in reversed(q) if x[0] <= at - window_s), q[0])
        if at - t0 < window_s / 4:
            return None, None, None
        rate = (count - c0) / (at - t0)
        # Little's law over the long window: the running count of each sample holds until the
        # next one, whose finished count it produced (time-weighted, left end)
        lc0 = q[0][1]
        busy = sum(r * (q[k + 1][0] - t) for k, (t, _, r) in enumerate(list(q)[:-1]))
        slots = self._slots.get(node_id)
        if not slots or count <= lc0 or busy <= 0:
            return rate, slots or None, None
        return rate, slots, busy / (count - lc0)

    def _learn_ttft(self, cluster: str, routable: list[str], core: ControlCore, cfg: SentinelConfig,
                    now: float) -> float | None:
        """Record the TTFT of each routable node's newest successful probe while the cluster is
        unloaded (not shedding nor admitting by slots, no node with ``min_waiting`` waiting) and give the budget that
        ``lrs.shed.ttft_budget_ratio`` sets from their p99 (s; None: off, or under
        :data:`_MIN_TTFT_SAMPLES` in the last :data:`_TTFT_KEEP_S`)."""
        sc = cfg.lrs.shed
        if sc.capacity_source != "engines" or sc.ttft_budget_ratio is None:
            return None
        q = self._ttft.setdefault(cluster, deque(maxlen=_TTFT_SAMPLES))
        admitting = self.admission.get(cluster, Admission()).limit is not None
        quiet = self.shed.get(cluster, ShedState()).percent <= 0 and not admitting and all(
            (core.health[i].engine.requests_waiting or 0.0) < max(sc.min_waiting, 1.0) for i in routable)
        for i in routable:
            p = core.health[i].probe
            new = p.seen != self._probes_seen.get(i)
            self._probes_seen[i] = p.seen
            if new and quiet and p.last_kind is ProbeResultKind.OK and p.last_ttft_ms is not None:
                q.append((now, p.last_ttft_ms))
        while q and q[0][0] < now - _TTFT_KEEP_S:
            q.popleft()
        if len(q) < _MIN_TTFT_SAMPLES:
            return None
        ms = sorted(v for _, v in q)
        p99 = ms[min(len(ms) - 1, math.ceil(0.99 * len(ms)) - 1)]
        return max(_MIN_BUDGET_S, sc.ttft_budget_ratio * p99 / 1000.0)

    def step(self, cfg: SentinelConfig, core: ControlCore, agg: LoadAggregator, cluster: str,
             node_ids: list[str], now: float) -> None:
        """One evaluation of ``cluster`` at ``now`` (monotonic s); marks it dirty when a drop changed."""
        sc, hc = cfg.lrs.shed, cfg.health
        health = core.health
        # a node whose engine stalled (running, no progress) is being ejected: its queue is no overload
        routable = [i for i in node_ids if (r := core.routing.get(i)) is not None and r.health_status == "HEALTHY"
                    and not health[i].engine.stalled]
        ages = [None if (at := health[i].heartbeat.last_s) is None else now - at for i in routable]
        t = agg.cluster(cluster, now, sc.window.s)
        grown: list[float | None] = []
        finished: list[float | None] = []
        slots: list[float | None] = []
        service: list[float | None] = []
        admitted = 0
        for i in routable:
            e = health[i].engine
            known = e.requests_waiting is not None and e.requests_running is not None
            grown.append(self._growth(i, (e.requests_waiting or 0.0) + (e.requests_running or 0.0) if known else None,
                                      now, sc.window.s))
            rate, n_slots, run_s = self._finishing(i, e.requests_running, sc.window.s)
            self._seen[i] = now
            finished.append(rate)
            slots.append(n_slots)
            service.append(run_s)
            admitted += agg.node(cluster, i, now, sc.window.s).issued
        for i in set(node_ids) - set(routable):  # back in: its history starts afresh
            self._inflight.pop(i, None)
            self._finished.pop(i, None)
        for i in [i for i, q in self._inflight.items() if q and now - q[-1][0] > 10 * sc.window.s]:
            del self._inflight[i]  # a node no longer configured
        for i in [i for i, q in self._finished.items() if not q or now - q[-1][0] > 10 * sc.window.s]:
            del self._finished[i]
        for i in [i for i, at in self._seen.items() if now - at > _TTFT_KEEP_S]:  # routable nowhere for 10 min
            del self._seen[i]
            self._slots.pop(i, None)
            self._probes_seen.pop(i, None)
        growth = None if any(g is None for g in grown) else sum(g for g in grown if g is not None)
        learned = self._learn_ttft(cluster, routable, core, cfg, now)
        inp = ShedInputs([health[i].engine.requests_waiting for i in routable], ages,
                         (t.issued + t.dropped) / sc.window.s, t.completed / sc.window.s, t.reporters,
                         [self.kv_usage(i) for i in routable], admitted / sc.window.s, growth, routable,
                         finished, slots, service, learned)
        before = self.shed.get(cluster, ShedState())
        after = shed_step(before, inp, sc, hc.load.queue_warning, hc.load.queue_critical, now)
        admitted_was = self.admission.get(cluster, Admission())
        adm = self._admit(cfg, admitted_was, after.percent > 0, slots,
                          [health[i].engine.requests_running for i in routable], service, learned, t.reporters, now)
        self.admission[cluster] = adm
        if adm.limit is not None:  # the slots shed the excess: no random drop on top
            after = ShedState(0.0, before.flip if before.percent == 0 else not before.flip, None, adm.reason)
        self.shed[cluster] = after
        changed = after.percent != before.percent or adm.limit != admitted_was.limit
        if adm.reason != admitted_was.reason and (adm.limit is not None or admitted_was.limit is not None):
            log.warning("cluster %s: %s", cluster, adm.reason or "not admitting by slots")
        if changed:
            log.warning("cluster %s: %s", cluster, after.reason or "not shedding")
        order = sc.classes.lower_first(cluster)
        if not sc.classes.enabled:
            for _, name, _ in order:
                self.classes.pop(name, None)
        else:
            demands = [float((t := agg.demand(name, now, sc.window.s)).issued + t.dropped) for _, name, _ in order]
            percents = class_percents(after.percent, demands, [m for _, _, m in order], sc.step_percent,
                                      [self.classes.get(name, ShedState()).percent for _, name, _ in order])
            for (klass, name, _), p, d in zip(order, percents, demands, strict=True):
                was = self.classes.get(name, ShedState())
                if p != was.percent or name not in self.classes:
                    flip = was.flip if p == was.percent else not was.flip  # Envoy 1.40 applies a change so
                    self.classes[name] = ShedState(p, flip, None, f"class {klass}: {p:g} % of its {d:g} requests")
                    changed = changed or p != was.percent
        if changed:
            core.mark_dirty(cluster)

    @staticmethod
    def _admit(cfg: SentinelConfig, was: Admission, overloaded: bool, slots: list[float | None],
               running: list[float | None], service: list[float | None], learned: float | None, envoys: int,
               now: float) -> Admission:
        """The cluster's admission by slots (:func:`~xds_server.policy.slot_admission.admission_step`)
        with this config: off when ``lrs.shed.admission.slots`` is, and with request classes (each
        class has a drop of its own); the queue allowed is the one drained within
        ``admission.queue_budget_ratio`` of the queue-wait budget (``queue_wait_budget``, or the
        smaller learned one)."""
        sc = cfg.lrs.shed
        if not sc.admission.slots or sc.classes.enabled:
            return Admission()
        budget = None if sc.queue_wait_budget is None else sc.queue_wait_budget.s
        if budget is not None and learned is not None:
            budget = min(budget, learned)
        budget = None if budget is None else budget * sc.admission.queue_budget_ratio
        return admission_step(was, overloaded=overloaded, slots=slots, running=running, service_s=service,
                              budget_s=budget, envoys=envoys, release_below=sc.admission.release_below,
                              release_after_s=sc.admission.release_after.s, now_s=now,
                              explore_s=sc.admission.explore.s)

    def admission_args(self, cfg: SentinelConfig, name: str, core: ControlCore) -> AdmissionArgs | None:
        """What Envoy gets for the cluster ``name`` while it admits by slots (None: not admitting;
        the Cluster keeps its configured ones): the circuit breaker's limit,
        ``lrs.shed.admission.choice_count``, and the weights of its fully routed nodes (HEALTHY, or
        DEGRADED only for being busy) in proportion to their slots, the largest at the largest
        of their decided full weights (a busy node's without ``probes.degraded_weight_factor``).
        The cap already holds the nodes at their slots: a weight cut for being busy, or a score
        from RTT, only sends requests to a node as full, where they wait (measured at 200 %: one
        survivor at 16 running and 1-4 waiting while the other ran 12-14). A node in PROBATION
        keeps its ramp."""
        adm = self.admission.get(name)
        if adm is None or adm.limit is None:
            return None
        factor = cfg.health.probes.degraded_weight_factor
        full: dict[str, float] = {}
        for i in (n.id for c in cfg.clusters if c.name == name for n in c.nodes):
            r, nh = core.routing.get(i), core.health.get(i)
            if r is None or r.health_status != "HEALTHY" or nh is None:
                continue
            if nh.state is NodeState.HEALTHY:
                full[i] = r.weight
            elif nh.state is NodeState.DEGRADED and not nh.probe.degraded_not_busy:
                full[i] = r.weight / factor
        top = max(full.values(), default=0.0)
        known = {i: s for i in full if (s := self._slots.get(i))}  # a node whose slots are unknown: the top
        most = max(known.values(), default=1.0)
        weights = {i: max(1, round(top * known[i] / most if i in known else top)) for i in full}
        return AdmissionArgs(adm.limit, cfg.lrs.shed.admission.choice_count, weights)

    def cla_args(self, name: str) -> DropArgs:
        """``build_cla`` keyword arguments (``shed_percent``, ``shed_flip``) of the Envoy cluster
        ``name`` (a configured cluster or a class cluster)."""
        st = self.classes.get(name) or self.shed.get(name)
        return {} if st is None else {"shed_percent": st.percent, "shed_flip": st.flip}

    def view(self, cfg: SentinelConfig, cluster: str) -> dict[str, object]:
        """JSON for ``/clusters``: the cluster's drop, why, the capacity it was computed from (arrivals
        per s per routable node, its source, the headroom kept; None while not shedding), and with
        classes each class's drop (%)."""
        st = self.shed.get(cluster, ShedState())
        cap = st.capacity_rps
        adm = self.admission.get(cluster, Admission())
        out: dict[str, object] = {"shed_percent": st.percent, "shed_reason": st.reason or None,
                                  "admission": None if adm.limit is None else {
                                      "max_requests_per_envoy": adm.limit, "total": adm.total, "slots": adm.slots,
                                      "queue": adm.queue, "envoys": adm.envoys,
                                      "source": "engines' slots (the most running while a request waited)"},
                                  "shed_capacity": None if cap is None else {
                                      "rps_per_routable_node": round(cap, 3), "headroom": st.headroom,
                                      "source": "engines' counters (queueing model)" if st.capacity_exact
                                      else "LRS completions measured with a queue over the budget"}}
        if cfg.lrs.shed.classes.enabled:
            out["shed_classes"] = {klass: {"cluster": name, "shed_percent": self.classes.get(name, ShedState()).percent}
                                   for klass, name, _ in cfg.lrs.shed.classes.lower_first(cluster)}
        return out

    def metric_families(self, cfg: SentinelConfig) -> Iterator[Metric]:
        """``sentinel_cluster_shed_ratio{cluster, class}``: the drop published (0..1), ``total`` for
        the cluster's share of all its requests and, with request classes, one per class."""
        g = GaugeMetricFamily("sentinel_cluster_shed_ratio", "share of requests Envoy is told to drop for "
                              "overload (0..1; class 'total': of the cluster's demand, else of that class's)",
                              labels=["cluster", "class"])
        for c in cfg.clusters:
            g.add_metric([c.name, "total"], self.shed.get(c.name, ShedState()).percent / 100.0)
            if cfg.lrs.shed.classes.enabled:
                for klass, name, _ in cfg.lrs.shed.classes.lower_first(c.name):
                    g.add_metric([c.name, klass], self.classes.get(name, ShedState()).percent / 100.0)
        yield g


def kv_from_sessions(sessions: Mapping[str, Any]) -> Callable[[str], float | None]:
    """``kv_usage`` read from each node's probe source: the KV-cache usage of its last checked
    heartbeat (``last_telemetry.load.kv_cache_usage_ratio``), None when it has none."""
    def kv(node_id: str) -> float | None:
        load = getattr(getattr(sessions.get(node_id), "last_telemetry", None), "load", None)
        v = getattr(load, "kv_cache_usage_ratio", None)
        return v if isinstance(v, float) else None
    return kv


def finished_from_sessions(sessions: Mapping[str, Any]) -> Callable[[str], tuple[float, float] | None]:
    """``finished`` read from each node's probe source: (arrival, monotonic s; count) of its
    engine's finished-request counter at the last heartbeat, None when it had none."""
    def finished(node_id: str) -> tuple[float, float] | None:
        v = getattr(sessions.get(node_id), "finished", None)
        return v if isinstance(v, tuple) else None
    return finished
