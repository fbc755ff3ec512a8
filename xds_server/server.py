"""The control-plane process: wires probe sources -> core -> snapshot cache -> ADS, plus admin.

Data flows one way (docs/DESIGN.md section 1): probe sources feed observations into the
:class:`~xds_server.control.core.ControlCore` (health, events, fail-static, publish scheduling);
each assignment it decides is built into a ClusterLoadAssignment in the
:class:`~xds_server.xds.cache.SnapshotCache`, which ADS (SotW and delta, on ``xds.listen``)
streams to Envoy; routing listeners hear each published change; the admin app (on
``admin.listen``) reads a :class:`~xds_server.control.views.ControlPlaneView`.

:class:`ControlPlane` does the I/O: binding ports, starting probe sources, writing the cache. The
clock and the probe-source factory are injectable, so tests can drive it without sockets::

    cp = ControlPlane(config, clock=ManualClock(), probe_sources=InMemoryProbes())
    cp.open()       # as start() without the ports
"""
from __future__ import annotations

import logging
import time

import grpc
from aiohttp import web

from xds_server.admin.app import HttpErrorLog, build_admin_app
from xds_server.config import NodeConfig, SentinelConfig, parse_hostport
from xds_server.control.clock import Clock, LoopClock
from xds_server.control.core import ControlCore
from xds_server.control.counters import Counters
from xds_server.control.events import EventLog, EventRecord
from xds_server.control.probes import ProbeSource, ProbeSourceContext, ProbeSourceFactory, grpc_probe_source
from xds_server.control.publish import ClusterPublish
from xds_server.control.views import ControlPlaneView
from xds_server.health import model as hm
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

class ControlPlane:
    """Everything one xds-server process runs. ``await start()`` / ``await stop()``.

    ``clock``: default the running loop's (:class:`~xds_server.control.clock.LoopClock`).
    ``probe_sources``: factory of one probe source per node (default: a gRPC stream to the
    node's agent). Public parts: ``config``, ``core``, ``view``, ``cache``, ``ads``,
    ``sessions`` (node id -> probe source), ``counters``, ``routing_listeners`` (called per
    published change, see :mod:`xds_server.routing_events`), ``xds_port``, ``admin_port``.
    """

    def __init__(self, config: SentinelConfig, *, clock: Clock | None = None,
                 probe_sources: ProbeSourceFactory | None = None) -> None:
        self._config = config
        self.clock: Clock = clock if clock is not None else LoopClock()
        self.counters = Counters()
        self.cache = SnapshotCache(config.xds.server_id,
                                   validators={tu: t.validate for tu, t in RESOURCE_TYPES.items()},
                                   memo_max_entries=config.xds.memo_max_entries,
                                   memo_max_bytes=config.xds.memo_max_bytes)
        self.core = ControlCore(config, self.clock, on_publish=self._write, counters=self.counters)
        self.routing_listeners: list[RoutingListener] = []
        self._notified: dict[str, tuple[str, str]] = {}
        self._probe_factory = probe_sources if probe_sources is not None else grpc_probe_source
        self.sessions: dict[str, ProbeSource] = {}
        self.ads = AdsServicer(self.cache, config=config.xds)
        self.view = ControlPlaneView(self.core, self.cache, self.ads, self.sessions, lambda: self._config)
        self._grpc: grpc.aio.Server | None = None
        self._admin_runner: web.AppRunner | None = None
        self._opened = False
        self.xds_port = 0
        self.admin_port = 0

    @property
    def config(self) -> SentinelConfig:
        return self._config

    @config.setter
    def config(self, value: SentinelConfig) -> None:
        """Replace the config the admin endpoint reads (token, limits); clusters, nodes and
        thresholds stay those the control plane was built with."""
        self._config = value

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self) -> None:
        """Start deciding without binding ports: nodes COLD, CDS into the cache, one probe source
        per node started, warm-up timer armed. ``start()`` calls it; idempotent."""
        if self._opened:
            return
        self._opened = True
        self.core.begin()
        self.cache.set_resources(
            CLUSTER_TYPE_URL, {c.name: build_cluster(c) for c in self.config.clusters}
        )
        ctx = ProbeSourceContext(self.config.health, self.config.probe, self.observe, self.clock,
                                 self.counters, self.config.xds.server_id)
        for node_id, n in self.core.node_cfg.items():
            s = self._probe_factory(n, ctx)
            self.sessions[node_id] = s
            s.start()

    async def start(self) -> None:
        """Bind the ADS and admin ports, publish CDS, start one probe source per node.

        Raises OSError when a port cannot be bound.
        """
        self.open()
        self._grpc = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", self.config.xds.max_receive_message_bytes),
            ("grpc.keepalive_time_ms", self.config.xds.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.config.xds.keepalive_timeout_ms),
            ("grpc.http2.min_ping_interval_without_data_ms", self.config.xds.min_client_ping_interval_ms),
        ])
        self.ads.add_to_server(self._grpc)  # ADS (SotW + delta), responses encoded once per content
        from xds_server.routing_feed import RoutingFeed  # routing feed for the relay, same port
        self.routing_feed = RoutingFeed(self).add_to_server(self._grpc)
        self.view.routing_feed = self.routing_feed  # read by admin/metrics.py
        host, port = parse_hostport(self.config.xds.listen)
        self.xds_port = self._grpc.add_insecure_port(f"{host}:{port}")
        if self.xds_port == 0:
            raise OSError(f"cannot bind xDS port {self.config.xds.listen}")
        await self._grpc.start()

        self._admin_runner = web.AppRunner(build_admin_app(self.view, self.drain), access_log=None,
                                           logger=HttpErrorLog(logging.getLogger("aiohttp.server")))
        await self._admin_runner.setup()
        ahost, aport = parse_hostport(self.config.admin.listen)
        site = web.TCPSite(self._admin_runner, ahost, aport)
        await site.start()
        self.admin_port = self._admin_runner.addresses[0][1]
        log.info("xds-server: ADS on %s:%d, admin on http://%s:%d", host, self.xds_port, ahost, self.admin_port)

    async def stop(self) -> None:
        """Stop probe sources, timers, the ADS server and the admin server."""
        self.core.end()
        for s in self.sessions.values():
            try:
                await s.stop()
            except Exception:  # noqa: BLE001 - one source's failure must not keep the rest running
                log.exception("stopping probe source failed")
        if self._grpc:
            await self._grpc.stop(grace=0.5)
        if self._admin_runner:
            await self._admin_runner.cleanup()

    # -- observations -> core; core -> cache ---------------------------------------------------

    def observe(self, node_id: str, obs: hm.Observation, now_s: float) -> float | None:
        """Feed one observation for a node (the probe sources' sink).

        Returns when the node's next :class:`~xds_server.health.model.Tick` is due (the clock's
        monotonic time, s), or None.
        """
        return self.core.observe(node_id, obs, now_s)

    def drain(self, node_id: str, drain: bool, reason: str) -> dict:
        """Operator drain/undrain of a node, published at once; returns its view. KeyError if unknown."""
        self.core.drain(node_id, drain, reason)
        return self.view.node(node_id)

    def node_view(self, node_id: str) -> dict:
        """JSON-able state of one node (see :meth:`ControlPlaneView.node`)."""
        return self.view.node(node_id)

    def cla_version(self, cluster: str) -> str:
        """Content version of a cluster's ClusterLoadAssignment ("" before first publish)."""
        return self.view.cla_version(cluster)

    def _write(self, p: ClusterPublish) -> None:
        c = next(c for c in self.config.clusters if c.name == p.cluster)
        try:
            self.cache.set_resource(CLA_TYPE_URL, c.name, build_cla(c, dict(p.routing)))
        except InvalidResource as e:  # held back: Envoy would NACK it (checklist 1.9 item 17)
            log.error("not publishing %s: %s", c.name, e)
        else:
            self._notify_listeners(c.name, c.nodes, p.routing)

    def _notify_listeners(self, cluster: str, nodes: list[NodeConfig], routing) -> None:
        """Tell routing listeners about each node whose published status or state changed."""
        if not self.routing_listeners:
            return
        version = self.cla_version(cluster)
        for n in nodes:
            nh = self.core.health[n.id]
            r = routing[n.id]
            key = (r.health_status, nh.effective_state.value)
            if self._notified.get(n.id) == key:
                continue
            self._notified[n.id] = key
            change = RoutingChange(n.id, cluster, n.address, r.health_status == "HEALTHY",
                                   nh.effective_state.value, r.health_status, r.weight, nh.reason,
                                   version, self.clock.wall())
            for listener in list(self.routing_listeners):
                try:
                    listener(change)
                except Exception:  # a listener's bug must not stop publishing
                    log.exception("routing listener failed for %s", n.id)

    # -- read-only shortcuts (benchmarks and tests read these) ---------------------------------

    @property
    def health(self) -> dict[str, hm.NodeHealth]:
        """Node id -> NodeHealth (the core's; read only)."""
        return self.core.health

    @property
    def routing(self) -> dict[str, hm.Routing]:
        """Node id -> Routing as last published."""
        return self.core.routing

    @property
    def events(self) -> EventLog:
        return self.core.events

    @property
    def heartbeats(self):
        """Heartbeats received per node id (a Counter)."""
        return self.counters.heartbeats

    @property
    def event_counts(self):
        """Events per kind (``to_<STATE>`` for transitions; a Counter)."""
        return self.counters.events
