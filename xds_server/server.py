"""The control-plane process: wires probe sources -> core -> snapshot cache -> ADS, plus admin.

Data flows one way (docs/DESIGN.md section 1): probe sources feed observations into the
:class:`~xds_server.control.core.ControlCore`; each assignment it decides is built by the one publisher
(:class:`~xds_server.xds.publisher.EnvoyPublisher`: Clusters and ClusterLoadAssignments with their
shift placement and drops) into the :class:`~xds_server.xds.cache.SnapshotCache`, which ADS streams to Envoy;
routing listeners hear each published change; the admin app reads a ``ControlPlaneView``. A reload
(:meth:`ControlPlane.reload_file`) keeps ADS streams open (:mod:`xds_server.control.reload`); with ``state.path``
the routing state is kept across restarts (:mod:`xds_server.control.state_file`).

Only the I/O is here. The clock and the probe-source factory are injectable, so tests drive it
without sockets: ``cp = ControlPlane(config, clock=ManualClock(), probe_sources=InMemoryProbes()); cp.open()``.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping

import grpc
from aiohttp import web

from xds_server.admin.access import start_admin_site, watch_certificates
from xds_server.admin.app import HttpErrorLog, build_admin_app
from xds_server.admin.reload import add_reload_route
from xds_server.admin.shift_routes import add_shift_routes
from xds_server.admin.views import ControlPlaneView, ServedTls
from xds_server.config import ClusterConfig, ConfigError, NodeConfig, SentinelConfig, load_config, parse_hostport
from xds_server.control.core import ControlCore
from xds_server.control.events import EventLog, EventRecord
from xds_server.control.publish import ClusterPublish
from xds_server.control.reload import drained, plan_reload, serving_config
from xds_server.control.state_file import file_signature, load_kept_state, save_core_state
from xds_server.discovery import Discovery, drop_readdressed
from xds_server.feed.events import RoutingListener, RoutingNotifier
from xds_server.feed.service import RoutingFeed
from xds_server.health import model as hm
from xds_server.load.gated_shifts import ShiftService
from xds_server.load.service import LoadReportingService
from xds_server.probing.dial_in import dial_in_used, probe_source
from xds_server.probing.hub import ProbeHub
from xds_server.probing.session import grpc_probe_source
from xds_server.probing.sources import ProbeSource, ProbeSourceContext, ProbeSourceFactory
from xds_server.probing.switchback import SwitchbackValidator
from xds_server.probing.workers import WorkerPool
from xds_server.process.clock import Clock, LoopClock
from xds_server.process.counters import Counters
from xds_server.process.grpc_wakeups import start_server
from xds_server.process.refusals import Refusals
from xds_server.process.tls import add_port, listener_credentials, node_allow_authorizer
from xds_server.xds.ads import AdsServicer
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.publisher import EnvoyPublisher
from xds_server.xds.resources import RESOURCE_TYPES

__all__ = ["ControlPlane", "EventRecord"]

log = logging.getLogger(__name__)

class ControlPlane:
    """Everything one xds-server process runs. ``await start()`` / ``await stop()``.

    ``clock``: default the running loop's (:class:`~xds_server.process.clock.LoopClock`).
    ``probe_sources``: factory of one probe source per node (default: a gRPC stream to the
    node's agent). Public parts: ``config``, ``core``, ``view``, ``cache``, ``ads``,
    ``sessions`` (node id -> probe source), ``counters``, ``routing_listeners`` (called per
    published change, see :mod:`xds_server.feed.events`), ``xds_port``, ``admin_port``.
    """

    def __init__(self, config: SentinelConfig, *, clock: Clock | None = None,
                 probe_sources: ProbeSourceFactory | None = None, config_path: str | None = None) -> None:
        self.discovery = Discovery(lambda: self._apply(self.discovery.merged(), "discovery"))
        config = self.discovery.configure(config)  # + discovered nodes (xds_server.discovery)
        self._config = config
        self._declared = config  # the last accepted config, without nodes still draining out
        self.config_path = config_path
        self._leaving: dict[str, tuple[ClusterConfig, NodeConfig]] = {}
        self._applying = asyncio.Lock()
        self._file_sig: tuple[float, str] | None = None
        self._tasks: list[asyncio.Task] = []
        self.reload_status: dict = {"ok": True, "source": None, "at": None, "errors": [], "changes": None}

        self.clock: Clock = clock if clock is not None else LoopClock()
        self.counters = Counters()
        self.cache = SnapshotCache(validators={tu: t.validate for tu, t in RESOURCE_TYPES.items()},
                                   memo_max_entries=config.xds.limits.memo_max_entries,
                                   memo_max_bytes=config.xds.limits.memo_max_bytes)
        # probe.workers >= 1: probe streams and per-node models in worker processes (probing/workers)
        pool = self.probe_pool = WorkerPool.for_config(config, lambda: self.core, self.clock, self.counters,
                                                       lambda: self.hub) if probe_sources is None else None
        self.core = ControlCore(config, self.clock, on_publish=self._write, counters=self.counters,
                                forward_fail_static_end=pool.forward_fail_static_end if pool else None)
        self._notifier = RoutingNotifier()
        self.routing_listeners: list[RoutingListener] = self._notifier.listeners
        inbound = pool.source if pool and pool.accepts_agents else None  # dial-in nodes: workers accept their agents
        self._probe_factory = probe_sources or probe_source(pool.source if pool else grpc_probe_source, inbound)
        self.sessions: dict[str, ProbeSource] = {}
        self.refusals = Refusals(logging.getLogger("xds_server.access"))  # refused identities and tokens
        self.ads = AdsServicer(self.cache, config=config.xds, refusals=self.refusals,
                               authorize=node_allow_authorizer(lambda: self._config.tls.node_allow))
        self.load = LoadReportingService(  # LRS, ADS's allow-list (xds_server/load)
            lambda: self._config, monotonic=self.clock.now, authorize=self.ads.authorize, refusals=self.refusals,
            core=self.core)
        self.load.shedder.read_sessions(self.sessions)  # KV usage and the engines' finished counts
        self.shifts = ShiftService(lambda: self._config, self.core, self.load)
        self.publisher = EnvoyPublisher(self.cache, lambda: self._config, layout=self.shifts.layout,  # CDS + EDS
                                        closing=self.shifts.closing, drop=self.load.cla_args,
                                        admission=self.load.admission)
        self.switchback = SwitchbackValidator(lambda: self._config, self.core, self.observe,  # replay before routing
                                              lambda n: self._config.tls.agents.client(n), config.xds.replica_id,
                                              sessions=self.sessions)
        self.routing_feed = RoutingFeed(self, live_prompts=self.switchback.live)  # the relay's feed, on the xDS port
        self.hub = ProbeHub(config=lambda: self._config, session_of=self.sessions.get, registry=self.discovery.agents,
                            refusals=self.refusals, counters=self.counters, now=self.clock.now,  # agents dial in
                            identity_checked=lambda: self._config.tls.mode == "mtls")
        self._served_tls = ServedTls()  # the xDS port's certificates, once start() serves it
        self.view = ControlPlaneView(
            self.core, self.cache, self.ads, self.sessions, lambda: self._config, refusals=self.refusals,
            load_reports=self.load, shifts=self.shifts, switchback=self.switchback, probe_pool=self.probe_pool,
            routing_feed=self.routing_feed, reload_status=lambda: self.reload_status,
            discovery_status=self.discovery.status, served_tls=lambda: self._served_tls)
        self._grpc: grpc.aio.Server | None = None
        self._agents_grpc: grpc.aio.Server | None = None  # probe.dial_in.listen: the agents' own port
        self.agents_port = 0
        self._admin_runner: web.AppRunner | None = None
        self._opened = False
        self.xds_port = self.admin_port = 0

    @property
    def config(self) -> SentinelConfig:
        return self._config

    @config.setter
    def config(self, value: SentinelConfig) -> None:
        """Replace the config the admin endpoint reads (token, limits), not clusters or thresholds."""
        self._config = value

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self) -> None:
        """Start deciding without binding ports: nodes COLD, CDS into the cache, one probe source
        per node started, warm-up timer armed. ``start()`` calls it; idempotent."""
        if self._opened:
            return
        self._opened = True
        self.core.begin()
        self.core.restored, self.core.restored_until_s = load_kept_state(  # also for nodes found later
            self.config.state, None, self.clock.now(), self.clock.wall())
        self.publisher.clusters(self.config)
        ctx = self._probe_context(self.config)
        for node_id, n in self.core.node_cfg.items():
            s = self._probe_factory(n, ctx)
            self.sessions[node_id] = s
            s.start()

    async def start(self) -> None:
        """Bind the ADS and admin ports, publish CDS, start one probe source per node. Raises
        OSError when a port cannot be bound."""
        self.open()
        own_port = self.config.probe.dial_in.listen  # agents dial in here (ProbeHub), or beside ADS
        shared = dial_in_used(self.config) and own_port is None  # their keepalive is server-wide
        options = dict(self.config.xds.grpc_server_options() + (self.config.probe.dial_in_options() if shared else []))
        self._grpc = grpc.aio.server(options=list(options.items()))
        self.ads.add_to_server(self._grpc)  # ADS (SotW + delta), responses encoded once per content
        if own_port is None:
            self.hub.add_to_server(self._grpc)
        self.routing_feed.add_to_server(self._grpc)  # the routing feed for the relay, same port
        self.load.add_to_server(self._grpc)  # LRS StreamLoadStats (lrs.enabled), same port
        host, port = parse_hostport(self.config.xds.listen)
        creds, tls_files = listener_credentials(**self.config.tls.listener())  # None: plaintext
        self._served_tls = ServedTls(tls_files, watch_certificates(self.config))  # + expiry metrics, /readyz
        try:
            self.xds_port = add_port(self._grpc, f"{host}:{port}", creds)
        except RuntimeError as exc:  # grpc raises RuntimeError when the bind fails
            raise OSError(f"cannot bind xDS port {self.config.xds.listen} (xds.listen): in use or not "
                          f"permitted ({exc})") from exc
        if self.xds_port == 0:
            raise OSError(f"cannot bind xDS port {self.config.xds.listen} (xds.listen): in use or not permitted")
        await start_server(self._grpc)  # and gRPC's completions read in one go per loop turn
        if self.probe_pool is not None and self.probe_pool.accepts_agents:
            self.agents_port = self.probe_pool.accept_agents(self.config)  # every worker, on dial_in.listen
        elif own_port is not None:
            self._agents_grpc, self.agents_port = await self.hub.serve(own_port, creds, self.config)

        app = build_admin_app(self.view, self.drain)
        add_reload_route(app, lambda: self.config, self.reload_file)
        add_shift_routes(app, self.shifts)  # and the shifts' tick loop, for the app's lifetime
        self._admin_runner = web.AppRunner(app, access_log=None,
                                           logger=HttpErrorLog(logging.getLogger("aiohttp.server")))
        await self._admin_runner.setup()
        ahost, self.admin_port, scheme = await start_admin_site(self._admin_runner, self.config.admin)
        log.info("xds-server: ADS on %s:%d (%s), admin on %s://%s:%d", host, self.xds_port,
                 self.config.tls.mode or "plaintext", scheme, ahost, self.admin_port)
        self._file_sig = file_signature(self.config_path)
        rc = self.config.reload
        loops: list[tuple[Callable[[], float], Callable[[], Awaitable[object]], str]] = [
            (lambda: self.config.reload.drain_check_interval.s, self.reap_drained, "dropping drained nodes"),
            (lambda: self.config.health.validation.check_interval.s, self.switchback.check,
             "switch-back validation")]
        if self.config.state.path:
            loops.append((lambda: self.config.state.write_interval.s, self._write_state_async, "writing state"))
        if self.config_path and rc.watch_interval.s > 0:
            loops.append((lambda: self.config.reload.watch_interval.s or 1.0, self._check_file, "config watch"))
        self._tasks = [asyncio.create_task(self._every(*loop)) for loop in loops] + self.load.peers.start()  # lrs.peers
        await self.discovery.start()

    async def stop(self) -> None:
        """Stop probe sources, timers, the ADS server and the admin server."""
        for t in self._tasks:
            t.cancel()
        done, stuck = await asyncio.wait(self._tasks, timeout=5.0) if self._tasks else (set(), set())
        for t in done:  # stopping anyway: their errors are read so none is reported as never retrieved
            _ = t.cancelled() or t.exception()
        for t in stuck:
            log.error("stopping: task %s did not end within 5 s of its cancel", t.get_name())
        self._tasks.clear()
        await self.discovery.stop()
        if self._opened:
            self.write_state()
        self.core.end()
        # all at once: one after another, a saturated loop took minutes to stop 1,000 sessions
        for r in await asyncio.gather(*(s.stop() for s in self.sessions.values()), return_exceptions=True):
            if isinstance(r, Exception):  # one source's failure must not keep the rest running
                log.error("stopping probe source failed: %r", r)
        if self.probe_pool is not None:
            await self.probe_pool.stop()
        for srv in (self._grpc, self._agents_grpc):
            if srv is not None:
                await srv.stop(grace=0.5)
        if self._admin_runner:
            await self._admin_runner.cleanup()

    # -- state kept across restarts (format in xds_server.control.state) ------------------------

    def write_state(self) -> bool:
        """Write the routing state to ``state.path`` atomically; False (logged) when it cannot."""
        return save_core_state(self.config.state.path, self.core)

    async def _write_state_async(self) -> None:
        self.write_state()

    def _probe_context(self, cfg: SentinelConfig) -> ProbeSourceContext:
        return ProbeSourceContext(cfg.health, cfg.probe, self.core.observe, self.clock, self.counters,
                                  cfg.xds.replica_id, cfg.tls.agents)

    # -- reload (rules in xds_server.control.reload) ---------------------------------------------

    async def reload(self, new: SentinelConfig, source: str = "api") -> dict:
        """Serve ``new`` + discovered nodes from now on; ADS streams stay open. Nodes added start COLD,
        nodes removed are published DRAINING and dropped once drained (readdressed: dropped and
        added), thresholds apply at once; listen addresses, ``xds.replica_id`` and ``tls.listener()``
        keep their running values (``restart_needed``). Returns the changes as JSON (also in
        ``reload_status``)."""
        changes = await self._apply(self.discovery.configure(new), source)
        self.counters.config_reloads["ok"] += 1
        self.reload_status = {"ok": True, "source": source, "at": self.clock.wall(), "errors": [],
                              "changes": changes}
        return changes

    async def _apply(self, new: SentinelConfig, source: str) -> dict:
        async with self._applying:  # one change of node set at a time (reload, discovery, reap)
            self._declared, self._leaving, gone = drop_readdressed(self._declared, self._leaving, self._config, new)
            if gone:  # another server under the same id: the old one is dropped first, added below
                await self._serve_config(serving_config(self._declared, self._leaving))
            plan = plan_reload(self._declared, self._leaving, new)  # pure (xds_server.control.reload)
            self._declared, self._leaving, diff = plan.declared, plan.leaving, plan.diff
            await self._serve_config(serving_config(plan.declared, plan.leaving), restart=set(diff.changed))
            for node_id in plan.newly_leaving:
                self.core.drain(node_id, True, f"removed ({source})")
            for node_id in plan.returning:
                self.core.drain(node_id, False, f"back ({source})")
            log.info("config reloaded (%s): %d added, %d removed, %d changed%s", source, len(diff.added),
                     len(diff.removed), len(diff.changed),
                     f"; needs a restart to apply: {', '.join(diff.restart_needed)}" if diff.restart_needed else "",
                     extra={"reason": source})
            return diff.to_json()

    async def reload_file(self, source: str = "file") -> dict:
        """Re-read ``config_path`` and :meth:`reload` it. An invalid file changes nothing: its
        errors go to the log, ``reload_status`` (admin /readyz) and the reload counter; returns
        ``reload_status``."""
        if not self.config_path:
            raise ValueError("no config file to reload (the control plane was started without one)")
        self._file_sig = file_signature(self.config_path)
        try:
            new = load_config(self.config_path)
        except ConfigError as e:
            self.counters.config_reloads["invalid"] += 1
            errors = str(e).splitlines()
            self.reload_status = {"ok": False, "source": source, "at": self.clock.wall(), "errors": errors,
                                  "changes": None}
            log.error("config reload (%s) rejected, running config kept: %s", source, " | ".join(errors),
                      extra={"reason": source})
            return self.reload_status
        await self.reload(new, source)
        return self.reload_status

    async def _serve_config(self, serving: SentinelConfig, restart: Collection[str] = frozenset()) -> None:
        """Make ``serving`` the running config: core, CDS, one probe source per node."""
        added, dropped = self.core.reconfigure(serving)
        self._config = serving
        self.publisher.clusters(serving)
        for node_id in dropped:
            self._notifier.forget(node_id)
            s = self.sessions.pop(node_id, None)
            if s is not None:
                await s.stop()
        ctx = self._probe_context(serving)
        for node_id in [*added, *(i for i in restart if i in self.sessions)]:
            old = self.sessions.pop(node_id, None)
            if old is not None:
                await old.stop()
            s = self._probe_factory(self.core.node_cfg[node_id], ctx)
            self.sessions[node_id] = s
            s.start()
        if self.core.planner.dirty:
            self.core.publish()

    async def reap_drained(self) -> list[str]:
        """Drop the nodes removed by a reload that have drained; returns their ids."""
        async with self._applying:
            now = self.clock.now()
            done = [i for i in self._leaving
                    if i in self.core.health and drained(self.core.health[i], now, self.config.health.drain_timeout.s)]
            if done:
                for node_id in done:
                    del self._leaving[node_id]
                await self._serve_config(serving_config(self._declared, self._leaving))
                log.info("dropped %d node(s) removed from config: %s", len(done), ", ".join(done))
            return done

    async def _every(self, interval_s: Callable[[], float], step: Callable[[], Awaitable], what: str) -> None:
        """``await step()`` every ``interval_s()`` seconds until cancelled; failures are logged."""
        while True:
            await asyncio.sleep(interval_s())
            try:
                await step()
            except Exception:  # keep going
                log.exception("%s failed", what)

    async def _check_file(self) -> None:
        """Reload when the config file's content changed since it was last read."""
        sig = file_signature(self.config_path)
        if sig is not None and self._file_sig is not None and sig[1] != self._file_sig[1]:
            await self.reload_file("file change")
        elif sig is not None:
            self._file_sig = sig

    # -- observations -> core; core -> cache ---------------------------------------------------

    def observe(self, node_id: str, obs: hm.Observation, now_s: float) -> float | None:
        """Feed one observation for a node (the probe sources' sink); returns when its next
        :class:`~xds_server.health.model.Tick` is due (the clock's monotonic time, s), or None."""
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
        if self.publisher.assignment(c, p.routing) and self.routing_listeners:
            nodes = [self.core.node_cfg[i] for i in p.patched] if p.patched else c.nodes  # a patch changed only these
            self._notifier.announce_changes(c.name, nodes, p.routing, self.core.health.unsettled,
                                            self.cla_version(c.name), self.clock.wall())

    # -- read-only shortcuts (benchmarks and tests read these) ---------------------------------

    @property
    def health(self) -> Mapping[str, hm.NodeHealth]:
        """Node id -> NodeHealth (the core's table, :mod:`xds_server.control.node_table`; read only)."""
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
