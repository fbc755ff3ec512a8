"""Read-only JSON views of a running control plane, for the admin endpoint.

:class:`ControlPlaneView` reads the :class:`~xds_server.control.core.ControlCore`, the snapshot
cache and the ADS servicer through their public read methods, and the probe sources' connection
state and telemetry. It changes nothing. The admin app depends on this module only (never on
``xds_server.server``), so data flows one way: server -> view -> admin.

Units: times in seconds, RTT/TTFT in ms, ratios 0..1.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format

from xds_server.admin.display import DisplayInputs, NodeDisplay, node_display
from xds_server.admin.history import HistoryRow
from xds_server.config import ClusterConfig, SentinelConfig
from xds_server.control.core import ControlCore
from xds_server.control.events import EventRecord
from xds_server.health import model as hm
from xds_server.probing.rtt_pace import PingPace
from xds_server.probing.sources import ProbeSource
from xds_server.process.counters import Counters
from xds_server.xds.ads import AdsServicer
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.resources import CLA_TYPE_URL, CLUSTER_TYPE_URL

if TYPE_CHECKING:
    from xds_server.feed.service import RoutingFeed
    from xds_server.load.gated_shifts import ShiftService
    from xds_server.load.service import LoadReportingService
    from xds_server.probing.switchback import SwitchbackValidator
    from xds_server.probing.workers import WorkerPool
    from xds_server.process.certwatch import CertWatch
    from xds_server.process.refusals import Refusals
    from xds_server.process.tls import ServerCertFiles

__all__ = ["ControlPlaneView", "NodeRow", "ServedTls"]


class NodeRow:
    """One node as the metrics collector reads it: ``cluster``, ``node_id``, ``health``,
    ``routing`` (as last published, or None)."""

    __slots__ = ("cluster", "health", "node_id", "routing")

    def __init__(self, cluster: str, node_id: str, health: hm.NodeHealth, routing: hm.Routing | None) -> None:
        self.cluster = cluster
        self.node_id = node_id
        self.health = health
        self.routing = routing


@dataclass(frozen=True)
class ServedTls:
    """The xDS port's TLS as served: its certificate files (reloaded on change) and the expiry
    watch over every certificate the config names; both None before the port is served or with
    plaintext."""

    files: ServerCertFiles | None = None
    cert_watch: CertWatch | None = None


class ControlPlaneView:
    """Read-only views (see module docstring). ``config`` follows the control plane's config.

    Every part is given here; a part left None is not served (no probe workers, LRS off,
    switch-back validation off, the routing feed absent). ``served_tls`` answers what the xDS
    port serves now (:class:`ServedTls`; empty before ``start``)."""

    def __init__(self, core: ControlCore, cache: SnapshotCache, ads: AdsServicer,
                 sources: Mapping[str, ProbeSource], config: Callable[[], SentinelConfig], *,
                 refusals: Refusals | None = None,
                 load_reports: LoadReportingService | None = None,
                 shifts: ShiftService | None = None,
                 switchback: SwitchbackValidator | None = None,
                 probe_pool: WorkerPool | None = None,
                 routing_feed: RoutingFeed | None = None,
                 reload_status: Callable[[], dict] | None = None,
                 discovery_status: Callable[[], dict] | None = None,
                 served_tls: Callable[[], ServedTls] = ServedTls) -> None:
        self._core = core
        self._cache = cache
        self._ads = ads
        self._sources = sources
        self._config = config
        self.reload_status: Callable[[], dict] = reload_status or (
            lambda: {"ok": True, "source": None, "at": None, "errors": [], "changes": None})
        self.discovery_status: Callable[[], dict] = discovery_status or (lambda: {"problems": [], "clusters": {}})
        self.probe_pool = probe_pool
        self.switchback = switchback  # switch-back validation by replay
        self.routing_feed = routing_feed
        self.refusals = refusals  # refused identities and tokens
        self.load_reports = load_reports  # Envoys' load reports (LRS)
        self.shifts = shifts  # gated shifts (load/gated_shifts.py)
        self._served_tls = served_tls

    @property
    def tls_files(self) -> ServerCertFiles | None:
        """The xDS port's certificate files; None before ``start`` or with plaintext."""
        return self._served_tls().files

    @property
    def cert_watch(self) -> CertWatch | None:
        """Certificate expiry over every file the config names; None before ``start``."""
        return self._served_tls().cert_watch

    @property
    def config(self) -> SentinelConfig:
        return self._config()

    @property
    def counters(self) -> Counters:
        """The control plane's counters (read them; never write)."""
        return self._core.counters

    @property
    def fail_static_active(self) -> bool:
        return self._core.fail_static.active

    def clusters(self) -> list[ClusterConfig]:
        return list(self.config.clusters)

    def has_node(self, node_id: str) -> bool:
        return node_id in self._core.node_cfg

    def node_rows(self) -> Iterator[NodeRow]:
        """Every node with its health and published routing, in config order."""
        core = self._core
        for node_id, nh in core.health.items():
            yield NodeRow(core.node_cluster[node_id], node_id, nh, core.routing.get(node_id))

    def pinging(self) -> dict[str, int]:
        """Streams sending RTT pings now, per process: ``main`` (this one's event loop; read on it)
        and ``worker-N`` (as each probe worker last reported)."""
        out: dict[str, int] = {}
        try:
            out["main"] = PingPace.pinging_on(asyncio.get_running_loop())
        except RuntimeError:  # read off the loop: the main process's count is not known here
            pass
        if self.probe_pool is not None:
            out.update((f"worker-{i}", n) for i, n in sorted(self.probe_pool.pinging_by_worker().items()))
        return out

    def lag_deferrals(self) -> int:
        """Detection timers deferred by all probe sources (our own loop was late)."""
        return sum(getattr(s, "lag_deferrals", 0) for s in self._sources.values())

    def cla_version(self, cluster: str) -> str:
        """Content version of a cluster's ClusterLoadAssignment ("" before first publish)."""
        r = self._cache.resources(CLA_TYPE_URL).get(cluster)
        return r.version if r else ""

    def readiness(self) -> tuple[bool, list[str]]:
        """(every cluster published, names of the clusters not yet published)."""
        missing = [c.name for c in self.config.clusters if not self.cla_version(c.name)]
        return not missing, missing

    def routable_counts(self) -> dict[str, int]:
        """Cluster name -> nodes published HEALTHY (Envoy routes to them), in config order."""
        routing = self._core.routing
        return {c.name: sum(1 for n in c.nodes if (r := routing.get(n.id)) is not None
                            and r.health_status == "HEALTHY") for c in self.config.clusters}

    def events(self, limit: int) -> list[dict]:
        """The newest ``limit`` events (>= 0), oldest first, as JSON."""
        return [r.to_json() for r in self._core.events.recent(limit)]

    def event_records(self) -> list[EventRecord]:
        return list(self._core.events)

    # -- nodes -------------------------------------------------------------------------------

    def _probation_view(self, nh: hm.NodeHealth, now: float) -> dict | None:
        cfg = self.config.health
        if nh.state is hm.NodeState.PROBATION:
            step_at = nh.ramp.step_at_s if nh.ramp.step_at_s is not None else now
            return {"ramp_percent": nh.ramp.percent,
                    "next_step_in_s": round(max(0.0, step_at + cfg.probation.ramp_step.s - now), 3),
                    "step_percent": cfg.probation.ramp_step_percent}
        if nh.state is hm.NodeState.UNHEALTHY:
            need = hm.required_clean_s(nh, cfg)
            since = nh.probe.clean_since_s
            clean = 0.0 if since is None else now - since
            return {"required_clean_s": need, "clean_for_s": round(clean, 3),
                    "next_recheck_in_s": round(max(0.0, need - clean), 3) if since is not None else None,
                    "clean_probes": nh.probe.clean_probes,
                    "waiting_for": list(hm.clean_period_unmet(nh, cfg, now))}
        return None

    def _drain_view(self, nh: hm.NodeHealth, now: float) -> dict | None:
        if not nh.drain.active or nh.drain.since_s is None:
            return None
        in_flight = nh.engine.requests_running
        elapsed = now - nh.drain.since_s
        drained = (in_flight is not None and in_flight <= 0) or elapsed >= self.config.health.drain_timeout.s
        return {"draining_for_s": round(elapsed, 3), "in_flight": in_flight, "drained": drained,
                "timeout_s": self.config.health.drain_timeout.s}

    def node(self, node_id: str) -> dict:
        """JSON-able state of one node for ``/nodes`` (times: seconds; RTT/TTFT: ms).

        KeyError for a node id not in the config.
        """
        core = self._core
        nh = core.health[node_id]
        n = core.node_cfg[node_id]
        cluster = core.node_cluster[node_id]
        r = core.routing.get(node_id) or hm.route(nh, n.capacity, self.config.health)
        now = core.clock.now()
        sess = self._sources.get(node_id)
        # a probe worker's node whose heartbeats flow: the last report that counted some
        last_hb = nh.heartbeat.last_s if nh.heartbeat.last_s is not None else getattr(sess, "last_heartbeat_s", None)
        shown = self.display(node_id)
        view: dict[str, Any] = {
            "id": node_id,
            "cluster": cluster,
            "address": n.address,
            "probe_address": n.probe_address,
            "locality": n.locality.model_dump(),
            "priority": n.priority,
            "capacity": n.capacity,
            "state": nh.effective_state.value,
            "health_state": nh.state.value,
            "reason": nh.reason,
            "display_state": shown.state,
            "display_reason": shown.reason,
            "routed": shown.routed,
            "not_routed_because": shown.not_routed_because,
            "verdict_not_applied": shown.verdict_not_applied,
            "held_back": core.planner.held_back.get(node_id) or None,
            "since_s_ago": round(now - nh.since_s, 3),
            "weight": r.weight,
            "full_weight": hm.full_weight(n.capacity),
            "eds_health_status": r.health_status,
            "probation": self._probation_view(nh, now),
            "validation": self.switchback.node_view(node_id, nh, now) if self.switchback else None,
            "drain": self._drain_view(nh, now),
            "fail_static": core.fail_static.active,
            "published": cluster in core.planner.gate_open,
            "xds_version": self.cla_version(cluster),
            "probe_stream_connected": bool(sess and sess.connected),
            "agent_failed_dials": getattr(sess, "failed_dials", 0),
            "agent_last_error": getattr(sess, "last_error", "") or None,
            "last_probe_failure": getattr(sess, "last_probe_failure", "") or None,
            "heartbeats": core.counters.heartbeats[node_id],
            "consecutive_misses": hm.misses_shown(nh, self.config.health, now),
            "last_heartbeat_s_ago": None if last_hb is None else round(now - last_hb, 3),
            "last_rtt_ms": nh.rtt.last_ms,
            "ewma_rtt_ms": nh.rtt.ewma_ms,
            "last_ttft_ms": nh.probe.last_ttft_ms,
            "ewma_ttft_ms": nh.probe.ewma_ttft_ms,
            "stalled": nh.engine.stalled,
            "last_probe": nh.probe.last_kind.value if nh.probe.last_kind else None,
            "consecutive_probe_failures": nh.probe.consecutive_failures,
            "probe_failures": {f"{kind}/{outcome}": v for (kind, outcome), v
                               in core.counters.probe_failures(node_id).items()},
            "progress_evidence": nh.engine.progress_detail or None,
            "engine_state": nh.engine.state.value,
        }
        if self.load_reports is not None:  # real traffic over the window, all Envoys (LRS)
            view["traffic"] = self.load_reports.node_view(cluster, node_id)
        tel = sess.last_telemetry if sess else None
        if tel is not None:
            view.update(tel.to_json())
        return view

    def display(self, node_id: str) -> NodeDisplay:
        """The shown state of one node (:func:`~xds_server.admin.display.node_display`).
        KeyError for a node id not in the config."""
        return self._display(node_id, self._core.health[node_id])

    def _display(self, node_id: str, nh: hm.NodeHealth) -> NodeDisplay:
        """:meth:`display` from the node's record ``nh`` (its ``heartbeat`` is not read)."""
        core = self._core
        sess = self._sources.get(node_id)
        tel = getattr(sess, "last_telemetry", None)
        metrics_error = getattr(getattr(tel, "load", None), "metrics_error", "") if tel is not None else ""
        drain_s = None
        if nh.drain.active and nh.drain.since_s is not None:
            drain_s = core.clock.now() - nh.drain.since_s
        return node_display(DisplayInputs(
            health=nh, published=core.routing.get(node_id),
            why_not_routed=core.planner.why_not_routed.get(node_id, ""),
            held_back=core.planner.held_back.get(node_id, ""),
            fail_static_held=core.node_cluster[node_id] in core.planner.fail_static_held,
            agent_connected=bool(sess and sess.connected),
            failed_dials=getattr(sess, "failed_dials", 0),
            agent_error=getattr(sess, "last_error", ""),
            engine_error=getattr(sess, "last_probe_failure", "") or metrics_error,
            drain_s=drain_s, in_flight=nh.engine.requests_running))

    def fail_static_view(self) -> dict:
        """``{"active", "since_s_ago", "reason", "held_clusters"}`` (times: s; None when inactive)."""
        core = self._core
        fs = core.fail_static
        return {"active": fs.active,
                "since_s_ago": round(core.clock.now() - fs.since_s, 3) if fs.active else None,
                "reason": fs.reason or None if fs.active else None,
                "held_clusters": sorted(core.planner.fail_static_held)}

    def nodes(self) -> list[dict]:
        return [self.node(n) for n in self._core.node_cfg]

    def node_ids(self) -> list[str]:
        """Every watched node's id, in the health table's order."""
        return list(self._core.health)

    def history_rows(self, node_ids: list[str]) -> list[HistoryRow]:
        """The nodes ``node_ids`` (from :meth:`node_ids`; one no longer watched is skipped) as the
        dashboard's history samples them (shown state and weight, RTT, TTFT): lighter than
        :meth:`node`. Reads the records with their folded heartbeats not settled (no heartbeat
        is shown), so a sample leaves every steady node's run open."""
        core = self._core
        table = core.health.unsettled
        rows = []
        for node_id in node_ids:
            nh = table.get(node_id)
            if nh is None:
                continue
            shown = self._display(node_id, nh)
            rows.append(HistoryRow(node_id, core.node_cluster[node_id], shown.state, shown.shown_weight,
                                   hm.full_weight(core.node_cfg[node_id].capacity), nh.rtt.ewma_ms,
                                   nh.probe.last_ttft_ms))
        return rows

    def cluster_failures(self) -> dict[str, object]:
        """Clusters where most nodes fail real requests alike (``cluster_failure``), by name."""
        ejector = self.load_reports.ejector if self.load_reports is not None else None
        if ejector is None:
            return {}
        return {c.name: v for c in self.config.clusters if (v := ejector.cluster_view(c.name)) is not None}

    def shift_views(self) -> list[dict]:
        """Every shift but a cancelled one: running, paused, or done (its layout is the cluster's
        now, not the config's)."""
        if self.shifts is None:
            return []
        return [v for n in sorted(self.shifts.shifts) if (v := self.shifts.view(n)) and v["phase"] != "cancelled"]

    def cluster_summaries(self) -> list[dict]:
        out = []
        for c in self.config.clusters:
            views = [self.node(n.id) for n in c.nodes]
            healthy = sum(1 for v in views if v["eds_health_status"] == "HEALTHY")
            out.append({
                "name": c.name,
                "nodes": len(views),
                "routable": healthy,
                "healthy_fraction": healthy / len(views) if views else 0.0,  # a pool scaled to zero
                "xds_version": self.cla_version(c.name),
                "published": bool(self.cla_version(c.name)),
                "fail_static_held": c.name in self._core.planner.fail_static_held,
                **({"traffic": self.load_reports.cluster_view(c.name)} if self.load_reports is not None else {}),
                **({"shift": self.shifts.view(c.name)} if self.shifts is not None else {}),
            })
        return out

    # -- xDS -----------------------------------------------------------------------------------

    def xds_clients(self) -> dict:
        """``/xds/clients``: each open ADS stream's ACKed versions and last NACK (bounded)."""
        return {"replica": self.config.xds.replica_id, **self._ads.clients_view()}

    def xds_metric_families(self) -> Iterator:
        """The xDS server's Prometheus metric families (streams, requests, NACKs, cache)."""
        return self._ads.metric_families()

    def config_dump(self) -> dict:
        from envoy.config.cluster.v3 import cluster_pb2
        from envoy.config.endpoint.v3 import endpoint_pb2

        def dump(tu: str) -> list[dict]:
            cls = cluster_pb2.Cluster if tu == CLUSTER_TYPE_URL else endpoint_pb2.ClusterLoadAssignment
            out = []
            for name, r in sorted(self._cache.resources(tu).items()):
                msg = cls()
                msg.ParseFromString(r.any.value)
                out.append({"name": name, "version": r.version, "resource": json_format.MessageToDict(msg)})
            return out

        cfg = self.config.model_dump(mode="json")
        if cfg.get("admin", {}).get("token") is not None:
            cfg["admin"]["token"] = "<redacted>"
        return {
            "config": cfg,
            "clusters": {"version": self._cache.type_version(CLUSTER_TYPE_URL), "resources": dump(CLUSTER_TYPE_URL)},
            "endpoints": {"version": self._cache.type_version(CLA_TYPE_URL), "resources": dump(CLA_TYPE_URL)},
        }
