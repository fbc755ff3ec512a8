"""A probe worker process: holds its share of the agents' probe streams
(:class:`~xds_server.probing.session.ProbeSession` for a node it dials,
:class:`~xds_server.probing.dial_in.DialInSession` for one whose agent dials in, accepted on
``probe.dial_in.listen`` by :mod:`._inbound`; both unchanged) and feeds them into its
:class:`~xds_server.probing.workers._detector.Detector`; sends the main process only changes.

Started by :class:`~xds_server.probing.workers._pool.WorkerPool` as
``python -m xds_server.probing.workers._worker FD PARENT_PID LOG_FORMAT INDEX LOOP`` (the index is
there for ``ps``; the init message carries it too; LOOP: the parent's event loop, asyncio or
uvloop, :mod:`xds_server.process.event_loop`) with one end of a socketpair as
file descriptor FD. It exits when the channel reaches end of stream (the main process exited or
closed it), on ``("stop",)``, and (Linux) when the parent dies (``PR_SET_PDEATHSIG`` = SIGKILL),
so it is never orphaned. Reports go out at once when the detector has an urgent change
(coalesced: one frame per event-loop turn) and every ``probe.worker_report_interval``.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys
import time

import grpc

from xds_server.config import HealthConfig, NodeConfig, ProbeConfig
from xds_server.health import model as hm
from xds_server.probing.claims import Claim
from xds_server.probing.dial_in import DialInSession
from xds_server.probing.rtt_pace import PingPace
from xds_server.probing.session import ProbeSession
from xds_server.probing.workers._channel import encode, read_frame
from xds_server.probing.workers._detector import Detector
from xds_server.probing.workers._inbound import WorkerHub
from xds_server.process import event_loop, gc_tuning
from xds_server.process.counters import Counters
from xds_server.process.identity import PeerIdentity

__all__ = ["Worker", "main"]

log = logging.getLogger("xds_server.probing.workers")

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux prctl); exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the channel's end of stream still stops us
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


class Worker:
    """The sessions and detector of one worker; ``writer`` is the channel to the main process."""

    def __init__(self, index: int, health: HealthConfig, probe: ProbeConfig, ident: tuple,
                 grace_s: float, writer: asyncio.StreamWriter) -> None:
        self.index = index
        self.health, self.probe = health, probe
        self.grace_s = grace_s
        self.writer = writer
        self.detector = Detector(health)
        self._loop = asyncio.get_running_loop()
        self._ident(ident)
        self.counters = Counters()
        self.sessions: dict[str, ProbeSession] = {}
        self._links: dict[str, tuple] = {}
        self._pinging = 0  # streams pinging here, as last reported
        self._stopping: set[asyncio.Task] = set()  # sessions of removed nodes, stopping (a reference each)
        self._flush_pending = False
        self._asks: dict[int, asyncio.Future[tuple[grpc.StatusCode, str]]] = {}  # claims awaiting a verdict
        self._next_ask = 0

    def _ident(self, ident: tuple) -> None:
        """(replica id the agents see, ``tls.agents``, ``xds.ramp_anchor``) from the main process."""
        self.replica_id, self.agents_tls, anchor = ident
        self.detector.wall_offset_s = (round(time.time() - self._loop.time(), 3) if anchor == "wall_clock"
                                       else None)

    def sink(self, node_id: str, obs: hm.Observation, now_s: float) -> float | None:
        """The sessions' observation sink: the detector, then an urgent report if one is due.
        None (no Tick) for a node removed meanwhile (its session is still stopping)."""
        if node_id not in self.detector.nodes:
            return None
        at = self.detector.observe(node_id, obs, now_s)
        if self.detector.urgent and not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self.flush, False)
        return at

    def handle(self, msg: tuple) -> bool:
        """Apply one message from the main process; False on ``("stop",)``."""
        kind = msg[0]
        now = self._loop.time()
        if kind == "add":
            _, node, mirror, kept = msg
            self._add(node, mirror, kept, now)
        elif kind == "remove":
            self._remove(msg[1])
        elif kind == "config":
            _, self.health, self.probe, ident = msg
            self.detector.cfg = self.health
            self._ident(ident)
        elif kind == "fail_static_ended":
            self.detector.fail_static_ended(msg[1], now)
            self.flush(False)
        elif kind == "verdict":
            fut = self._asks.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result((grpc.StatusCode[msg[2]], msg[3]))
        elif kind == "stop":
            return False
        else:
            log.error("probe worker %d: unknown message %r ignored", self.index, kind)
        return True

    def _add(self, node: NodeConfig, mirror: hm.NodeHealth | None, kept: hm.NodeHealth | None,
             now: float) -> None:
        self._remove(node.id)
        self.detector.add(node.id, mirror, kept, now, self.grace_s)
        s = ProbeSession(node, self.health, self.sink, self.replica_id, probe=self.probe, counters=self.counters,
                         tls=self.agents_tls.client(node.id)) if node.probe_address is not None else \
            DialInSession(node, self.health, self.sink, self.replica_id, probe=self.probe, counters=self.counters)
        self.sessions[node.id] = s
        s.start()
        # the handed-over node's first Tick: at the end of its grace, unless a heartbeat comes first
        s.check_at(hm.tick_due_s(self.detector.nodes[node.id].nh, self.health, now))

    def _remove(self, node_id: str) -> None:
        s = self.sessions.pop(node_id, None)
        if s is not None:
            task = asyncio.ensure_future(s.stop())
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        self.detector.remove(node_id)
        self._links.pop(node_id, None)

    def send(self, msg: tuple) -> None:
        """One message to the main process; nothing once the channel is closing (the main
        process is stopping or gone: this worker is about to exit)."""
        if not self.writer.is_closing():
            self.writer.write(encode(msg))

    async def ask(self, claim: Claim, ident: PeerIdentity, peer: str) -> tuple[grpc.StatusCode, str]:
        """The main process's verdict on an agent's claim (:mod:`._inbound`): (status, why)."""
        self._next_ask += 1
        token = self._next_ask
        fut = self._asks[token] = self._loop.create_future()
        self.send(("claim", token, claim, ident, peer))
        try:
            return await fut
        finally:
            self._asks.pop(token, None)

    def _link(self, s: ProbeSession) -> tuple:
        return (s.connected, s.failed_dials, s.last_error, s.last_probe_failure, s.lag_deferrals,
                s.last_telemetry, s.finished)

    def flush(self, full: bool) -> None:
        """Send one report frame: urgent nodes (``full``: every changed node, the counts, the
        counters, the agents' links and the streams pinging here), if there is anything to send."""
        self._flush_pending = False
        nodes = self.detector.take(full)
        links: dict[str, tuple] = {}
        hb: dict[str, int] = {}
        probes: dict = {}
        counters: dict = {}
        pinging_changed = False
        if full:
            for node_id, s in self.sessions.items():
                link = self._link(s)
                if self._links.get(node_id) != link:
                    self._links[node_id] = links[node_id] = link
            hb, probes = dict(self.detector.heartbeats), dict(self.detector.probe_results)
            self.detector.heartbeats.clear()
            self.detector.probe_results.clear()
            c = self.counters
            counters = {"malformed": dict(c.malformed), "bad_fields": dict(c.bad_fields),
                        "handler_errors": dict(c.handler_errors), "transport_drops": dict(c.transport_drops),
                        "silent_streams": dict(c.silent_streams), "rtt_not_taken": dict(c.rtt_not_taken)}
            for part in (c.malformed, c.bad_fields, c.handler_errors, c.transport_drops, c.silent_streams,
                         c.rtt_not_taken):
                part.clear()
            if not any(counters.values()):
                counters = {}
            pinging = PingPace.pinging_on(asyncio.get_running_loop())
            pinging_changed, self._pinging = pinging != self._pinging, pinging
        else:
            for r in nodes:  # the link of a node reported now is sent with it (connected, error)
                session = self.sessions.get(r.node_id)
                if session is not None:
                    self._links[r.node_id] = links[r.node_id] = self._link(session)
        if nodes or links or hb or probes or counters or pinging_changed:
            self.send(("report", nodes, hb, probes, counters, links, self._pinging))

    async def report_loop(self) -> None:
        """A full report every ``probe.worker_report_interval``."""
        while True:
            await asyncio.sleep(self.probe.worker_report_interval.s)
            self.flush(True)
            await self.writer.drain()

    async def stop(self) -> None:
        """Stop every session."""
        await asyncio.gather(*(s.stop() for s in self.sessions.values()), return_exceptions=True)
        self.sessions.clear()


async def serve(fd: int) -> None:
    """Run a worker on the inherited socket ``fd`` until the channel ends or says stop."""
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    init = await read_frame(reader)
    if init is None or init[0] != "init":
        return
    _, index, health, probe, ident, grace_s, level, accept = init
    logging.getLogger().setLevel(level)
    w = Worker(index, health, probe, ident, grace_s, writer)
    reports = asyncio.create_task(w.report_loop())
    server = None
    try:
        if accept is not None:  # agents dial in here, this worker beside the others (SO_REUSEPORT)
            hub = WorkerHub(ask=w.ask, session_of=w.sessions.get, tell=w.send, probe=lambda: w.probe,
                            counters=w.counters, now=asyncio.get_running_loop().time)
            try:
                server, _ = await hub.serve(accept)
            except OSError as e:
                log.error("probe worker %d: %s; exiting (the main process starts another)", index, e)
                return
        while (msg := await read_frame(reader)) is not None:
            if not w.handle(msg):
                break
    finally:
        reports.cancel()
        if server is not None:
            await server.stop(grace=0.2)
        await w.stop()
        writer.close()


def main(argv: list[str] | None = None) -> int:
    """``_worker FD PARENT_PID [LOG_FORMAT [INDEX [LOOP]]]``: run one probe worker on the event
    loop LOOP (:data:`xds_server.process.event_loop.LOOPS`; default asyncio): its parent's."""
    args = sys.argv[1:] if argv is None else argv
    fd, parent = int(args[0]), int(args[1])
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the main process's to handle
    from xds_server.process.logs import configure_logging, quiet_grpc_core
    quiet_grpc_core()
    configure_logging("INFO", args[2] if len(args) > 2 else "text")
    gc_tuning.tune()  # the main process's thresholds (xds_server.process.gc_tuning)
    event_loop.run(serve(fd), args[4] if len(args) > 4 else "asyncio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
