"""The control plane process: probe sessions -> health model -> snapshot cache -> ADS, plus admin.

Data flows one way (DESIGN.md section 1). :class:`ControlPlane` owns the per-node
:class:`~xds_server.health.model.NodeHealth`, feeds observations through the pure model, and when
a node's routing (weight or EDS health) changes, rebuilds that cluster's ClusterLoadAssignment
once per loop iteration (changes in the same iteration are coalesced) into the cache.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

import grpc
from aiohttp import web

from xds_server.config import NodeConfig, SentinelConfig, parse_hostport
from xds_server.health import model as hm
from xds_server.probing import ProbeSession
from xds_server.xds.ads import AdsHooks, AdsServicer
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.resources import CLA_TYPE_URL, CLUSTER_TYPE_URL, build_cla, build_cluster

from envoy.service.discovery.v3 import ads_pb2_grpc

__all__ = ["ControlPlane", "EventRecord"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EventRecord:
    """A health transition as kept for ``/events``: wall time (unix s) plus the model's event."""

    wall_time_s: float
    cluster: str
    event: hm.Event

    def to_json(self) -> dict:
        """JSON-able form."""
        return {
            "time": self.wall_time_s,
            "cluster": self.cluster,
            "node": self.event.node_id,
            "from": self.event.from_state.value,
            "to": self.event.to_state.value,
            "reason": self.event.reason,
        }


class ControlPlane:
    """Everything one xds-server process runs. ``await start()`` / ``await stop()``.

    Attributes used by the admin app: ``config``, ``health`` (node id -> NodeHealth),
    ``routing`` (node id -> Routing as last published), ``events`` (ring buffer of EventRecord),
    ``cache``, ``ads`` (servicer with live streams), ``sessions`` (node id -> ProbeSession).
    """

    def __init__(self, config: SentinelConfig) -> None:
        self.config = config
        self.cache = SnapshotCache(config.xds.server_id)
        self.events: collections.deque[EventRecord] = collections.deque(maxlen=config.admin.events_buffer)
        self.node_cluster: dict[str, str] = {}
        self.node_cfg: dict[str, NodeConfig] = {}
        for cname, n in config.nodes():
            self.node_cluster[n.id] = cname
            self.node_cfg[n.id] = n
        self.health: dict[str, hm.NodeHealth] = {}
        self.routing: dict[str, hm.Routing] = {}
        self.sessions: dict[str, ProbeSession] = {}
        self.heartbeats: collections.Counter[str] = collections.Counter()
        self.malformed: collections.Counter[str] = collections.Counter()
        self.xds_requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.xds_responses: collections.Counter[str] = collections.Counter()
        self.xds_nacks: collections.Counter[str] = collections.Counter()
        self._dirty: set[str] = set()
        self._publish_scheduled = False
        self._gate_open: set[str] = set()
        self._started_mono = 0.0
        self.ads = AdsServicer(self.cache, AdsHooks(on_request=self._on_xds_request,
                                                    on_response=self._on_xds_response))
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
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ])
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self.ads, self._grpc)
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

    def observe(self, node_id: str, obs: hm.Observation, now_s: float) -> None:
        """Feed one observation for a node (called by probe sessions and the admin API)."""
        if isinstance(obs, hm.HeartbeatObserved):
            self.heartbeats[node_id] += 1
        nh, events = hm.step(self.health[node_id], obs, now_s, self.config.health)
        self.health[node_id] = nh
        cluster = self.node_cluster[node_id]
        for ev in events:
            rec = EventRecord(time.time(), cluster, ev)
            self.events.append(rec)
            log.info("node %s: %s -> %s (%s)", node_id, ev.from_state.value, ev.to_state.value, ev.reason)
        r = hm.route(nh, self.node_cfg[node_id].capacity, self.config.health)
        if self.routing.get(node_id) != r:
            self.routing[node_id] = r
            self._mark_dirty(cluster)

    def _mark_dirty(self, cluster: str) -> None:
        if cluster not in self._gate_open:
            c = next(c for c in self.config.clusters if c.name == cluster)
            if all(self.health[n.id].state is not hm.NodeState.COLD for n in c.nodes):
                self._gate_open.add(cluster)
            else:
                return
        self._dirty.add(cluster)
        if not self._publish_scheduled and self._loop is not None:
            self._publish_scheduled = True
            self._loop.call_soon(self._publish)

    def _open_all_gates(self) -> None:
        for c in self.config.clusters:
            if c.name not in self._gate_open:
                cold = [n.id for n in c.nodes if self.health[n.id].state is hm.NodeState.COLD]
                log.warning("warm-up timeout: publishing %s with %d node(s) still COLD: %s",
                            c.name, len(cold), ", ".join(cold))
                self._gate_open.add(c.name)
                self._mark_dirty(c.name)

    def _publish(self) -> None:
        self._publish_scheduled = False
        dirty, self._dirty = self._dirty, set()
        for c in self.config.clusters:
            if c.name in dirty:
                routing = {n.id: self.routing.get(n.id) or hm.route(
                    self.health[n.id], n.capacity, self.config.health) for n in c.nodes}
                self.cache.set_resource(CLA_TYPE_URL, c.name, build_cla(c, routing))

    # -- hooks -------------------------------------------------------------------------------

    def _on_malformed(self, node_id: str, what: str) -> None:
        self.malformed[node_id] += 1

    def _on_xds_request(self, stream, verdict) -> None:
        self.xds_requests[(verdict.type_url.rsplit(".", 1)[-1], verdict.kind)] += 1
        if verdict.kind == "nack":
            self.xds_nacks[verdict.type_url.rsplit(".", 1)[-1]] += 1

    def _on_xds_response(self, stream, resp) -> None:
        self.xds_responses[resp.type_url.rsplit(".", 1)[-1]] += 1

    # -- views -------------------------------------------------------------------------------

    def cla_version(self, cluster: str) -> str:
        """Content version of a cluster's ClusterLoadAssignment ("" before first publish)."""
        r = self.cache.resources(CLA_TYPE_URL).get(cluster)
        return r.version if r else ""

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
            "state": nh.state.value,
            "reason": nh.reason,
            "since_s_ago": round(now - nh.since_s, 3),
            "weight": r.weight,
            "full_weight": n.capacity * 100,
            "eds_health_status": r.health_status,
            "published": cluster in self._gate_open,
            "xds_version": self.cla_version(cluster),
            "probe_stream_connected": bool(sess and sess.connected),
            "heartbeats": self.heartbeats[node_id],
            "consecutive_misses": nh.consecutive_misses,
            "last_heartbeat_s_ago": None if nh.last_heartbeat_s is None else round(now - nh.last_heartbeat_s, 3),
            "last_rtt_ms": nh.last_rtt_ms,
            "ewma_rtt_ms": nh.ewma_rtt_ms,
            "last_ttft_ms": nh.last_ttft_ms,
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
