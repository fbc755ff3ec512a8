"""Main-process side of the probe workers: spawns them, hands each its nodes, applies their
reports to the control plane's health host (a :class:`HealthHost`: the
:class:`~xds_server.control.core.ControlCore`, handed over by the wiring shell), replaces a worker
that dies.

Shape::

    pool = WorkerPool.for_config(config, lambda: core, clock, counters)   # None when probe.workers is 0
    core = ControlCore(..., forward_fail_static_end=pool.forward_fail_static_end if pool else None)
    factory = pool.source            # a ProbeSourceFactory: one RemoteSource per node
    ...
    await pool.stop()                # "stop" to each worker, then SIGKILL after 2 s

A node belongs to worker ``worker_for(node_id, n)``; one whose agent dials in (the workers accept
agents on ``probe.dial_in.listen``: :mod:`._inbound`) moves to the worker that accepted its stream
when the claim is judged here (``moves``). A worker that exits (crash, SIGKILL, OOM)
is restarted after ``restart_backoff_s`` (doubling to 5 s while it keeps dying within 10 s of
its start) and gets its nodes again, each with the main process's current copy of its health:
its nodes stay as they were meanwhile (nothing here treats "worker gone" as "node gone") and
the new worker counts their silence only after ``probe.worker_restart_grace``
(:mod:`xds_server.probing.workers._detector`).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from xds_server.config import NodeConfig, SentinelConfig, parse_hostport
from xds_server.probing.claims import Claim
from xds_server.probing.sources import ProbeSourceContext
from xds_server.probing.workers._assign import worker_for
from xds_server.probing.workers._channel import encode, read_frame
from xds_server.probing.workers._host import Admitter, HealthHost
from xds_server.probing.workers._inbound import AcceptSpec
from xds_server.process.cancellation import cancel_and_wait
from xds_server.process.clock import Clock
from xds_server.process.counters import Counters
from xds_server.process.event_loop import running_loop_name
from xds_server.process.identity import PeerIdentity

__all__ = ["RemoteSource", "WorkerPool"]

log = logging.getLogger("xds_server.probing.workers")


_MAX_BACKOFF_S = 5.0
_STABLE_S = 10.0  # a worker that lived this long resets the restart backoff


def _log_format() -> str:
    """The main process's log format ("json" when its root handler writes JSON, else "text")."""
    from xds_server.process.logs import JsonFormatter

    json_out = any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)
    return "json" if json_out else "text"


class RemoteSource:
    """One node watched by a probe worker, as the control plane and its admin view see it
    (a :class:`~xds_server.probing.sources.ProbeSource`): the agent link as last reported."""

    def __init__(self, pool: WorkerPool, node: NodeConfig, ctx: ProbeSourceContext) -> None:
        self.node = node
        self.ctx = ctx
        self._pool = pool
        self.connected = False
        self.failed_dials = 0
        self.last_error = ""
        self.last_probe_failure = ""
        self.lag_deferrals = 0
        self.last_telemetry: Any = None
        self.finished: tuple[float, float] | None = None  # (the worker's loop s, count), as ProbeSession's
        # the last report that counted heartbeats (clock time, s): /nodes' heartbeat age for a
        # node whose heartbeats flow (the core keeps last_s only for silent ones)
        self.last_heartbeat_s: float | None = None
        self.worker = worker_for(node.id, pool.n)

    def start(self) -> None:
        self._pool.add(self)

    async def stop(self) -> None:
        self._pool.remove(self)


@dataclass
class _Handle:
    """One worker slot: its process and channel while it runs, its nodes always."""

    index: int
    nodes: dict[str, RemoteSource] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    writer: asyncio.StreamWriter | None = None
    task: asyncio.Task | None = None
    started_at: float = 0.0
    restarts: int = 0  # times this slot's process exited and was started again
    streams: collections.Counter[str] = field(default_factory=collections.Counter)  # agent streams open here
    backoff_s: float = 0.1
    sent_cfg: SentinelConfig | None = None  # the config whose thresholds the worker has
    pinging: int = 0  # streams sending RTT pings in the worker, as it last reported

    def send(self, msg: tuple) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(encode(msg))


class WorkerPool:
    """``n`` probe worker processes (``n`` >= 1) feeding ``core``. ``restarts``: workers
    replaced since start (per slot: :meth:`restarts_by_worker`); :meth:`live`: worker processes
    running now. ``reports``: report frames received."""

    def __init__(self, n: int, host: Callable[[], HealthHost], clock: Clock, counters: Counters,
                 hub: Callable[[], Admitter] | None = None) -> None:
        if n < 1:
            raise ValueError(f"probe.workers must be >= 1 for a pool, got {n}")
        self.n = n
        self._host = host
        self._hub = hub  # None: agents that dial in are accepted by the main process, not the workers
        self._claims: set[asyncio.Task] = set()  # verdicts being made (a reference each)
        self.clock = clock
        self.counters = counters
        self.handles = [_Handle(i) for i in range(n)]
        self.restarts = 0
        self.reports = 0
        self.moves = 0  # nodes handed to the worker that accepted their agent's stream
        self._stopping = False

    @classmethod
    def for_config(cls, config: SentinelConfig, host: Callable[[], HealthHost], clock: Clock,
                   counters: Counters, hub: Callable[[], Admitter]) -> WorkerPool | None:
        """The pool ``config.probe.workers`` asks for (None for 0: probe streams in this
        process); ``host`` gives the control core once it exists, ``hub`` the probe hub: used
        when ``probe.dial_in.listen`` is set, where the workers then accept agents."""
        n = config.probe.worker_count(os.cpu_count())
        accepting = hub if config.probe.dial_in.listen is not None else None
        return cls(n, host, clock, counters, accepting) if n >= 1 else None

    @property
    def accepts_agents(self) -> bool:
        """The workers accept agents that dial in (on ``probe.dial_in.listen``)."""
        return self._hub is not None

    @property
    def core(self) -> HealthHost:
        """The control core this pool reports to."""
        return self._host()

    # -- the ProbeSourceFactory -----------------------------------------------------------------

    def source(self, node: NodeConfig, ctx: ProbeSourceContext) -> RemoteSource:
        """A :class:`RemoteSource` for ``node`` (started by the control plane)."""
        return RemoteSource(self, node, ctx)

    def add(self, src: RemoteSource) -> None:
        h = self.handles[src.worker]
        h.nodes[src.node.id] = src
        if not self._launch(h) and h.writer is not None:
            self._send_node(h, src)

    def _launch(self, h: _Handle) -> bool:
        """Start worker ``h`` if it has not been (it gets its nodes when it runs); False if it had."""
        if h.task is not None or self._stopping:
            return False
        h.task = asyncio.get_running_loop().create_task(self._run(h), name=f"probe-worker-{h.index}")
        return True

    def accept_agents(self, cfg: SentinelConfig) -> int:
        """Start every worker now, nodes or not: each accepts agents on ``probe.dial_in.listen``
        (:mod:`._inbound`). Returns that port."""
        for h in self.handles:
            self._launch(h)
        return parse_hostport(cfg.probe.dial_in.listen or "")[1]

    def remove(self, src: RemoteSource) -> None:
        h = self.handles[src.worker]
        if h.nodes.get(src.node.id) is src:
            del h.nodes[src.node.id]
            h.send(("remove", src.node.id))

    def _send_node(self, h: _Handle, src: RemoteSource) -> None:
        self._sync_config(h)
        node_id = src.node.id
        h.send(("add", src.node, self.core.health.get(node_id), self.core.restored.get(node_id)))

    def _sync_config(self, h: _Handle) -> None:
        """Send the running thresholds when they changed since this worker last got them (a
        reload): checked at each add and each report, so they arrive within one report."""
        cfg = self.core.config
        if h.sent_cfg is not cfg:
            h.sent_cfg = cfg
            h.send(("config", cfg.health, cfg.probe, _ident(cfg)))

    def forward_fail_static_end(self, burst_start_s: float) -> set[str]:
        """Send FailStaticEnded to every running worker; returns the node ids they own."""
        out: set[str] = set()
        for h in self.handles:
            if h.writer is not None:
                h.send(("fail_static_ended", burst_start_s))
                out.update(h.nodes)
        return out

    # -- one worker's life ----------------------------------------------------------------------

    async def _spawn(self, h: _Handle) -> asyncio.StreamReader:
        parent, child = socket.socketpair()
        try:
            h.proc = subprocess.Popen(
                [sys.executable, "-m", "xds_server.probing.workers._worker", str(child.fileno()),
                 str(os.getpid()), _log_format(), str(h.index), running_loop_name()],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            child.close()
        reader, h.writer = await asyncio.open_unix_connection(sock=parent)
        h.started_at, h.pinging = time.monotonic(), 0
        cfg = h.sent_cfg = self.core.config
        h.writer.write(encode(("init", h.index, cfg.health, cfg.probe, _ident(cfg),
                               cfg.probe.worker_restart_grace.s,
                               logging.getLogger().getEffectiveLevel(), self._accept_spec(cfg))))
        for s in list(h.nodes.values()):
            self._send_node(h, s)
        log.info("probe worker %d started (pid %d, %d node(s))", h.index, h.proc.pid, len(h.nodes))
        return reader

    async def _run(self, h: _Handle) -> None:
        """Keep worker ``h`` running: spawn, read its reports until it ends, restart."""
        while not self._stopping:
            reader = None
            try:
                reader = await self._spawn(h)
                while (msg := await read_frame(reader)) is not None:
                    if msg[0] == "report":
                        self._apply(h, msg)
                    elif msg[0] == "claim" and self._hub is not None:
                        task = asyncio.get_running_loop().create_task(self._claim(h, *msg[1:]))
                        self._claims.add(task)
                        task.add_done_callback(self._claims.discard)
                    elif msg[0] == "stream":
                        self._stream(h, msg[1], msg[2])
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad frame ends this worker; it is restarted
                log.exception("probe worker %d: channel failed", h.index)
            finally:
                if h.writer is not None:
                    h.writer.close()
                    h.writer = None
            if self._stopping:
                return
            rc = await asyncio.to_thread(self._reap, h)
            for node_id, open_ in list(h.streams.items()):  # the agents' streams ended with the worker
                for _ in range(open_):
                    self._stream(h, node_id, False)
            for s in h.nodes.values():
                s.connected = False
                s.last_error = f"probe worker {h.index} exited ({rc}); restarting"
            lived = time.monotonic() - h.started_at
            h.backoff_s = 0.1 if lived >= _STABLE_S else min(h.backoff_s * 2, _MAX_BACKOFF_S)
            self.restarts += 1
            h.restarts += 1
            log.warning("probe worker %d (pid %s) exited (%s) after %.1f s: restarting in %.1f s; its %d "
                        "node(s) keep their state meanwhile", h.index, h.proc.pid if h.proc else "?", rc,
                        lived, h.backoff_s, len(h.nodes))
            await asyncio.sleep(h.backoff_s)

    @staticmethod
    def _reap(h: _Handle) -> str:
        """Wait for the worker process (killed after 2 s if it lingers); its exit as text."""
        if h.proc is None:
            return "not started"
        try:
            rc = h.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            h.proc.kill()
            rc = h.proc.wait()
        return f"signal {-rc}" if rc < 0 else f"status {rc}"

    def _apply(self, h: _Handle, msg: tuple) -> None:
        """Apply one report: health to the core, counts to the counters, links to the sources."""
        _, nodes, hb, probes, counters, links, h.pinging = msg
        self.reports += 1
        self._sync_config(h)
        now = self.clock.now()
        c = self.counters
        for node_id, n in hb.items():
            if (s := h.nodes.get(node_id)) is not None:
                c.heartbeats[node_id] += n
                s.last_heartbeat_s = now
        for key, n in probes.items():
            if key[0] in h.nodes:
                c.probe_results[key] += n
        for name, part in counters.items():
            getattr(c, name).update(part)
        for node_id, link in links.items():
            s = h.nodes.get(node_id)
            if s is not None:
                (s.connected, s.failed_dials, s.last_error, s.last_probe_failure, s.lag_deferrals,
                 s.last_telemetry, s.finished) = link
        for r in nodes:
            if r.node_id in h.nodes:
                self.core.adopt(r.node_id, r.health, list(r.events), now)

    # -- agents that dial in (the workers accept them: ._inbound) --------------------------------

    def _accept_spec(self, cfg: SentinelConfig) -> AcceptSpec | None:
        listen = cfg.probe.dial_in.listen
        if self._hub is None or listen is None:
            return None
        return AcceptSpec(listen, cfg.tls.listener(), cfg.xds.limits.max_receive_message_bytes,
                          cfg.probe.dial_in_options())

    async def _claim(self, h: _Handle, token: int, claim: Claim, ident: PeerIdentity, peer: str) -> None:
        """Judge a claim that worker ``h`` read (as the in-process hub would); an admitted node
        moves to ``h`` (its current health with it) before ``h`` hears the verdict."""
        assert self._hub is not None
        try:
            src, code, why = await self._hub().admit(claim, ident, peer, RemoteSource)
        except Exception:  # never leave the worker's stream waiting on a verdict
            log.exception("probe worker %d: judging the claim of %s failed", h.index, claim.node.id)
            src, code, why = None, grpc.StatusCode.INTERNAL, "the control plane could not judge the claim"
        if isinstance(src, RemoteSource) and src.worker != h.index and h.writer is not None:
            self._move(src, h)
        h.send(("verdict", token, code.name, why))

    def _move(self, src: RemoteSource, to: _Handle) -> None:
        """Make ``to`` the owner of ``src``'s node: its agent's stream is there now."""
        old = self.handles[src.worker]
        if old.nodes.get(src.node.id) is src:
            del old.nodes[src.node.id]
            old.send(("remove", src.node.id))
        src.worker = to.index
        to.nodes[src.node.id] = src
        self.moves += 1
        self._send_node(to, src)

    def _stream(self, h: _Handle, node_id: str, opened: bool) -> None:
        """An agent's stream on worker ``h`` began or ended."""
        h.streams[node_id] += 1 if opened else -1
        if h.streams[node_id] <= 0:
            del h.streams[node_id]
        if self._hub is not None:
            self._hub().streamed(node_id, opened)

    def pinging_by_worker(self) -> dict[int, int]:
        """Worker index -> streams sending RTT pings there, as its process last reported (0 from
        each start until its first report)."""
        return {h.index: h.pinging for h in self.handles}

    def restarts_by_worker(self) -> dict[int, int]:
        """Worker index -> times its process exited and was started again."""
        return {h.index: h.restarts for h in self.handles}

    def live(self) -> int:
        """Worker processes running now (started and not exited; a replaced one counts once its
        successor runs)."""
        return sum(1 for h in self.handles if h.proc is not None and h.proc.poll() is None)

    # -- shutdown --------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop every worker: "stop", then wait up to 2 s, then SIGKILL; always reaped."""
        self._stopping = True
        for h in self.handles:
            h.send(("stop",))
        try:
            for h in self.handles:
                if h.task is not None:
                    with contextlib.suppress(Exception):  # its own failure: stopping anyway
                        await cancel_and_wait(h.task)
        finally:  # every worker reaped, also when our caller is cancelled meanwhile
            for h in self.handles:
                if h.proc is not None and h.proc.poll() is None:
                    await asyncio.to_thread(self._reap, h)


def _ident(cfg) -> tuple:
    """What a worker needs besides thresholds: (replica id its agents see, ``tls.agents``,
    ``xds.ramp_anchor``)."""
    return cfg.xds.replica_id, cfg.tls.agents, cfg.xds.ramp_anchor
