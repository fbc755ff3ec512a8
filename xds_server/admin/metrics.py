"""Prometheus metrics of the control plane, read from :class:`ControlPlaneView` at scrape time
(nothing is counted twice on the hot path). Every label set is bounded (see
:mod:`xds_server.process.counters`).

Units follow Prometheus conventions: seconds, bytes and ratios (0..1) in base units, named by
suffix (``_seconds``, ``_bytes``, ``_ratio``); counters are exposed with ``_total`` (the
prometheus-client adds it to each ``CounterMetricFamily`` name).
"""
from __future__ import annotations

import asyncio
import platform

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from xds_server.admin.display import DISPLAY_STATES
from xds_server.admin.views import ControlPlaneView
from xds_server.health.model import NodeState
from xds_server.health.queue_levels import queue_level
from xds_server.probing.rtt_pace import paced_interval_s

__all__ = ["ControlPlaneCollector", "EventLoopCollector", "build_info_family", "package_version"]

_STATES = tuple(s.value for s in NodeState)


def package_version() -> str:
    """The installed xds-sentinel distribution's version ("unknown" when not installed)."""
    from importlib import metadata
    try:
        return metadata.version("xds-sentinel")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_info_family(prefix: str) -> InfoMetricFamily:
    """``<prefix>_build_info{version, python}`` = 1 (exposed as a gauge with ``_info`` semantics)."""
    fam = InfoMetricFamily(f"{prefix}_build", "version of this build and the Python running it")
    fam.add_metric([], {"version": package_version(), "python": platform.python_version()})
    return fam


class ControlPlaneCollector:
    """A prometheus_client collector over a :class:`ControlPlaneView`."""

    def __init__(self, view: ControlPlaneView) -> None:
        self.view = view

    def collect(self):
        yield build_info_family("sentinel")
        replica = InfoMetricFamily("sentinel_replica", "this control-plane process among replicas "
                                   "(xds.replica_id): join other series on the scrape's instance")
        replica.add_metric([], {"replica": self.view.config.xds.replica_id})
        yield replica
        yield from self._nodes()
        yield from self._xds()
        yield from self._health()

    def _nodes(self):
        view = self.view
        c = view.counters
        state = GaugeMetricFamily("sentinel_node_state", "1 for the node's current (effective) state; "
                                  "DRAINING overrides the health state", labels=["cluster", "node", "state"])
        weight = GaugeMetricFamily("sentinel_node_weight", "published EDS load_balancing_weight",
                                   labels=["cluster", "node"])
        routed = GaugeMetricFamily("sentinel_node_routable", "1 if published HEALTHY to Envoy",
                                   labels=["cluster", "node"])
        rtt = GaugeMetricFamily("sentinel_node_ewma_rtt_seconds", "EWMA of probe-stream ping RTT, seconds",
                                labels=["cluster", "node"])
        ttft = GaugeMetricFamily("sentinel_node_last_ttft_seconds", "last micro-probe TTFT, seconds",
                                 labels=["cluster", "node"])
        ttft_ewma = GaugeMetricFamily("sentinel_node_ewma_ttft_seconds", "EWMA of micro-probe TTFT, seconds",
                                      labels=["cluster", "node"])
        hbs = CounterMetricFamily("sentinel_heartbeats", "heartbeats received", labels=["cluster", "node"])
        bad = CounterMetricFamily("sentinel_probe_malformed_messages", "malformed agent messages",
                                  labels=["cluster", "node"])
        ramp = GaugeMetricFamily("sentinel_node_ramp_ratio", "PROBATION ramp, fraction of full weight (0..1)",
                                 labels=["cluster", "node"])
        probes = CounterMetricFamily("sentinel_node_probe_results", "micro-probe results received, by kind "
                                     "(OK, or the failure kind; TIMEOUT also for a token after the "
                                     "deadline) and the model's outcome (good, slow, fail, busy, fatal)",
                                     labels=["cluster", "node", "kind", "outcome"])
        ejections = CounterMetricFamily("sentinel_node_ejections", "moves to UNHEALTHY by cause (heartbeat, "
                                        "phi, transport, probe, engine, gpu, traffic, validation) and "
                                        "cluster-policy outlier ejections "
                                        "(outlier)", labels=["cluster", "node", "cause"])
        for row in view.node_rows():
            cl, nid, nh, r = row.cluster, row.node_id, row.health, row.routing
            eff = nh.effective_state.value
            for s in _STATES:
                state.add_metric([cl, nid, s], 1.0 if eff == s else 0.0)
            if r is not None:
                weight.add_metric([cl, nid], r.weight)
                routed.add_metric([cl, nid], 1.0 if r.health_status == "HEALTHY" else 0.0)
            if nh.rtt.ewma_ms is not None:
                rtt.add_metric([cl, nid], nh.rtt.ewma_ms / 1000.0)
            if nh.probe.last_ttft_ms is not None:
                ttft.add_metric([cl, nid], nh.probe.last_ttft_ms / 1000.0)
            if nh.probe.ewma_ttft_ms is not None:
                ttft_ewma.add_metric([cl, nid], nh.probe.ewma_ttft_ms / 1000.0)
            hbs.add_metric([cl, nid], c.heartbeats[nid])
            bad.add_metric([cl, nid], c.malformed[nid])
            if nh.state is NodeState.PROBATION:
                ramp.add_metric([cl, nid], nh.ramp.percent / 100.0)
        by_node = {row.node_id: row.cluster for row in view.node_rows()}
        for (nid, kind, outcome), v in sorted(c.probe_results.items()):
            if nid in by_node:
                probes.add_metric([by_node[nid], nid, kind, outcome], v)
        for (nid, cause), v in sorted(c.ejections.items()):
            if nid in by_node:
                ejections.add_metric([by_node[nid], nid, cause], v)
        yield from (state, weight, routed, rtt, ttft, ttft_ewma, hbs, bad, ramp, probes, ejections)
        yield from _queues(view)
        shown = GaugeMetricFamily("sentinel_node_display_state", "1 for the state an operator is shown "
                                  "(health state, or DRAINING, FAIL_STATIC, UNREACHABLE, HELD_BACK; see "
                                  "xds_server/admin/display.py)", labels=["cluster", "node", "state"])
        for row in view.node_rows():
            d = view.display(row.node_id).state
            for s in DISPLAY_STATES:
                shown.add_metric([row.cluster, row.node_id, s], 1.0 if d == s else 0.0)
        yield shown
        fields = CounterMetricFamily("sentinel_probe_bad_fields", "agent message fields rejected or "
                                     "clamped at the edge, by field and reason", labels=["field", "reason"])
        for (f, why), v in sorted(c.bad_fields.items()):
            fields.add_metric([f, why], v)
        yield fields
        herr = CounterMetricFamily("sentinel_probe_handler_errors", "exceptions while handling one agent "
                                   "message or timer (each skipped; the session goes on)", labels=["where"])
        for where, v in sorted(c.handler_errors.items()):
            herr.add_metric([where], v)
        yield herr
        drops = CounterMetricFamily("sentinel_agent_transport_drops", "dial-in streams whose transport "
                                    "ended under us, by verdict: node (a transport suspicion: out at once, back "
                                    "if its agent is heard before the count rule proves it), redialled "
                                    "(the agent dialled again at once), stall (cut by a stall of ours), burst "
                                    "(many at once: ours), returned (its agent dialled back during a burst's "
                                    "recovery: the hold goes on)", labels=["verdict"])
        for verdict in ("node", "redialled", "stall", "burst", "returned"):
            drops.add_metric([verdict], c.transport_drops[verdict])
        yield drops
        silent = CounterMetricFamily("sentinel_agent_silent_streams", "dial-in streams open without a "
                                     "heartbeat for their silence bound, by verdict: node (ended, the agent "
                                     "judged), burst (many at once: ours, kept open)", labels=["verdict"])
        for verdict in ("node", "burst"):
            silent.add_metric([verdict], c.silent_streams[verdict])
        yield silent
        rtt = CounterMetricFamily("sentinel_rtt_pings_not_taken", "RTT pings that gave no sample, by why: "
                                  "late (not sent: our own loop ran late), ours (the round trip spanned a "
                                  "stall or queue of ours), gap (outstanding across a heartbeat gap)",
                                  labels=["why"])
        for why in ("late", "ours", "gap"):
            rtt.add_metric([why], c.rtt_not_taken[why])
        yield rtt
        yield from self._ping_pace()
        lag = CounterMetricFamily("sentinel_detection_timer_lag_deferrals",
                                  "detection timers deferred because our own event loop was late")
        lag.add_metric([], view.lag_deferrals())
        yield lag

    def _ping_pace(self):
        rtt = self.view.config.health.rtt
        streams = GaugeMetricFamily("sentinel_rtt_pinging_streams", "probe streams sending RTT pings now, "
                                    "per process (main; worker-N: probe workers)", labels=["process"])
        interval = GaugeMetricFamily("sentinel_rtt_ping_interval_seconds", "the mean wait between one "
                                     "stream's RTT pings now, per process: health.rtt.ping_interval, or "
                                     "streams / health.rtt.ping_budget when that is longer", labels=["process"])
        for process, n in self.view.pinging().items():
            streams.add_metric([process], n)
            interval.add_metric([process], paced_interval_s(rtt.ping_interval.s, n, rtt.ping_budget))
        yield from (streams, interval)

    def _xds(self):
        yield from self.view.xds_metric_families()
        feed = getattr(self.view, "routing_feed", None)  # the relay's feed (routing_feed.py), if served
        if feed is not None:
            yield from feed.metrics()
        tls_files = getattr(self.view, "tls_files", None)  # the ADS port's certificate (tls, mtls)
        if tls_files is not None:
            yield from tls_files.metric_families()
        load = getattr(self.view, "load_reports", None)  # LRS (xds_server/load), if served
        if load is not None:
            yield from load.metric_families()
        for part in (getattr(self.view, "refusals", None), getattr(self.view, "cert_watch", None),
                     getattr(self.view, "shifts", None)):
            if part is not None:  # refused identities and tokens; certificate expiry; shifts
                yield from part.metric_families()

    def _health(self):
        c = self.view.counters
        tr = CounterMetricFamily("sentinel_health_events", "health transitions (kind to_<STATE>) and "
                                 "cluster-policy events", labels=["kind"])
        for k, v in sorted(c.events.items()):
            tr.add_metric([k], v)
        yield tr
        fs = GaugeMetricFamily("sentinel_fail_static", "1 while fail-static holds the last good assignment")
        fs.add_metric([], 1.0 if self.view.fail_static_active else 0.0)
        yield fs
        rl = CounterMetricFamily("sentinel_config_reloads", "config reloads by result (ok, invalid: "
                                 "rejected, running config kept)", labels=["result"])
        for k in ("ok", "invalid"):
            rl.add_metric([k], c.config_reloads[k])
        yield rl
        ok = GaugeMetricFamily("sentinel_config_last_reload_ok", "0 when the last reload was rejected")
        ok.add_metric([], 1.0 if self.view.reload_status()["ok"] else 0.0)
        yield ok
        yield from self._discovery()
        yield from self._probe_workers()

    def _probe_workers(self):
        pool = getattr(self.view, "probe_pool", None)  # None: probe.workers 0 (probing/workers/_pool.py)
        restarts = CounterMetricFamily("sentinel_probe_worker_restarts", "probe worker processes started "
                                       "again after theirs exited (crash, OOM, kill), per worker slot",
                                       labels=["worker"])
        for index, n in sorted(pool.restarts_by_worker().items() if pool is not None else ()):
            restarts.add_metric([str(index)], n)
        live = GaugeMetricFamily("sentinel_probe_workers_live", "probe worker processes running now")
        live.add_metric([], pool.live() if pool is not None else 0)
        want = GaugeMetricFamily("sentinel_probe_workers_configured", "probe worker processes asked for "
                                 "(probe.workers, auto resolved; 0: probe streams in this process)")
        want.add_metric([], pool.n if pool is not None else 0)
        yield from (restarts, live, want)

    def _discovery(self):
        errs = CounterMetricFamily("sentinel_discovery_errors", "discovery failures per cluster and source "
                                   "(file: a rejected targets file content, the last good node set kept; "
                                   "kubernetes: a failed list or watch, retried)", labels=["cluster", "source"])
        found = GaugeMetricFamily("sentinel_discovery_nodes", "nodes a discovery source lists now",
                                  labels=["cluster", "source"])
        for cluster, sources in sorted(self.view.discovery_status()["clusters"].items()):
            for s in sources:
                errs.add_metric([cluster, s["source"]], s["errors"])
                found.add_metric([cluster, s["source"]], len(s["nodes"]))
        yield from (errs, found)


def _queues(view: ControlPlaneView):
    """Seed 002's queue levels per node: waiting requests and ok / warning (> health.load.queue_warning)
    / critical (> health.load.queue_critical, saturated)."""
    cfg = view.config.health
    waiting = GaugeMetricFamily("sentinel_node_requests_waiting", "requests waiting in the engine's queue "
                                "(agent telemetry)", labels=["cluster", "node"])
    level = GaugeMetricFamily("sentinel_node_queue_level", "1 for the node's queue level: ok, warning (> "
                              "health.load.queue_warning, 50), critical (> health.load.queue_critical, 100; saturated)",
                              labels=["cluster", "node", "level"])
    for row in view.node_rows():
        w = row.health.engine.requests_waiting
        if w is not None:
            waiting.add_metric([row.cluster, row.node_id], w)
        now = queue_level(w, cfg)
        for name in ("ok", "warning", "critical"):
            level.add_metric([row.cluster, row.node_id, name], 1.0 if name == now else 0.0)
    yield from (waiting, level)


class EventLoopCollector:
    """``sentinel_event_loop_tasks``: asyncio tasks alive on the running event loop at scrape
    time (0 when scraped off the loop). One per open ADS stream, probe stream and admin request
    plus a fixed set; a count that stays above its baseline after clients leave is a leak."""

    def collect(self):
        try:
            n = len(asyncio.all_tasks())
        except RuntimeError:  # no running loop in this thread
            n = 0
        fam = GaugeMetricFamily("sentinel_event_loop_tasks", "asyncio tasks alive on the control "
                                "plane's event loop at scrape time")
        fam.add_metric([], n)
        yield fam
