"""Agents that dial in vs the control plane dialling them: control-plane CPU, false ejections and
frozen-host detection, side by side.

Usage: python benchmarks/dial_in.py [--nodes N ...] [--seconds S] [--freeze K] [--clients C]
           [--modes dial-in heartbeat [transport]] [--gpus G] [--settle S] [--refresh-ms M]
           [--keepalive-ms P] [--ping-timeout-ms T] [--pings P/T ...] [--cp-cpu C] [--fleet-cpu F] [--workers W ...]
           [--loop asyncio|uvloop|auto ...] [--agent-kind grpcio|h2] [--agents-nice N] [--gc tuned|default ...]
           [--freeze-groups G] [--cp-stop-dialling-s S | --cut-dialling]

The command (defaults: --nodes 300 1000 --seconds 20 --freeze 20 --clients 2 --modes dial-in
heartbeat), and a smoke test of ~30 s:

    .venv/bin/python benchmarks/dial_in.py --nodes 300 1000 --seconds 20 --freeze 20 --clients 2
    .venv/bin/python benchmarks/dial_in.py --nodes 50 --seconds 5 --freeze 5

What it measures, per mode and fleet size N (each measurement in a fresh child process that runs
the real ControlPlane, the modes one after another in one run):

- ``dial-in``: the real ControlPlane (this benchmark's child process) serves
  ``node_probe.v1.ProbeHub/Connect`` on its xDS port; no node has a ``probe_address``. Fake agents
  run in ``--clients`` separate processes (N - K nodes spread over them) plus one process for the K
  nodes to freeze. Every node is its own channel (``node_probe.dial_stream.CHANNEL_OPTIONS``, the
  real agent's: ``grpc.use_local_subchannel_pool`` = its own TCP connection). A fake agent writes
  its ``Register``, a ``Heartbeat`` (LIVENESS_TRANSPORT, interval_ms 100, engine READY, the
  telemetry of ``heartbeat_capacity.telemetry`` with ``--gpus`` GPUs) and one good
  ``InferenceResult`` (so the node is routed and can be ejected), then a heartbeat every
  ``--refresh-ms`` (the telemetry refresh), a ``Pong`` for each ``Ping``, and nothing else; a
  stream that ends is re-dialled. The server PINGs every connection every ``--keepalive-ms``
  (``probe.dial_in.keepalive``) and drops one whose PING is unanswered within
  ``--ping-timeout-ms`` (``probe.dial_in.ping_timeout``): the node is ejected. ``--pings 90/80
  100/40`` measures each pair (keepalive/ping timeout, ms) in turn, in the same run.
  With ``--agent-kind h2`` the fake agents are :mod:`h2_agents`' (HTTP/2 and gRPC's framing by
  hand, one protocol object per node on a uvloop loop, each its own TCP connection; the same
  messages): what the control plane reads is the same, the agents' own CPU ~40 % less.
  With ``--workers W`` (dial-in only) the agents dial ``probe.dial_in.listen``, where W probe
  worker processes accept them (``SO_REUSEPORT``) and hold the streams and per-node models; the
  control plane's CPU is then its main process plus its workers (``main_process_cores``,
  ``worker_cores``), and messages are not counted (they are read in the workers).
- ``heartbeat``: the control plane dials every node (``probe.liveness`` heartbeat, a heartbeat
  every 100 ms judged by its gaps); the agents are ``liveness_modes.py``'s fake fleet (imported:
  its ``_Fleet``, one loopback address per node so each stream is its own TCP connection), again
  ``--clients`` processes plus one for the K nodes to freeze.
- ``transport`` (optional): the same fleet, ``probe.liveness`` transport (the control plane
  dials, HTTP/2 PINGs from its side as a client), for comparison.

In every mode RTT pings are off (60 s) and a node's first good probe routes it at full weight
(``health.probation.ramp_start_percent`` 100: HEALTHY one 100 ms ramp step later, where the
default ramp takes 100 s), so the fleet is HEALTHY when the window starts (``states``). After
every node's stream is open and ``--settle`` more seconds, over ``--seconds`` S: the control
plane's process CPU (``resource.getrusage``, user + sys, gRPC's C threads included) and, apart,
its event-loop (Python) thread's (``time.thread_time`` sampled in the loop thread at the window's
ends), as cores and nodes per core, and every thread's by name (``thread_cores``, /proc/self/task:
gRPC's C-core threads apart from the loop); the agent processes' CPU (``/proc/PID/stat``; they share the
machine); messages received (``ProbeSession.on_message`` calls); false ejections (moves to
UNHEALTHY and outlier ejections of nodes not frozen, from the event log's ``record``; the settle's
are ``ejections_in_settle``). In the window's middle the K-node
process is SIGSTOPped (a host freeze: no FIN, no PING answered, no heartbeat) and each frozen
node's detection time, SIGSTOP -> its move to UNHEALTHY (wall clock), is reported as median, p90,
p99 and max (nodes not detected when the window ends get up to 5 s more, reported as ``detected``
< ``frozen``). With ``--freeze-groups G`` the K nodes are in G processes, SIGSTOPped one after
another at even steps over the window: G independent freezes (the nodes of one freeze are
detected within milliseconds of each other), each one's slowest node in ``group_detect_max_ms``.
In dial-in mode without workers each detection is split (median, p90, max): ``end_read_ms``,
SIGSTOP -> our loop reads the stream's lost transport (gRPC's PING deadline, then the read), itself
split into ``closed_ms``, SIGSTOP -> gRPC closed the connection (its FIN, seen on a duplicate of the
frozen agent's socket: ``pidfd_getfd``), and ``read_after_close_ms``, that close -> our read;
``off_after_read_ms``, that read -> the first publish with the node out (``off_by_full_publish``:
how many of those were a full decision, not the urgent lane's patch); and ``after_read_ms``,
that read -> UNHEALTHY (``probe.dial_in.drop_confirm``, then the verdict).
In dial-in mode, also why the streams ended in the window (``stream_ends``, the control plane's
reasons) and its verdicts on them (``transport_drops``, ``silent_streams``: node or burst); the
verdicts before the window, while the fleet dialled in and settled: ``connect_drops``,
``connect_silent``. With ``--agent-kind h2`` the live agents' own side, since they share this
machine and answer PINGs in their processes' loops: ``agents_loop_late_ms``, episodes of a live
agents' process's loop at least 20 ms late (a 5 ms timer's wake-ups), ``agents_late_past_deadline``,
those at least the PING deadline; ``live_ends``, live nodes' stream ends read in the window, and
``live_ends_after_agents_stall``, those read right after such a stall of their own process (a PING
it could not answer in time), not after a stall of ours.

A disturbance a fifth into the window (dial-in): ``--burn-s S`` runs ``--burners`` busy processes
for S seconds (on the control plane's CPU with ``--cp-cpu``: only it starves, the agents pinned
elsewhere with ``--fleet-cpu``), ``--cp-stop-s S`` SIGSTOPs the control plane for S seconds; then
``disturbance``: the fewest streams open, how long until all were open again, the dials and the
false ejections it cost. ``--agent-stable-s`` sets the simulated agents' back-off rule
(:func:`node_probe.targets.failures_after`; 0: any stream that came up starts it over).
``DIAL_IN_TRACE=S`` prints a line to stderr every S s from the control plane's start (streams
connected, nodes HEALTHY, ejections so far, dials, verdicts, the loop's lateness): how a run fell.

Output: one JSON line per measurement, then a table. Every process started (the measurement's
child, its agents) is stopped at the end, on failure and on Ctrl-C: the child runs in a process
group of its own that is SIGCONTed and SIGKILLed; a dial-in agent process also dies with its
parent (PR_SET_PDEATHSIG), the imported fleet exits within 1 s of its parent.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import logging
import multiprocessing
import os
import queue
import random
import re
import resource
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc

from node_probe.dial_stream import CHANNEL_OPTIONS, METADATA
from node_probe.proto import probe_pb2
from node_probe.targets import STABLE_S, backoff_s, failures_after
from xds_server.config import SentinelConfig, parse_config
from xds_server.process import event_loop, gc_tuning
from xds_server.testing import free_port, process_cpu_s, threads_cpu_s

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h2_agents import run_agents  # simulated agents that speak HTTP/2 by hand
from heartbeat_capacity import _q, telemetry  # the sibling benchmarks' fleet telemetry
from liveness_modes import _Fleet, _ip  # the dialled fleet (heartbeat, transport)

_CONNECT = "/node_probe.v1.ProbeHub/Connect"
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # grpc-stubs lacks grpc.aio.EOF
_CONNECT_SPREAD_S = 1.0
"""Agents start their first dial at a random point within this (s): a fleet does not connect in
one instant."""
_DETECT_GRACE_S = 5.0
_LATE_TICK_S = 0.005  # the agents' loop watch: a timer this often ...
_LATE_MIN_S = 0.02  # ... records each wake-up at least this late (the loop held or not scheduled)
_LATE_RING = 4096  # episodes kept per agents' process (the oldest overwritten)
MODES = ("dial-in", "heartbeat", "transport")


# -- processes -----------------------------------------------------------------------------------

_SYS_PIDFD_GETFD = 438  # x86-64, arm64 and every architecture of the common table (not alpha, MIPS)


class _CloseWatch:
    """When the control plane's gRPC closed each connection of an agent process we are about to
    SIGSTOP: the kernel still takes the FIN for the stopped process, and a duplicate of each of its
    sockets (``pidfd_getfd``, Linux 5.6+) held here shows it (``EPOLLRDHUP``), in a thread of its
    own: the stopped agents do not delay the reading and our event loop's lateness does not either
    (the thread waits for the GIL at most a switch interval, 5 ms, to take the time). ``closed``:
    wall times (s), one per connection closed so far; empty when the duplicates could not be taken
    (an older kernel, no ptrace permission)."""

    def __init__(self, pid: int, port: int) -> None:
        self.closed: list[float] = []
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return
        try:
            for name in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                        continue
                except OSError:  # closed meanwhile
                    continue
                fd = libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(name), 0)
                if fd < 0:
                    continue
                try:
                    s = socket.socket(fileno=fd)
                except OSError:  # not a socket any more (its number reused)
                    os.close(fd)
                    continue
                try:
                    peer = s.getpeername()
                except OSError:
                    peer = None
                if isinstance(peer, tuple) and peer[1] == port:
                    self._socks.append(s)
                else:
                    s.close()
        finally:
            os.close(pidfd)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        ep = select.epoll()
        try:
            open_fds = {s.fileno() for s in self._socks}
            for fd in open_fds:
                ep.register(fd, select.EPOLLRDHUP)  # not EPOLLIN: the stopped agent's unread PINGs
            while open_fds and not self._stop.is_set():
                for fd, _ in ep.poll(0.05):
                    self.closed.append(time.time())
                    ep.unregister(fd)
                    open_fds.discard(fd)
        finally:
            ep.close()

    def stop(self) -> None:
        self._stop.set()
        if self._socks:
            self._thread.join(1.0)
        for s in self._socks:
            s.close()


def _die_with_parent(parent: int) -> None:
    """Be SIGKILLed when the process that started us ends (Linux PR_SET_PDEATHSIG; a stopped
    process is killed too), and exit now if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class _GcTime:
    """Wall time spent in the garbage collector's collections, per generation, and the longest
    (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self.max_ms = 0.0
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            took = time.perf_counter() - self._t0
            self.seconds[info["generation"]] += took
            self.max_ms = max(self.max_ms, took * 1000.0)
            self.collections[info["generation"]] += 1

    def start(self) -> _GcTime:
        gc.callbacks.append(self._cb)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self._cb)


# -- the dial-in agents (a client process) ---------------------------------------------------------

async def _answer_pings(call: Any, out: asyncio.Queue[bytes | None]) -> None:
    """Read the control plane's messages off ``call``: a Pong for each Ping goes to ``out``, the rest
    (Hello, ProbeNow) is read and not answered; None goes to ``out`` when the stream ends."""
    try:
        while (raw := await call.read()) is not _EOF:
            m = probe_pb2.ControlMessage.FromString(raw)
            if m.WhichOneof("msg") == "ping":
                out.put_nowait(probe_pb2.AgentMessage(
                    pong=probe_pb2.Pong(seq=m.ping.seq, processing_us=5)).SerializeToString())
    finally:
        out.put_nowait(None)


async def _watch_lateness(late: Any, late_n: Any) -> None:
    """Record the agents' own loop late: a timer every :data:`_LATE_TICK_S`; each wake-up at least
    :data:`_LATE_MIN_S` late is an episode ``(wall s at the wake-up, s late)`` in the shared ring
    ``late`` (2 x :data:`_LATE_RING` doubles), ``late_n`` counting them. An h2 agent answers PINGs
    in this loop, so an episode of L s delayed every PING answer due in it by up to L s."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + _LATE_TICK_S
        await asyncio.sleep(_LATE_TICK_S)
        behind = loop.time() - due
        if behind >= _LATE_MIN_S:
            with late_n.get_lock():
                k = late_n.value % _LATE_RING
                late[2 * k], late[2 * k + 1] = time.time(), behind
                late_n.value += 1


def _episodes(late: Any, late_n: Any) -> list[tuple[float, float]]:
    """The agents' loop episodes still in the ring ``late``: ``(wall s at the wake-up, s late)``."""
    with late_n.get_lock():
        n = min(late_n.value, _LATE_RING)
        return [(late[2 * k], late[2 * k + 1]) for k in range(n)]


def _stop_us(stop_s: float) -> None:
    """An outside process SIGSTOPs this one (the control plane's) and continues it ``stop_s`` later."""
    subprocess.Popen(["sh", "-c", f"kill -STOP {os.getpid()}; sleep {stop_s}; kill -CONT {os.getpid()}"])


def _cut_by_agents(read_at: float, episodes: list[tuple[float, float]], deadline_s: float) -> bool:
    """Whether a live agent's stream end, read by our loop at wall ``read_at``, follows a stall of
    its own process's loop long enough to miss a PING deadline: an episode that held the loop over
    ``[woke - late, woke]`` with ``late`` at least ``deadline_s`` cuts a PING sent in it at
    ``deadline_s`` after the send, between ``woke - late + deadline_s`` and ``woke``; our read
    follows the cut by up to 150 ms here (the loop's own holds, the drop's confirmation)."""
    return any(late >= deadline_s and woke - late + deadline_s <= read_at <= woke + 0.15
               for woke, late in episodes)


def _agents_main(parent: int, port: int, nodes: list[tuple[str, str]], gpus: int, refresh_s: float,
                 streams: Any, ready: Any, cpu: int | None, kind: str = "grpcio", stable_s: float = STABLE_S,
                 spread_s: float = _CONNECT_SPREAD_S, late: Any = None, late_n: Any = None,
                 nice: int = 0) -> None:
    """One client process: a fake dial-in agent per ``(node_id, address)`` (see the module
    docstring); ``streams`` counts the streams opened (re-dials show as more than the nodes).
    ``kind``: ``grpcio`` (a grpc.aio channel each) or ``h2`` (:mod:`h2_agents`, by hand); with
    ``h2`` the process's loop lateness goes to ``late`` / ``late_n`` (:func:`_watch_lateness`).
    ``nice``: the process's scheduling priority (below 0 needs root; see ``--agents-nice``)."""
    _die_with_parent(parent)
    _raise_nofile()
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except PermissionError:
            sys.exit(f"--agents-nice {nice}: a priority above the default needs root")
    tels = [telemetry(k, gpus) for k in range(100)]
    ok = probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(
        seq=1, ok=True, ttft_ms=10.0, trigger="scheduled")).SerializeToString()
    target = f"127.0.0.1:{port}"
    phase = {nid: random.randrange(100) for nid, _ in nodes}  # where in the telemetry cycle each node is

    def beat(nid: str, seq: int) -> bytes:
        return probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(
            seq=seq, interval_ms=100, node_id=nid, telemetry=tels[(phase[nid] + seq) % 100],
            liveness=probe_pb2.LIVENESS_TRANSPORT)).SerializeToString()

    def register(nid: str, addr: str) -> bytes:
        return probe_pb2.AgentMessage(register=probe_pb2.Register(
            node_id=nid, cluster="llm", address=addr, agent_version="bench")).SerializeToString()

    if kind == "h2":
        def h2_first(nid: str, addr: str) -> list[bytes]:
            return [register(nid, addr), beat(nid, 1), ok]

        def dialled() -> None:
            with streams.get_lock():
                streams.value += 1

        async def run_h2() -> None:
            watch = asyncio.create_task(_watch_lateness(late, late_n)) if late is not None else None
            ready.set()
            await run_agents(port, nodes, h2_first, beat, refresh_s, dialled, lambda: os.getppid() == parent,
                             stable_s, spread_s)
            if watch is not None:
                watch.cancel()

        event_loop.run(run_h2(), "auto")
        os._exit(0)

    async def agent(nid: str, addr: str) -> None:
        loop = asyncio.get_running_loop()
        reg = register(nid, addr)

        await asyncio.sleep(random.random() * spread_s)
        fails = 0
        while True:
            opened = loop.time()
            channel = grpc.aio.insecure_channel(target, options=list(CHANNEL_OPTIONS))
            out: asyncio.Queue[bytes | None] = asyncio.Queue()
            reader: asyncio.Task[None] | None = None
            try:
                call = channel.stream_stream(_CONNECT, request_serializer=None, response_deserializer=None)(
                    None, metadata=METADATA)  # bytes in, bytes out
                with streams.get_lock():
                    streams.value += 1
                seq = 1
                await call.write(reg)
                await call.write(beat(nid, seq))  # the first heartbeat at once
                await call.write(ok)
                reader = asyncio.create_task(_answer_pings(call, out))
                nxt = loop.time() + random.random() * refresh_s  # a random refresh phase per stream
                while True:
                    try:
                        item = await asyncio.wait_for(out.get(), max(0.0, nxt - loop.time()))
                    except TimeoutError:
                        seq += 1
                        item = beat(nid, seq)
                        nxt += refresh_s
                    if item is None:
                        break  # the stream ended
                    await call.write(item)
            except asyncio.CancelledError:
                raise
            except Exception:  # the stream failed: re-dial, as a real agent does
                pass
            finally:
                if reader is not None:
                    reader.cancel()
                await channel.close(None)
            fails = failures_after(fails, loop.time() - opened, stable_s)  # as node_probe's dialer
            await asyncio.sleep(backoff_s(fails))

    async def run() -> None:
        tasks = [asyncio.create_task(agent(nid, addr)) for nid, addr in nodes]
        ready.set()
        while os.getppid() == parent:
            await asyncio.sleep(0.5)
        for t in tasks:
            t.cancel()

    asyncio.run(run())
    os._exit(0)


class _Agents:
    """A client process of fake dial-in agents (spawned: a forked child of a gRPC process hangs)."""

    def __init__(self, port: int, nodes: list[tuple[str, str]], gpus: int, refresh_s: float,
                 cpu: int | None, kind: str = "grpcio", stable_s: float = STABLE_S,
                 spread_s: float = _CONNECT_SPREAD_S, nice: int = 0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ready = ctx.Event()
        self.streams = ctx.Value("i", 0)
        self.nodes = [nid for nid, _ in nodes]
        self.late, self.late_n = ctx.Array("d", 2 * _LATE_RING, lock=False), ctx.Value("i", 0)
        self.proc = ctx.Process(target=_agents_main, daemon=True, args=(
            os.getpid(), port, nodes, gpus, refresh_s, self.streams, self._ready, cpu, kind, stable_s, spread_s,
            self.late, self.late_n, nice))

    def start(self) -> _Agents:
        self.proc.start()
        return self

    def wait_ready(self) -> None:
        """Block until the process runs its agents (RuntimeError, the process stopped, when it does not)."""
        deadline = time.monotonic() + 120.0
        while not self._ready.wait(0.2):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("a dial-in agent process did not start (see its output)")

    def stop(self) -> None:
        if self.proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.join(5)


# -- one measurement (in a fresh process) -----------------------------------------------------------

def _config(mode: str, n: int, ips: list[str], port: int, keepalive_ms: int, ping_timeout_ms: int,
            refresh_ms: int, workers: int = 0, rtt_ping_s: float = 60.0, measure_refresh: str = "1s",
            rtt_ping_budget: float = 400.0) -> SentinelConfig:
    probe: dict[str, Any] = {"transport": {"telemetry_refresh": f"{refresh_ms}ms"}}
    if mode == "dial-in":
        probe["dial_in"] = {"keepalive": f"{keepalive_ms}ms", "ping_timeout": f"{ping_timeout_ms}ms"}
        if workers:  # the workers accept the agents on a port of their own (SO_REUSEPORT)
            probe.update(workers=workers)
            probe["dial_in"]["listen"] = f"127.0.0.1:{port}"
    else:
        probe["liveness"] = mode
        if mode == "transport":
            probe["transport"].update(keepalive_time=f"{keepalive_ms}ms", ping_timeout=f"{ping_timeout_ms}ms")

    def node(i: int) -> dict[str, Any]:
        d = {"id": f"n{i}", "address": f"10.0.{i // 250}.{1 + i % 250}:8000"}
        return d if mode == "dial-in" else {**d, "probe_address": f"{ips[i]}:{port}"}

    return parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0, "publish": {"measure_refresh": measure_refresh}},
        "admin": {"listen": "127.0.0.1:0"},
        # RTT pings every --rtt-ping-s (60 s: as good as off; the default config's is 1 s); a node's
        # first good probe routes it at full weight (HEALTHY a ramp step later), not the default
        # 1 %-per-second ramp: the fleet is HEALTHY within the settle
        "health": {"rtt": {"ping_interval": f"{rtt_ping_s}s", "ping_budget": rtt_ping_budget},
                   "probation": {"ramp_start_percent": 100.0, "ramp_step": "100ms"}},
        "probe": probe,
        "clusters": [{"name": "llm", "nodes": [node(i) for i in range(n)]}]})


def _split(xs: list[Any], parts: int) -> list[list[Any]]:
    parts = max(1, min(parts, len(xs)))
    return [xs[i::parts] for i in range(parts)] if xs else []


async def measure(mode: str, n: int, seconds: float, freeze: int, clients: int, gpus: int, settle_s: float,
                  refresh_ms: int, keepalive_ms: int, ping_timeout_ms: int, cp_cpu: int | None,
                  fleet_cpu: int | None, workers: int = 0, agent_kind: str = "grpcio",
                  gc_mode: str = "tuned", freeze_groups: int = 1, rtt_ping_s: float = 60.0,
                  measure_refresh: str = "1s", cp_stop_s: float = 0.0, burn_s: float = 0.0,
                  agent_stable_s: float = STABLE_S, burners_n: int = 2,
                  rtt_ping_budget: float = 400.0, connect_spread_s: float = _CONNECT_SPREAD_S,
                  agents_nice: int = 0, stop_dialling_s: float = 0.0, cut_dialling: bool = False) -> dict[str, Any]:
    from xds_server.probing.session import ProbeSession
    from xds_server.server import ControlPlane

    _raise_nofile()
    if cp_cpu is not None:
        os.sched_setaffinity(0, {cp_cpu})
    if gc_mode == "tuned":  # as xds-server serve runs (xds_server.process.gc_tuning)
        gc_tuning.tune()
    received = [0]  # agent messages read off the streams
    on_message = ProbeSession.on_message

    def counted(self: ProbeSession, msg: Any, now: float) -> None:
        received[0] += 1
        on_message(self, msg, now)

    ProbeSession.on_message = counted  # type: ignore[method-assign]  # this process measures one run
    from xds_server.probing.dial_in import DialInSession
    ends: dict[str, list[float]] = {}  # node -> wall times its stream's lost transport was read
    confirm_lost = DialInSession._confirm_lost

    async def timed_confirm(self: DialInSession, detail: str) -> tuple[bool, str]:
        ends.setdefault(self.node.id, []).append(time.time())
        return await confirm_lost(self, detail)

    DialInSession._confirm_lost = timed_confirm  # type: ignore[method-assign]  # the same: one run
    freeze = min(freeze, n)
    ids = [f"n{i}" for i in range(n)]
    frozen = set(ids[:freeze])
    ips = [_ip(i) for i in range(n)]
    fleet_port = free_port()
    cfg = _config(mode, n, ips, fleet_port, keepalive_ms, ping_timeout_ms, refresh_ms, workers, rtt_ping_s,
                  measure_refresh, rtt_ping_budget)
    addresses = {nd.id: nd.address for c in cfg.clusters for nd in c.nodes}
    procs: list[Any] = []  # _Agents or _Fleet: .proc, .stop()
    groups = [g for g in _split(list(range(freeze)), freeze_groups) if g]  # node indices per freeze
    frozen_procs: list[Any] = []  # a process per group of nodes to freeze (none when K is 0)
    cp = None
    try:
        if mode != "dial-in":  # the agents listen before the control plane dials them
            procs = [_Fleet(fleet_port, part, gpus, fleet_cpu).start() for part in _split(ips[freeze:], clients)]
            frozen_procs = [_Fleet(fleet_port, [ips[k] for k in g], gpus, fleet_cpu).start() for g in groups]
        cp = ControlPlane(cfg)
        end_why = _StreamEnds().attach()
        ejected: list[tuple[float, str, str]] = []  # (wall s, node id, reason) of every move to UNHEALTHY
        outliers: list[tuple[float, str, str]] = []  # (wall s, node id, reason) of every outlier ejection
        rec = cp.core.events.record

        def record(wall_s: float, cluster: str, node_id: str, kind: str, reason: str, *a: Any, **k: Any) -> Any:
            if (a[1] if len(a) > 1 else k.get("to_state")) == "UNHEALTHY":
                ejected.append((wall_s, node_id, reason))
            elif kind == "outlier_ejected":
                outliers.append((wall_s, node_id, reason))
            return rec(wall_s, cluster, node_id, kind, reason, *a, **k)

        cp.core.events.record = record  # type: ignore[method-assign]  # the hook of this measurement
        publishes: list[tuple[float, float, float]] = []  # (wall s at its end, ms it took, loop CPU ms)
        unrouted_at: dict[str, float] = {}  # a frozen node -> wall s of the first publish not routing it
        unrouted_by_patch: dict[str, bool] = {}  # ... and whether that publish was the urgent lane's patch
        depth = [0]

        def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
            """``fn``, each outermost call a hold of the loop in ``publishes``: a publish, or the
            hand-over of a decision parked for a few loop turns (control/publish_turns.py)."""
            def hold(*args: Any) -> Any:
                depth[0] += 1
                t, th = time.perf_counter(), time.thread_time()
                try:
                    return fn(*args)
                finally:
                    depth[0] -= 1
                    if depth[0] == 0:
                        publishes.append((time.time(), (time.perf_counter() - t) * 1000.0,
                                          (time.thread_time() - th) * 1000.0))
            return hold

        write = cp.core.on_publish
        assert write is not None

        def written(pub: Any) -> None:
            write(pub)
            end = time.time()  # the xDS cache has it
            for i in freeze_at:
                r = pub.routing.get(i)
                if i not in unrouted_at and r is not None and r.health_status != "HEALTHY":
                    unrouted_at[i] = end
                    unrouted_by_patch[i] = bool(pub.patched)

        cp.core.on_publish = written
        cp.core.publish = timed(cp.core.publish)  # type: ignore[method-assign]  # the hooks of this measurement
        turns = cp.core._turns
        flush = timed(turns.flush)
        turns.flush = lambda: flush() if turns.parked else None  # type: ignore[method-assign]  # (one run each)
        freeze_at: dict[str, float] = {}  # a frozen node -> wall time of its process's SIGSTOP
        await cp.start()
        tracer = asyncio.create_task(_trace(cp, ids, ejected, outliers, lambda: procs, float(trace_s))) \
            if (trace_s := os.environ.get("DIAL_IN_TRACE")) else None
        t_start = time.monotonic()
        if mode == "dial-in":
            nodes = [(i, addresses[i]) for i in ids]
            port = cp.agents_port or cp.xds_port
            for part in _split(nodes[freeze:], clients):  # started here, so each dies with this thread
                procs.append(_Agents(port, part, gpus, refresh_ms / 1000.0, fleet_cpu, agent_kind, agent_stable_s,
                                     connect_spread_s, agents_nice).start())
            for members in groups:
                frozen_procs.append(_Agents(port, [nodes[k] for k in members], gpus, refresh_ms / 1000.0, fleet_cpu,
                                            agent_kind, agent_stable_s, connect_spread_s, agents_nice).start())
            for a in procs + frozen_procs:  # waited for in a thread: on the loop's it would hold our loop
                await asyncio.to_thread(a.wait_ready)  # for seconds while the first agents dial in
        procs.extend(frozen_procs)
        async def disturb_dialling() -> None:
            """As half the fleet's streams are open: the first agents' process resets every
            connection it has (h2 agents: SIGUSR1), or we are stopped once."""
            while sum(1 for i in ids if cp.sessions[i].connected) < n // 2:
                await asyncio.sleep(0.05)
            if cut_dialling:
                os.kill(procs[0].proc.pid, signal.SIGUSR1)
            else:
                _stop_us(stop_dialling_s)

        stopper = asyncio.create_task(disturb_dialling()) if stop_dialling_s > 0 or cut_dialling else None
        deadline = time.monotonic() + 60.0 + n / 50.0
        while time.monotonic() < deadline and not all(cp.sessions[i].connected for i in ids):
            await asyncio.sleep(0.1)
        all_connected_s = time.monotonic() - t_start
        if stopper is not None:
            stopper.cancel()
        await asyncio.sleep(settle_s)

        connected = sum(1 for i in ids if cp.sessions[i].connected)
        states = Counter(cp.core.health[i].state.name for i in ids)
        e0, o0, m0 = len(ejected), len(outliers), received[0]
        ends0, drops0 = Counter(end_why.reasons), Counter(cp.counters.transport_drops)
        silent0 = Counter(getattr(cp.counters, "silent_streams", {}))  # (before this counter: none)
        streams0 = sum(p.streams.value for p in procs if isinstance(p, _Agents))
        agents0 = sum(process_cpu_s(p.proc.pid) for p in procs)
        prof = None
        if os.environ.get("DIAL_IN_PROFILE"):  # where the loop thread's time goes (cProfile, top 25; F.prof: kept)
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        worker_pids = [h.proc.pid for h in cp.probe_pool.handles if h.proc is not None] if cp.probe_pool else []
        w0 = [process_cpu_s(pid) for pid in worker_pids]
        r0, th0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.monotonic()
        threads0 = threads_cpu_s()
        gc_time = _GcTime().start()
        states_at_freeze: dict[str, str] = {}
        wall0, p0 = time.time(), len(publishes)
        async def disturb(at: float, stop_s: float, burn_s: float) -> dict[str, Any]:
            # An outside process SIGSTOPs this one (the control plane) and continues it stop_s later,
            # or busy processes burn the machine's CPU for burn_s; then: how long until every
            # stream is open again, the fewest open meanwhile, the dials and ejections it cost.
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            cold = set(ids[:freeze])  # the nodes frozen in the window
            e_at, o_at = len(ejected), len(outliers)
            s_at = sum(p.streams.value for p in procs if isinstance(p, _Agents))
            fewest = n
            if stop_s > 0:
                _stop_us(stop_s)
                await asyncio.sleep(stop_s + 0.05)  # we are stopped in here; woken past its end
            else:
                pin = f"import os\nos.sched_setaffinity(0, {{{cp_cpu}}})\n" if cp_cpu is not None else ""
                burn = f"{pin}import time\nt = time.monotonic() + {burn_s}\nwhile time.monotonic() < t: pass"
                burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(burners_n)]
                while any(b.poll() is None for b in burners):
                    fewest = min(fewest, sum(1 for i in ids[freeze:] if cp.sessions[i].connected))
                    await asyncio.sleep(0.05)
            woke = time.monotonic()
            while time.monotonic() < t0 + seconds:
                up = sum(1 for i in ids[freeze:] if cp.sessions[i].connected)
                fewest = min(fewest, up)
                if up == n - freeze and time.monotonic() > woke + 2.0:  # the drops are read by then
                    break
                await asyncio.sleep(0.05)
            gone = [(i, r) for _, i, r in ejected[e_at:] + outliers[o_at:] if i not in cold]
            return {"stop_s": stop_s, "burn_s": burn_s, "fewest_open": fewest,
                    "all_open_again_s": round(time.monotonic() - woke, 2) if fewest < n - freeze else 0.0,
                    "redials": sum(p.streams.value for p in procs if isinstance(p, _Agents)) - s_at,
                    "false_ejections": sorted({r[:90] for _, r in gone})[:3], "false_ejections_n": len(gone)}

        watches: list[_CloseWatch | None] = []  # per freeze group (dial-in): when gRPC closed its connections
        stopped = asyncio.create_task(disturb(t0 + seconds / 5.0, cp_stop_s, burn_s)) \
            if cp_stop_s > 0 or burn_s > 0 else None
        for g, (grp, proc) in enumerate(zip(groups, frozen_procs, strict=True)):
            await asyncio.sleep(max(0.0, t0 + seconds * (g + 1) / (len(groups) + 1) - time.monotonic()))
            watches.append(_CloseWatch(proc.proc.pid, port) if mode == "dial-in" else None)
            at = time.time()  # after the watch is set up: its time is not the freeze's
            for k in grp:
                states_at_freeze[ids[k]] = cp.core.health[ids[k]].state.name
                freeze_at[ids[k]] = at
            os.kill(proc.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(max(0.0, t0 + seconds - time.monotonic()))
        recovery = await stopped if stopped is not None else None
        if tracer is not None:
            tracer.cancel()
        r1, th1, dt = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.monotonic() - t0
        threads1 = threads_cpu_s()
        gc_time.stop()
        w1 = [process_cpu_s(pid) for pid in worker_pids]
        if prof is not None:
            import pstats
            prof.disable()
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
            if os.environ["DIAL_IN_PROFILE"].endswith(".prof"):  # the whole profile, for pstats
                prof.dump_stats(os.environ["DIAL_IN_PROFILE"])
        agents1 = sum(process_cpu_s(p.proc.pid) for p in procs)
        msgs = received[0] - m0
        streams1 = sum(p.streams.value for p in procs if isinstance(p, _Agents))
        window = ejected[e0:]

        def first_detections() -> dict[str, float]:
            first: dict[str, float] = {}
            for at, i, _ in ejected[e0:]:
                if i in freeze_at and at >= freeze_at[i]:
                    first.setdefault(i, at)
            return first

        grace_end = time.monotonic() + _DETECT_GRACE_S
        while len(first_detections()) < freeze and time.monotonic() < grace_end:
            await asyncio.sleep(0.1)
        first = first_detections()
        unpaired = 0  # freezes whose closes and reads differ in number (not in read_after_close_ms)
        closed_ms: list[float] = []  # SIGSTOP -> gRPC closed the connection (seen on the frozen agent's socket)
        read_after_close_ms: list[float] = []  # that close -> our loop read the stream's end (in order)
        for members, w in zip(groups, watches, strict=True):
            if w is None:
                continue
            w.stop()
            stop_at = freeze_at[ids[members[0]]]
            closes = sorted(w.closed)
            reads = sorted(t for k in members
                           if (t := next((e for e in ends.get(ids[k], []) if e >= stop_at), None)) is not None)
            closed_ms += [(c - stop_at) * 1000.0 for c in closes]
            if len(closes) == len(reads):  # paired in order; a freeze with a close or a read missing is not
                read_after_close_ms += [(r - c) * 1000.0 for c, r in zip(closes, reads, strict=True)]
            else:
                unpaired += 1
        window_publishes = [ms for at, ms, _ in publishes[p0:] if at <= wall0 + dt]
        window_publish_cpu = [cpu for at, _, cpu in publishes[p0:] if at <= wall0 + dt]
        published = {i: (at - freeze_at[i]) * 1000.0 for i, at in unrouted_at.items()}
        main_cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        worker_cpu = [b - a for a, b in zip(w0, w1, strict=True)]
        cpu = main_cpu + sum(worker_cpu)  # the control plane: its main process and its probe workers
        py = th1 - th0
        detect = sorted((at - freeze_at[i]) * 1000.0 for i, at in first.items())
        read_ms: dict[str, float] = {}  # a detected node: SIGSTOP -> its stream's end read by our loop
        for i in first:
            after = [t for t in ends.get(i, []) if t >= freeze_at[i]]
            if after:
                read_ms[i] = (after[0] - freeze_at[i]) * 1000.0
        group_max = [round(max((first[ids[k]] - freeze_at[ids[k]]) * 1000.0 for k in g if ids[k] in first), 1)
                     for g in groups if any(ids[k] in first for k in g)]
        false_ej = [(i, r) for _, i, r in window + outliers[o0:] if i not in frozen]
        detect_reasons = sorted({r[:160] for at, i, r in ejected[e0:] if i in freeze_at and at >= freeze_at[i]})[:2]
        by_name: Counter[str] = Counter()  # the process's threads by name (gRPC's: grpc_*, default-executo...)
        for tid, (name, cpu_s) in threads1.items():
            by_name[name] += cpu_s - threads0.get(tid, (name, 0.0))[1]
        out: dict[str, Any] = {
            "mode": mode, "nodes": n, "clients": clients, "workers": workers, "connected": connected,
            "main_process_cores": main_cpu / dt, "worker_cores": [c / dt for c in worker_cpu],
            "all_connected_s": all_connected_s, "states": dict(states),
            "cpu_cores": cpu / dt, "py_thread_cores": py / dt, "other_threads_cores": (cpu - py) / dt,
            "cpu_us_per_node_s": cpu / dt / n * 1e6, "nodes_per_core": n / max(cpu / dt, 1e-9),
            "nodes_per_py_core": n / max(py / dt, 1e-9), "agents_cpu_cores": (agents1 - agents0) / dt,
            "messages_per_s": None if workers else msgs / dt, "false_ejections": len(false_ej),
            "false_ejection_reasons": sorted({r[:120] for _, r in false_ej})[:3],
            "outlier_ejections": len(outliers) - o0, "detect_reasons": detect_reasons,
            "gc_cores": {g: round(s / dt, 4) for g, s in enumerate(gc_time.seconds)},
            "gc_collections": gc_time.collections, "gc_max_ms": gc_time.max_ms,
            "thread_cores": {k: round(v / dt, 3) for k, v in by_name.most_common() if v / dt >= 0.005},
            "ejections_in_settle": e0 + o0,
            "settle_ejection_reasons": sorted({r[:120] for _, _, r in ejected[:e0] + outliers[:o0]})[:4],
            "frozen": freeze, "freeze_groups": len(groups),
            "group_detect_max_ms": group_max,
            # the split of a detection (dial-in, no workers): gRPC's PING deadline and our read of the
            # stream's end, then our confirmation and verdict
            "end_read_ms": _spread(sorted(read_ms.values())),
            "closed_ms": _spread(sorted(closed_ms)), "read_after_close_ms": _spread(sorted(read_after_close_ms)),
            "close_read_unpaired": unpaired,
            # frozen nodes whose first publish with them out was a full decision, not the urgent lane's patch
            "off_by_full_publish": sum(1 for patched in unrouted_by_patch.values() if not patched),
            # that read -> the first publish with the node out (the verdict, then the urgent lane's patch)
            "off_after_read_ms": _spread(sorted((unrouted_at[i] - freeze_at[i]) * 1000.0 - r
                                                for i, r in read_ms.items() if i in unrouted_at)),
            "after_read_ms": _spread(sorted((first[i] - freeze_at[i]) * 1000.0 - r for i, r in read_ms.items())),
            "detected": len(detect),
            # the time Envoy is sent the news: publishes in the window (count, build ms), and SIGSTOP ->
            # the first publish that stops routing a frozen node (slowest node per freeze too)
            "publishes": len(window_publishes), "publish_ms": _spread(sorted(window_publishes)),
            "publish_cpu_ms": _spread(sorted(window_publish_cpu)),  # the loop thread's CPU in them
            # RTT pings that gave no sample (not sent while our loop ran late, a round trip across our
            # own stall or queue: health.rtt.self_lag_max), and the samples taken, since the start
            "rtt_not_taken": _rtt_not_taken(cp, ids),
            "rtt_samples": sum(cp.core.health[i].rtt.samples for i in ids),
            "published_ms": _spread(sorted(published.values())),
            "group_published_max_ms": [round(max(published[ids[k]] for k in g if ids[k] in published), 1)
                                       for g in groups if any(ids[k] in published for k in g)],
            "window_s": dt, "load_avg": os.getloadavg()[0]}
        if recovery is not None:
            out["disturbance"] = recovery
        if mode == "dial-in":
            out["redials"] = streams1 - streams0  # streams opened in the window (a drop and its re-dial)
            out["stream_ends"] = dict((end_why.reasons - ends0).most_common(6))  # why streams ended, in the window
            out["transport_drops"] = dict(Counter(cp.counters.transport_drops) - drops0)
            out["silent_streams"] = dict(Counter(getattr(cp.counters, "silent_streams", {})) - silent0)
            # the same before the window: while the fleet dialled in and settled
            out["connect_drops"], out["connect_silent"] = dict(drops0), dict(silent0)
        if mode == "dial-in" and agent_kind == "h2":
            # the live agents' own side (they share this machine): their processes' loop late by at
            # least 20 ms (episodes, ms), those at least the PING deadline, and live nodes' stream
            # ends read in the window, apart those that follow such a stall of their own process
            stalls: list[float] = []
            live_ends = after_stall = 0
            for p in procs:
                if not isinstance(p, _Agents) or p in frozen_procs:
                    continue
                eps = [(w, late) for w, late in _episodes(p.late, p.late_n) if wall0 <= w <= wall0 + dt]
                stalls += [late * 1000.0 for _, late in eps]
                reads = [r for i in p.nodes for r in ends.get(i, []) if wall0 <= r <= wall0 + dt]
                live_ends += len(reads)
                after_stall += sum(1 for r in reads if _cut_by_agents(r, eps, ping_timeout_ms / 1000.0))
            out["agents_loop_late_ms"] = _spread(sorted(stalls))
            out["agents_late_past_deadline"] = sum(1 for ms in stalls if ms >= ping_timeout_ms)
            out["live_ends"], out["live_ends_after_agents_stall"] = live_ends, after_stall
        missed = {i: states_at_freeze.get(i) for i in sorted(frozen) if i not in first}
        if missed:  # frozen nodes with no move to UNHEALTHY: their state when frozen
            out["undetected_states_at_freeze"] = missed
        if detect:
            out.update(detect_p50_ms=statistics.median(detect), detect_p90_ms=_q(detect, 0.90),
                       detect_p99_ms=_q(detect, 0.99), detect_max_ms=max(detect))
        return out
    finally:
        if cp is not None:
            end_why.detach()
            await cp.stop()
        for p in procs + [f for f in frozen_procs if f not in procs]:  # (a failed start: not in procs yet)
            p.stop()


class _StreamEnds(logging.Handler):
    """Why agent streams ended (the control plane's "agent stream of N closed: ..." lines), the
    reason's first clause with its numbers taken out, counted."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: Counter[str] = Counter()
        self._log = logging.getLogger("xds_server.probing")
        self._level = self._log.level

    def attach(self) -> _StreamEnds:
        self._log.addHandler(self)
        if not self._log.isEnabledFor(logging.INFO):
            self._log.setLevel(logging.INFO)
        return self

    def detach(self) -> None:
        self._log.removeHandler(self)
        self._log.setLevel(self._level)

    def emit(self, record: logging.LogRecord) -> None:
        reason = getattr(record, "reason", None)
        if isinstance(reason, str) and record.getMessage().startswith("agent stream of"):
            self.reasons[re.sub(r"[0-9.]+", "N", reason.split(";")[0])[:80]] += 1


def _run_one(args: list[Any], q: Any) -> None:
    """The measurement's process: a process group of its own (the parent ends it, agents included,
    with one signal) that dies with the parent."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _die_with_parent(args[-1])
    unretrieved: Counter[str] = Counter()

    async def run() -> dict[str, Any]:
        loop = asyncio.get_running_loop()

        def counted(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            exc = context.get("exception")
            if context.get("message") == "Task exception was never retrieved" and exc is not None:
                unretrieved[f"{type(exc).__name__}: {exc}"] += 1  # one line for them all, at the end
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(counted)
        return await measure(*args[:-2])

    try:
        q.put(event_loop.run(run(), args[-2]))
    except BaseException as e:
        q.put({"mode": args[0], "nodes": args[1], "error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        gc.collect()
        for what, count in unretrieved.items():
            print(f"{args[0]} {args[1]}: {count} x 'Task exception was never retrieved' ({what})", file=sys.stderr)


def _end_group(p: Any) -> None:
    """End the measurement process ``p`` and every process it started (its process group): SIGCONT
    first, so a frozen agent process dies at once."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)
    if p.is_alive():
        p.kill()
    p.join(10)


# -- the run ---------------------------------------------------------------------------------------

async def _trace(cp: Any, ids: list[str], ejected: list[Any], outliers: list[Any],
                 procs: Callable[[], list[Any]], every_s: float) -> None:
    """``DIAL_IN_TRACE=S``: one line to stderr every S s from the control plane's start: streams
    connected, nodes HEALTHY, ejections and outlier ejections so far, the agents' dials, our verdicts
    on drops and silences, and how late this task's own wake-up ran (the loop's queue)."""
    t0 = time.monotonic()
    while True:
        due = time.monotonic() + every_s
        await asyncio.sleep(every_s)
        late_ms = (time.monotonic() - due) * 1000.0
        healthy = sum(1 for i in ids if cp.core.health[i].state.name == "HEALTHY")
        connected = sum(1 for i in ids if cp.sessions[i].connected)
        print(json.dumps({"t": round(time.monotonic() - t0, 1), "connected": connected, "healthy": healthy,
                          "ejected": len(ejected), "outliers": len(outliers),
                          "ejected_by": dict(Counter("misses" if "consecutive misses" in r else
                                                     "transport" if "transport lost" in r else "other"
                                                     for _, _, r in ejected)),
                          "dials": sum(p.streams.value for p in procs() if isinstance(p, _Agents)),
                          "drops": dict(cp.counters.transport_drops),
                          "silent": dict(getattr(cp.counters, "silent_streams", {})),
                          "rtt_not_taken": _rtt_not_taken(cp, ids), "late_ms": round(late_ms, 1),
                          "load": os.getloadavg()[0]}), file=sys.stderr, flush=True)


def _rtt_not_taken(cp: Any, ids: list[str]) -> dict[str, int]:
    """RTT pings that gave no sample since the start, per why (``Counters.rtt_not_taken``); an older
    tree (a side-by-side base) counted only the round trips it dropped, per session."""
    c = getattr(cp.counters, "rtt_not_taken", None)
    if c is not None:
        return dict(c)
    return {"ours": sum(getattr(cp.sessions[i], "rtt_samples_dropped", 0) for i in ids)}


def _spread(xs: list[float]) -> dict[str, float] | None:
    """Median, p90 and max of sorted ``xs`` (ms, rounded), None when empty."""
    if not xs:
        return None
    return {"p50": round(statistics.median(xs), 1), "p90": round(_q(xs, 0.90), 1), "max": round(xs[-1], 1)}


def _fmt(v: Any, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def _summary(rows: list[dict[str, Any]]) -> str:
    head = (f"{'mode':<14} {'nodes':>6} {'cl':>3} {'conn':>6} {'cp cores':>8} {'py cores':>8} {'nodes/core':>10} "
            f"{'nodes/py':>9} {'agents':>6} {'gc max':>6} {'false ej':>8} {'detected':>9} {'p50 ms':>7} {'p90 ms':>7} "
            f"{'p99 ms':>7} {'max ms':>7} {'pings':>7} {'off max':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['mode']:<14} {r['nodes']:>6} error: {r['error']}")
            continue
        mode = f"{r['mode']}/w{r['workers']}" if r.get("workers") else r["mode"]  # w: probe workers
        mode += "/uv" if r.get("loop") == "uvloop" else ""
        mode += "/gc0" if r.get("gc") == "default" else ""  # CPython's GC thresholds
        lines.append(
            f"{mode:<14} {r['nodes']:>6} {r['clients']:>3} {r['connected']:>6} {r['cpu_cores']:>8.3f} "
            f"{r['py_thread_cores']:>8.3f} {r['nodes_per_core']:>10.0f} {r['nodes_per_py_core']:>9.0f} "
            f"{r['agents_cpu_cores']:>6.2f} {r.get('gc_max_ms', 0):>6.0f} {r['false_ejections']:>8} "
            f"{r['detected']:>4}/{r['frozen']:<4} "
            f"{_fmt(r.get('detect_p50_ms')):>7} {_fmt(r.get('detect_p90_ms')):>7} "
            f"{_fmt(r.get('detect_p99_ms')):>7} {_fmt(r.get('detect_max_ms')):>7} {r.get('pings', ''):>7} "
            f"{_fmt((r.get('published_ms') or {}).get('max')):>7}")
    lines.append("cp cores: the control plane's process CPU (user+sys) / wall s, its probe workers' included; "
                 "py cores: its main event-loop thread's;\nagents: the fake agents' processes (same machine); "
                 "gc max: the longest collection, ms (/gc0: CPython's thresholds); detection: SIGSTOP -> UNHEALTHY;\n"
                 "pings: keepalive/ping timeout, ms; off max: SIGSTOP -> the first publish with the node out, the "
                 "slowest (ms)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--seconds", type=float, default=20.0, help="measurement window (the freeze is in its middle)")
    ap.add_argument("--freeze", type=int, default=20, help="nodes whose agent process is SIGSTOPped")
    ap.add_argument("--freeze-groups", type=int, default=1,
                    help="the frozen nodes in this many processes, SIGSTOPped one after another spread over the "
                    "window (independent freezes; default 1: all at its middle)")
    ap.add_argument("--clients", type=int, default=2, choices=range(1, 5), metavar="{1..4}",
                    help="agent processes for the nodes not frozen (the frozen ones get one more)")
    ap.add_argument("--modes", nargs="+", default=["dial-in", "heartbeat"], choices=MODES)
    ap.add_argument("--gpus", type=int, default=8, help="GPU readings per heartbeat")
    ap.add_argument("--settle", type=float, default=6.0, help="s after every stream is open, before the window")
    ap.add_argument("--refresh-ms", type=int, default=1000, help="telemetry refresh (transport, dial-in)")
    ap.add_argument("--keepalive-ms", type=int, default=100, help="PING interval (dial-in, transport)")
    ap.add_argument("--ping-timeout-ms", type=int, default=100, help="PING answer deadline (dial-in, transport)")
    ap.add_argument("--pings", nargs="+", default=None, metavar="KEEPALIVE/TIMEOUT",
                    help="several PING settings in ms (e.g. 90/80 100/40): one measurement each, in place of "
                    "--keepalive-ms and --ping-timeout-ms")
    ap.add_argument("--cp-cpu", type=int, default=None, help="pin the control plane to this CPU")
    ap.add_argument("--fleet-cpu", type=int, default=None, help="pin the agent processes to this CPU")
    ap.add_argument("--agents-nice", type=int, default=0,
                    help="dial-in: the fake agents' processes' priority (e.g. -10, as root): they run first "
                         "when runnable, as agents on hosts of their own would, not starved by the control plane")
    ap.add_argument("--agent-kind", choices=("grpcio", "h2"), default="grpcio",
                    help="dial-in: the simulated agents, a grpc.aio channel each, or HTTP/2 by hand (h2_agents.py; "
                    "~40 %% less CPU, so 2,000 fit beside the control plane)")
    ap.add_argument("--gc", nargs="+", default=["tuned"], choices=("tuned", "default"),
                    help="the control plane's garbage collector thresholds: xds-server serve's (tuned, "
                    "xds_server/process/gc_tuning.py) or CPython's; several: one measurement each")
    ap.add_argument("--loop", nargs="+", default=["asyncio"], choices=event_loop.LOOPS,
                    help="the control plane's event loop (xds-server serve --loop); several: one measurement each")
    ap.add_argument("--workers", type=int, nargs="+", default=[0],
                    help="dial-in: probe workers that accept the agents (probe.workers, on probe.dial_in.listen; "
                    "0: the main process does); several values: one dial-in measurement each")
    ap.add_argument("--rtt-ping-s", type=float, default=60.0,
                    help="health.rtt.ping_interval, s (default 60: as good as off; the config's default is 1)")
    ap.add_argument("--rtt-ping-budget", type=float, default=400.0,
                    help="health.rtt.ping_budget: RTT pings a second, all nodes together (0: none; the config's "
                    "default is 400)")
    ap.add_argument("--cp-stop-s", type=float, default=0.0,
                    help="dial-in: SIGSTOP the control plane this long, a fifth into the window (every PING "
                    "deadline passes while it is stopped): how it comes back")
    ap.add_argument("--cp-stop-dialling-s", type=float, default=0.0,
                    help="dial-in: SIGSTOP the control plane this long once, as half the fleet's streams are "
                         "open (a stall of ours while the fleet dials in; see ejections_in_settle, connect_drops)")
    ap.add_argument("--cut-dialling", action="store_true",
                    help="dial-in, --agent-kind h2: as half the fleet's streams are open, the first agents' "
                         "process resets all its connections at once (a burst judged ours); they dial again "
                         "behind the first dials still waiting")
    ap.add_argument("--burn-s", type=float, default=0.0,
                    help="dial-in: --burners processes burn the machine's CPU (the control plane's, with "
                    "--cp-cpu) this long, a fifth into the window: how it comes back")
    ap.add_argument("--burners", type=int, default=2, help="dial-in: the busy processes of --burn-s")
    ap.add_argument("--agent-stable-s", type=float, default=STABLE_S,
                    help="the fake agents start their re-dial back-off over after a stream held this long "
                    "(node_probe.targets.failures_after; 0: any stream that came up, the rule before it)")
    ap.add_argument("--connect-spread-s", type=float, default=_CONNECT_SPREAD_S,
                    help="each fake agent dials first at a random moment in this many seconds (1: the "
                    "whole fleet at once, as after a control-plane restart; longer: a fleet coming up "
                    "gradually, so the agents' own processes, on the same cores, do not starve)")
    ap.add_argument("--measure-refresh", nargs="+", default=["1s"],
                    help="xds.publish.measure_refresh; several: one measurement each")
    a = ap.parse_args()
    if a.cut_dialling and a.agent_kind != "h2":
        ap.error("--cut-dialling needs --agent-kind h2 (its agents reset their connections on SIGUSR1)")
    if a.cut_dialling and a.cp_stop_dialling_s > 0:
        ap.error("--cut-dialling and --cp-stop-dialling-s: one disturbance while dialling in, not both")
    try:
        pings = [(a.keepalive_ms, a.ping_timeout_ms)] if a.pings is None else [
            (int(k), int(t)) for k, t in (p.split("/") for p in a.pings)]
    except ValueError:
        ap.error(f"--pings: each value is KEEPALIVE_MS/TIMEOUT_MS, not {' '.join(a.pings)}")

    def terminate(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    ctx = multiprocessing.get_context("spawn")
    rows: list[dict[str, Any]] = []
    try:
        for n in a.nodes:
            for mode, workers, loop, gc_mode, refresh, (keepalive_ms, ping_timeout_ms) in [
                    (m, w, lp, g, r, pg) for m in a.modes for w in (a.workers if m == "dial-in" else [0])
                    for lp in a.loop for g in a.gc for r in a.measure_refresh
                    for pg in (pings if m != "heartbeat" else pings[:1])]:  # heartbeat mode sends no PINGs
                q = ctx.Queue()
                p = ctx.Process(target=_run_one, args=([mode, n, a.seconds, a.freeze, a.clients, a.gpus, a.settle,
                                                        a.refresh_ms, keepalive_ms, ping_timeout_ms, a.cp_cpu,
                                                        a.fleet_cpu, workers, a.agent_kind, gc_mode,
                                                        a.freeze_groups, a.rtt_ping_s, refresh, a.cp_stop_s,
                                                        a.burn_s, a.agent_stable_s, a.burners, a.rtt_ping_budget,
                                                        a.connect_spread_s, a.agents_nice,
                                                        a.cp_stop_dialling_s, a.cut_dialling, loop,
                                                        os.getpid()], q))
                p.start()  # a fresh process per measurement: no state carried between modes
                try:
                    deadline = time.monotonic() + a.settle + a.seconds + _DETECT_GRACE_S + 300 + n / 10
                    res: dict[str, Any] | None = None
                    while res is None:
                        try:
                            res = q.get(timeout=1.0)
                        except queue.Empty:
                            if not p.is_alive():
                                res = {"mode": mode, "nodes": n, "error": f"exited with {p.exitcode}, no result"}
                            elif time.monotonic() > deadline:
                                res = {"mode": mode, "nodes": n, "error": "timed out"}
                    p.join(30)
                finally:
                    _end_group(p)
                res["loop"], res["gc"], res["measure_refresh"], res["rtt_ping_s"] = loop, gc_mode, refresh, a.rtt_ping_s
                res["rtt_ping_budget"] = a.rtt_ping_budget
                res["pings"] = f"{keepalive_ms}/{ping_timeout_ms}"
                rows.append(res)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
    except KeyboardInterrupt:
        print("interrupted: every process started was stopped", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if rows:
            print(_summary(rows), flush=True)


if __name__ == "__main__":
    main()
