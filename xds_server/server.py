"""The control plane process: probe sessions -> health model -> snapshot cache -> ADS, plus admin.

Data flows one way (DESIGN.md section 1). :class:`ControlPlane` owns the per-node
:class:`~xds_server.health.model.NodeHealth`, feeds observations through the pure model, and when
a node's routing (weight or EDS health) changes, rebuilds that cluster's ClusterLoadAssignment
into the cache at most once per ``xds.coalesce_window_ms`` (an isolated change at once; changes
within the window after a publish coalesced into one build and one push). ADS (SotW and delta) is
served on ``xds.listen``.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass

import grpc
from aiohttp import web

from xds_server.config import NodeConfig, SentinelConfig, parse_hostport
from xds_server.health import model as hm
from xds_server.health import policy as hp
from xds_server.probing import ProbeSession
from xds_server.routing_events import RoutingChange, RoutingListener
from xds_server.xds.ads import AdsServicer
from xds_server.xds.cache import InvalidResource, SnapshotCache
from xds_server.xds.resources import (
    CLA_TYPE_URL,
    CLUSTER_TYPE_URL,
    RESOURCE_TYPES,
    build_cla,
    build_cluster,
)

__all__ = ["ControlPlane", "EventRecord"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EventRecord:
    """An event as kept for ``/events``: wall time (unix s), cluster, node, kind and reason.

    ``kind`` is "transition" (then ``from_state``/``to_state`` are set) or a cluster-policy
    kind: "outlier_ejected", "outlier_returned", "held_back", "fail_static_on", "fail_static_off".
    """

    wall_time_s: float
    cluster: str
    node_id: str
    kind: str
    reason: str
    from_state: str | None = None
    to_state: str | None = None

    def to_json(self) -> dict:
        """JSON-able form."""
        return {
            "time": self.wall_time_s,
            "cluster": self.cluster,
            "node": self.node_id,
            "kind": self.kind,
            "from": self.from_state,
            "to": self.to_state,
            "reason": self.reason,
        }


class ControlPlane:
    """Everything one xds-server process runs. ``await start()`` / ``await stop()``.

    Attributes used by the admin app: ``config``, ``health`` (node id -> NodeHealth),
    ``routing`` (node id -> Routing as last published), ``events`` (ring buffer of EventRecord),
    ``cache``, ``ads`` (servicer with live streams), ``sessions`` (node id -> ProbeSession).
    """

    def __init__(self, config: SentinelConfig) -> None:
        self.config = config
        self.cache = SnapshotCache(config.xds.server_id,
                                   validators={tu: t.validate for tu, t in RESOURCE_TYPES.items()},
                                   memo_max_entries=config.xds.memo_max_entries,
                                   memo_max_bytes=config.xds.memo_max_bytes)
        self.events: collections.deque[EventRecord] = collections.deque(maxlen=config.admin.events_buffer)
        self.node_cluster: dict[str, str] = {}
        self.node_cfg: dict[str, NodeConfig] = {}
        for cname, n in config.nodes():
            self.node_cluster[n.id] = cname
            self.node_cfg[n.id] = n
        self.health: dict[str, hm.NodeHealth] = {}
        self.routing: dict[str, hm.Routing] = {}
        self.routing_listeners: list[RoutingListener] = []  # called per published change
        self._notified: dict[str, tuple[str, str]] = {}
        self.sessions: dict[str, ProbeSession] = {}
        self.heartbeats: collections.Counter[str] = collections.Counter()
        self.malformed: collections.Counter[str] = collections.Counter()
        self.outliers: dict[str, dict[str, hp.OutlierState]] = {}
        self.why_not_routed: dict[str, str] = {}
        self.fail_static = hp.FailStaticState()
        self.event_counts: collections.Counter[str] = collections.Counter()
        self._keys: dict[str, tuple] = {}
        self._history: dict[str, collections.deque] = {}
        self._dirty: set[str] = set()
        self._publish_scheduled = False
        self._last_publish_s = float("-inf")  # loop time of the last publish (coalescing window)
        self._gate_open: set[str] = set()
        self._started_mono = 0.0
        self.ads = AdsServicer(self.cache, config=config.xds)
        self._grpc: grpc.aio.Server | None = None
        self._admin_runner: web.AppRunner | None = None
        self._gate_timer: asyncio.TimerHandle | None = None
        self.xds_port = 0
        self.admin_port = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the ADS and admin ports, publish CDS, start one probe session per node.

        Raises OSError when a port cannot be bound.
        """
        self._loop = asyncio.get_running_loop()
        now = self._loop.time()
        self._started_mono = now
        for node_id in self.node_cfg:
            self.health[node_id] = hm.initial(node_id, now)
        self.cache.set_resources(
            CLUSTER_TYPE_URL, {c.name: build_cluster(c) for c in self.config.clusters}
        )
        self._grpc = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", self.config.xds.max_receive_message_bytes),
            ("grpc.keepalive_time_ms", self.config.xds.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.config.xds.keepalive_timeout_ms),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ])
        self.ads.add_to_server(self._grpc)  # ADS (SotW + delta), responses encoded once per content
        from xds_server.routing_feed import RoutingFeed  # routing feed for the relay, same port
        self.routing_feed = RoutingFeed(self).add_to_server(self._grpc)
        host, port = parse_hostport(self.config.xds.listen)
        self.xds_port = self._grpc.add_insecure_port(f"{host}:{port}")
        if self.xds_port == 0:
            raise OSError(f"cannot bind xDS port {self.config.xds.listen}")
        await self._grpc.start()

        from xds_server.admin.app import build_admin_app

        self._admin_runner = web.AppRunner(build_admin_app(self), access_log=None)
        await self._admin_runner.setup()
        ahost, aport = parse_hostport(self.config.admin.listen)
        site = web.TCPSite(self._admin_runner, ahost, aport)
        await site.start()
        self.admin_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        for node_id, n in self.node_cfg.items():
            s = ProbeSession(n, self.config.health, self.observe, self.config.xds.server_id,
                             on_malformed=self._on_malformed)
            self.sessions[node_id] = s
            s.start()
        timeout = self.config.xds.warmup_timeout_ms / 1000.0
        self._gate_timer = self._loop.call_later(timeout, self._open_all_gates)
        log.info("xds-server: ADS on %s:%d, admin on http://%s:%d", host, self.xds_port, ahost, self.admin_port)

    async def stop(self) -> None:
        """Stop probe sessions, the ADS server and the admin server."""
        if self._gate_timer:
            self._gate_timer.cancel()
        await asyncio.gather(*(s.stop() for s in self.sessions.values()), return_exceptions=True)
        if self._grpc:
            await self._grpc.stop(grace=0.5)
        if self._admin_runner:
            await self._admin_runner.cleanup()

    # -- observations -> health -> resources ---------------------------------------------------

    def observe(self, node_id: str, obs: hm.Observation, now_s: float) -> float | None:
        """Feed one observation for a node (from probe sessions and the admin API).

        Returns when the node's next :class:`~xds_server.health.model.Tick` is due (caller's
        monotonic clock, s), or None.
        """
        cfg = self.config.health
        if isinstance(obs, hm.HeartbeatObserved):
            self.heartbeats[node_id] += 1
        prev = self.health[node_id]
        nh, events = hm.step(prev, obs, now_s, cfg)
        self.health[node_id] = nh
        cluster = self.node_cluster[node_id]
        for ev in events:
            self._record(cluster, node_id, "transition", ev.reason, ev.from_state.value, ev.to_state.value)
        key = self._routing_key(nh)
        if key != self._keys.get(node_id):
            self._keys[node_id] = key
            self._mark_dirty(cluster)
        if (prev.consecutive_misses > 0) != (nh.consecutive_misses > 0) or prev.stream_closed != nh.stream_closed:
            self._check_fail_static(now_s)
        return hm.next_check_s(nh, cfg)

    def _record(self, cluster: str, node_id: str, kind: str, reason: str,
                from_state: str | None = None, to_state: str | None = None) -> None:
        rec = EventRecord(time.time(), cluster, node_id, kind, reason, from_state, to_state)
        self.events.append(rec)
        self.event_counts[kind if kind != "transition" else f"to_{to_state}"] += 1
        if kind == "transition":
            log.info("node %s: %s -> %s (%s)", node_id, from_state, to_state, reason)
        else:
            log.warning("%s %s: %s (%s)", kind, node_id, cluster, reason)

    def _routing_key(self, nh: hm.NodeHealth) -> tuple:
        """What cluster policy reads from a node, coarsened so noise does not trigger recomputes."""
        nr = hm.node_routing(nh, self.config.health)

        def bucket(v: float | None) -> int | None:
            return None if v is None else int(math.log1p(max(v, 0.0)) / math.log(1.1))

        return (nr, nh.state, bucket(nh.ewma_rtt_ms), bucket(nh.ewma_ttft_ms),
                None if nh.gpu_free_ratio is None else round(nh.gpu_free_ratio, 2))

    def _check_fail_static(self, now_s: float) -> None:
        st, evs = hp.fail_static(self.fail_static, self.health, now_s, self.config.health)
        if st == self.fail_static:
            return
        ended = self.fail_static.active and not st.active
        burst_start = self.fail_static.burst_start_s
        self.fail_static = st
        for ev in evs:
            self._record("*", "*", ev.kind, ev.reason)
        if ended:
            for node_id in self.health:
                nh, events = hm.step(self.health[node_id], hm.FailStaticEnded(burst_start), now_s,
                                     self.config.health)
                self.health[node_id] = nh
                for ev in events:
                    self._record(self.node_cluster[node_id], node_id, "transition", ev.reason,
                                 ev.from_state.value, ev.to_state.value)
                self._keys[node_id] = self._routing_key(nh)
        for c in self.config.clusters:
            self._mark_dirty(c.name)

    def _mark_dirty(self, cluster: str) -> None:
        if cluster not in self._gate_open:
            c = next(c for c in self.config.clusters if c.name == cluster)
            if all(self.health[n.id].state not in (hm.NodeState.COLD, hm.NodeState.WARMING) for n in c.nodes):
                self._gate_open.add(cluster)
            else:
                return
        self._dirty.add(cluster)
        if not self._publish_scheduled and self._loop is not None:
            self._publish_scheduled = True
            # At most one publish per coalescing window: a change after a quiet window goes out
            # at the end of this loop iteration (no added latency, as before); changes arriving
            # within the window after a publish are coalesced into one build + push at its end.
            delay_s = self._last_publish_s + self.config.xds.coalesce_window_ms / 1000.0 - self._loop.time()
            if delay_s > 0:
                self._loop.call_later(delay_s, self._publish)
            else:
                self._loop.call_soon(self._publish)

    def _open_all_gates(self) -> None:
        for c in self.config.clusters:
            if c.name not in self._gate_open:
                cold = [n.id for n in c.nodes
                        if self.health[n.id].state in (hm.NodeState.COLD, hm.NodeState.WARMING)]
                log.warning("warm-up timeout: publishing %s with %d node(s) still COLD or WARMING: %s%s",
                            c.name, len(cold), ", ".join(cold[:20]), " ..." if len(cold) > 20 else "")
                self._gate_open.add(c.name)
                self._mark_dirty(c.name)

    def _publish(self) -> None:
        self._publish_scheduled = False
        self._last_publish_s = self._loop.time() if self._loop is not None else 0.0
        dirty, self._dirty = self._dirty, set()
        assert self._loop is not None
        now = self._loop.time()
        cfg = self.config.health
        for c in self.config.clusters:
            if c.name not in dirty:
                continue
            decision = hp.cluster_routing(
                [(n.id, n.capacity, self.health[n.id]) for n in c.nodes],
                self.outliers.get(c.name, {}), now, cfg)
            self.outliers[c.name] = dict(decision.outliers)
            for ev in decision.events:
                self._record(c.name, ev.node_id, ev.kind, ev.reason)
            self.why_not_routed.update({n.id: decision.why_not_routed.get(n.id, "") for n in c.nodes})
            routing = dict(decision.routing)
            history = self._history.setdefault(c.name, collections.deque(maxlen=64))
            if self.fail_static.active:
                # Keep the last assignment published before the burst of losses began.
                limit = self.fail_static.burst_start_s + (cfg.heartbeat_interval_ms + cfg.heartbeat_grace_ms) / 1000.0
                good = [r for t, r in history if t <= limit]
                if good:
                    routing = dict(good[-1])
            else:
                history.append((now, routing))
            for n in c.nodes:
                self.routing[n.id] = routing[n.id]
            try:
                self.cache.set_resource(CLA_TYPE_URL, c.name, build_cla(c, routing))
            except InvalidResource as e:  # held back: Envoy would NACK it (checklist 1.9 item 17)
                log.error("not publishing %s: %s", c.name, e)
            else:
                self._notify_listeners(c.name, [n for n in c.nodes], routing)
            # Wake up when an outlier ejection ends, to let the node back.
            ends = [o.until_s for o in decision.outliers.values() if o.until_s > now]
            if ends:
                self._loop.call_at(min(ends) + 0.001, self._mark_dirty, c.name)

    def _notify_listeners(self, cluster: str, nodes: list[NodeConfig], routing: dict[str, hm.Routing]) -> None:
        """Tell routing listeners about each node whose published status or state changed."""
        if not self.routing_listeners:
            return
        version = self.cla_version(cluster)
        for n in nodes:
            nh = self.health[n.id]
            r = routing[n.id]
            key = (r.health_status, nh.effective_state.value)
            if self._notified.get(n.id) == key:
                continue
            self._notified[n.id] = key
            change = RoutingChange(n.id, cluster, n.address, r.health_status == "HEALTHY",
                                   nh.effective_state.value, r.health_status, r.weight, nh.reason,
                                   version, time.time())
            for listener in list(self.routing_listeners):
                try:
                    listener(change)
                except Exception:  # a listener's bug must not stop publishing
                    log.exception("routing listener failed for %s", n.id)

    # -- hooks -------------------------------------------------------------------------------

    def _on_malformed(self, node_id: str, what: str) -> None:
        self.malformed[node_id] += 1

    # -- views -------------------------------------------------------------------------------

    def cla_version(self, cluster: str) -> str:
        """Content version of a cluster's ClusterLoadAssignment ("" before first publish)."""
        r = self.cache.resources(CLA_TYPE_URL).get(cluster)
        return r.version if r else ""

    def _probation_view(self, nh: hm.NodeHealth, now: float) -> dict | None:
        cfg = self.config.health
        if nh.state is hm.NodeState.PROBATION:
            return {"ramp_percent": nh.ramp_percent,
                    "next_step_in_s": round(max(0.0, nh.ramp_step_at_s + cfg.ramp_step_s - now), 3),
                    "step_percent": cfg.ramp_step_percent}
        if nh.state is hm.NodeState.UNHEALTHY:
            need = nh.probation_clean_s or cfg.probation_clean_s
            clean = 0.0 if nh.clean_since_s is None else now - nh.clean_since_s
            return {"required_clean_s": need, "clean_for_s": round(clean, 3),
                    "next_recheck_in_s": round(max(0.0, need - clean), 3) if nh.clean_since_s is not None else None,
                    "clean_probes": nh.clean_probes}
        return None

    def _drain_view(self, nh: hm.NodeHealth, now: float) -> dict | None:
        if not nh.draining or nh.drain_since_s is None:
            return None
        in_flight = nh.requests_running
        elapsed = now - nh.drain_since_s
        drained = (in_flight is not None and in_flight <= 0) or elapsed >= self.config.health.drain_timeout_s
        return {"draining_for_s": round(elapsed, 3), "in_flight": in_flight, "drained": drained,
                "timeout_s": self.config.health.drain_timeout_s}

    def drain(self, node_id: str, drain: bool, reason: str) -> dict:
        """Operator drain/undrain of a node (enters the model as an observation). KeyError if unknown."""
        if node_id not in self.node_cfg:
            raise KeyError(node_id)
        assert self._loop is not None
        self.observe(node_id, hm.DrainRequested(drain, reason), self._loop.time())
        if self._dirty:
            self._publish()  # operator actions are rare: publish now, so the answer shows the result
        return self.node_view(node_id)

    def node_view(self, node_id: str) -> dict:
        """JSON-able state of one node for ``/nodes`` (times: seconds; RTT/TTFT: ms)."""
        nh = self.health[node_id]
        n = self.node_cfg[node_id]
        cluster = self.node_cluster[node_id]
        r = self.routing.get(node_id) or hm.route(nh, n.capacity, self.config.health)
        now = self._loop.time() if self._loop else 0.0
        sess = self.sessions.get(node_id)
        tel = sess.last_telemetry if sess else None
        view = {
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
            "not_routed_because": self.why_not_routed.get(node_id) or None,
            "since_s_ago": round(now - nh.since_s, 3),
            "weight": r.weight,
            "full_weight": n.capacity * 100,
            "eds_health_status": r.health_status,
            "probation": self._probation_view(nh, now),
            "drain": self._drain_view(nh, now),
            "fail_static": self.fail_static.active,
            "published": cluster in self._gate_open,
            "xds_version": self.cla_version(cluster),
            "probe_stream_connected": bool(sess and sess.connected),
            "heartbeats": self.heartbeats[node_id],
            "consecutive_misses": nh.consecutive_misses,
            "last_heartbeat_s_ago": None if nh.last_heartbeat_s is None else round(now - nh.last_heartbeat_s, 3),
            "last_rtt_ms": nh.last_rtt_ms,
            "ewma_rtt_ms": nh.ewma_rtt_ms,
            "last_ttft_ms": nh.last_ttft_ms,
            "ewma_ttft_ms": nh.ewma_ttft_ms,
            "stalled": nh.stalled,
            "last_probe": nh.last_probe_kind.value if nh.last_probe_kind else None,
            "consecutive_probe_failures": nh.consecutive_probe_failures,
            "engine_state": nh.engine_state,
        }
        if tel is not None:
            load = tel.engine_load
            view["engine_load"] = {
                "metrics_ok": load.metrics_ok,
                "requests_waiting": load.requests_waiting if load.HasField("requests_waiting") else None,
                "requests_running": load.requests_running if load.HasField("requests_running") else None,
                "kv_cache_usage_ratio": load.kv_cache_usage_ratio if load.HasField("kv_cache_usage_ratio") else None,
                "kv_cache_metric": load.kv_cache_metric or None,
            }
            from node_probe.proto import probe_pb2
            view["gpu"] = {"nvml": probe_pb2.NvmlState.Name(tel.gpu.state), "gpus": len(tel.gpu.gpus),
                           "error": tel.gpu.error or None}
        return view
