"""The node_probe agent: a gRPC ``NodeProbe`` server that runs beside one inference engine.

One agent per inference node. Control planes dial it and open ``Watch`` streams (the protocol: ``protos/node_probe/``),
or, with ``control_planes`` (dial-in), it dials each of them and holds a ``ProbeHub.Connect`` stream that opens with
a ``Register`` and then carries the same messages (:mod:`node_probe.dialer`); both at once while migrating. On each:

* every stream gets an unprompted ``Heartbeat`` every ``heartbeat_interval_ms`` (fixed-rate on ``loop.time()``,
  no drift) carrying the latest *cached* telemetry: a heartbeat never waits on a scrape, a probe or NVML;
* each ``Ping{seq}`` is answered at once with ``Pong{seq, processing_us}``;
* ``ProbeNow`` asks for an immediate micro-probe (rate-limited, see :class:`AgentConfig`);
* every micro-probe result (``InferenceResult``) is pushed to *every* connected stream, so several control
  planes never multiply the probe load on the GPU.

Background work runs once per agent, not per stream: a ``/metrics`` scrape loop (every heartbeat interval by
default) that also runs stall detection, a GPU collection loop (NVML in a worker thread) and the micro-probe
loop on the agent's own jittered schedule.

The engine is reached through an adapter (:mod:`node_probe.engines`) chosen by ``engine_kind`` or detected.
Cadence follows load: while the engine is idle (nothing running or waiting) it is probed often
(``probe_idle_interval_s``, default 0.5 s: an idle engine that freezes shows nothing in ``/health`` or
``/metrics``); while it is busy and its progress counter can prove progress, at the slow cadence
(``probe_interval_s``, 3-5 s with the default jitter) and stall detection covers the gap: running > 0 with a
frozen counter for ``stall_window_ms`` sets ``Telemetry.stalled`` and starts an immediate (rate-limited) probe.

Engine lifecycle reported in telemetry (see :class:`EngineLifecycle`): COLD until the engine first answers HTTP,
WARMING until the first successful probe, READY after; FAILED on a fatal engine error, on a refused connection
after having been up, or on a lost GPU / fatal Xid.

Modules by job: :mod:`node_probe.config` (settings), :mod:`node_probe.lifecycle` (engine state),
:mod:`node_probe.schedule` (the pure probe schedule), :mod:`node_probe.prober` (one probe through the adapter),
:mod:`node_probe.streams` (the streams), :mod:`node_probe.endpoints` (the gRPC server, the dialer); this module
wires them and runs the loops.

Usage from code/tests::

    agent = ProbeAgent(AgentConfig(engine_url="http://127.0.0.1:8000", listen="127.0.0.1:0"))
    port = await agent.start()
    ...
    await agent.stop()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import grpc

from node_probe.config import UINT32_MAX, AgentConfig
from node_probe.dialer import ControlPlaneDialer
from node_probe.endpoints import open_dialer, open_listener
from node_probe.engines import EngineLoadReading, EngineRequestError, ProbeOutcome
from node_probe.gpu_poll import GpuPoller
from node_probe.lifecycle import STATE_NAMES, EngineLifecycle
from node_probe.metrics import AgentMetrics
from node_probe.prober import Prober
from node_probe.proto import probe_pb2, probe_pb2_grpc
from node_probe.replay import Replayer
from node_probe.schedule import ProbeScheduler, Trigger, load_is_busy
from node_probe.shutdown import bounded
from node_probe.stall import StallDetector
from node_probe.streams import StreamHub
from node_probe.telemetry import GpuCollector, gpu_fatal_reason
from node_probe.ticks import sleep_until_tick
from xds_server.process.refusals import Refusals
from xds_server.process.stream_refusal import refuse
from xds_server.process.tls import ServerCertFiles, check_client

# AgentConfig and EngineLifecycle live in their own modules; this module is their public face.
__all__ = ["AgentConfig", "EngineLifecycle", "ProbeAgent", "run_agent"]

log = logging.getLogger(__name__)


def _clamp_u32(value: float) -> int:
    return int(min(max(value, 0), UINT32_MAX))


def _load_message(reading: EngineLoadReading | None, error: str) -> probe_pb2.EngineLoad:
    """The ``EngineLoad`` telemetry of one scrape (``metrics_ok`` false with ``error`` when the
    scrape failed); unknown values (``None``) are left unset."""
    msg = probe_pb2.EngineLoad(metrics_ok=reading is not None, metrics_error=error)
    if reading is not None:
        for name in (
            "requests_waiting",
            "requests_running",
            "kv_cache_usage_ratio",
            "prefix_cache_hit_ratio",
            "generation_tokens_total", "requests_finished_total",
        ):
            value = getattr(reading, name)
            if value is not None:
                setattr(msg, name, value)
        msg.kv_cache_metric = reading.kv_cache_metric
    return msg


class ProbeAgent(probe_pb2_grpc.NodeProbeServicer):
    """gRPC ``NodeProbe`` servicer plus the agent's background loops.

    Args:
        cfg: agent settings.
        gpu_collector: object with ``collect() -> probe_pb2.GpuTelemetry`` (blocking, run in a
            worker thread) and optionally ``close()``; default :class:`GpuCollector`.

    Lifecycle: :meth:`start` binds and serves, :meth:`stop` tears everything down. Engine
    trouble never raises out of the agent: it shows up in telemetry and probe results.
    """

    def __init__(self, cfg: AgentConfig, *, gpu_collector: Any | None = None) -> None:
        self.cfg = cfg
        self._gpu_collector = gpu_collector
        self._lifecycle = EngineLifecycle(self._on_state_change)
        self.metrics = AgentMetrics(self)
        self.metrics_port: int | None = None  # bound port of --metrics-listen once started
        self.tls_files: ServerCertFiles | None = None  # the gRPC port's certificate files (TLS)
        self.refusals = Refusals(log, prefix="node_probe", ports=("agent",), labels={"node": cfg.node_id})
        self._prober = Prober(cfg)
        self._schedule = ProbeScheduler(cfg.schedule_settings())
        self.replayer = Replayer(cfg.engine_url, cfg.replay, cfg.node_id, lambda: self._session,
                                 self._prober, lambda: self._load_reading)
        self._hub = StreamHub(node_id=cfg.node_id, heartbeat_interval_ms=cfg.heartbeat_interval_ms,
                              queue_max=cfg.stream_queue_max, telemetry=self.telemetry,
                              on_probe_now=self.request_probe, transport_liveness=cfg.transport_liveness,
                              replayer=self.replayer if cfg.replay.max_prompts else None)
        self._probe_seq = 0
        self._last_failure: probe_pb2.FailureKind | None = None
        self._load_reading: EngineLoadReading | None = None
        self._tokens_seen: float | None = None  # the last generated-token counter read (kept across failed scrapes)
        self._load_msg = probe_pb2.EngineLoad(metrics_ok=False, metrics_error="no scrape yet")
        self._load_at: float | None = None
        self._stall = StallDetector(cfg.stall_window_ms / 1000.0)
        self._stalled = False
        self._stall_detail = ""
        self._progress_at: float | None = None  # monotonic s of the last progress evidence
        self._progress_detail = ""
        self._gpu_seq = time.time_ns()  # GpuTelemetry.poll_seq: new per message, not repeated across restarts
        self._gpu_msg = probe_pb2.GpuTelemetry(poll_seq=self._gpu_seq)
        if cfg.gpu_interval_s <= 0:
            self._gpu_msg.state, self._gpu_msg.error = probe_pb2.NVML_STATE_ABSENT, "GPU telemetry disabled"
        self._probe_wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._server: grpc.aio.Server | None = None
        self.dialer: ControlPlaneDialer | None = None  # dial-in (control_planes), once started
        self._gpu_poller: GpuPoller | None = None
        self._port: int | None = None
        self._started = False
        self._stopped = False

    # -- public state --------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """Bound gRPC port once started, else ``None`` (always ``None`` without ``listen``)."""
        return self._port

    @property
    def engine_state(self) -> probe_pb2.EngineState:
        """Current ``probe_pb2.EngineState`` value."""
        return self._lifecycle.state

    @property
    def engine_kind(self) -> str | None:
        """Adapter in use (``None`` while ``auto`` has not detected the engine yet)."""
        return self._prober.adapter_kind

    @property
    def probe_count(self) -> int:
        """Number of micro-probes started so far (= seq of the latest InferenceResult)."""
        return self._probe_seq

    @property
    def subscriber_count(self) -> int:
        """Number of open streams: ``Watch`` streams served and dial-in streams begun."""
        return len(self._hub)

    @property
    def stalled(self) -> bool:
        """Latest stall verdict (see :mod:`node_probe.stall`)."""
        return self._stalled

    def telemetry(self) -> probe_pb2.Telemetry:
        """The telemetry a heartbeat sent now would carry (cached values, never blocks)."""
        tel = probe_pb2.Telemetry(engine_state=self._lifecycle.state, stalled=self._stalled,
                                  stall_detail=self._stall_detail)
        if self._progress_at is not None:
            tel.progress_age_ms = _clamp_u32((time.monotonic() - self._progress_at) * 1000.0)
            tel.progress_detail = self._progress_detail
        tel.engine_load.CopyFrom(self._load_msg)
        if self._load_at is not None:
            tel.engine_load.age_ms = _clamp_u32((time.monotonic() - self._load_at) * 1000.0)
        tel.gpu.CopyFrom(self._gpu_msg)
        return tel

    def request_probe(self, reason: str = "", *, trigger: Trigger = Trigger.PROBE_NOW) -> None:
        """Ask for an immediate micro-probe (what ``ProbeNow`` does).

        Rate-limited: probes triggered this way start at least ``min_probe_now_interval_ms``
        apart; requests inside the window are coalesced into one probe at its end.
        """
        log.debug("probe requested (%s): %s", trigger, reason or "(no reason)")
        self._schedule.request(trigger)
        self._probe_wake.set()

    # -- start / stop --------------------------------------------------------------------------

    async def start(self) -> int:
        """Bind the gRPC server (``listen``), start dialling the control planes (``control_planes``)
        and the background loops; return the bound gRPC port (0 without ``listen``).

        Raises:
            OSError: the listen address cannot be bound, or the TLS files (either side's) do not load.
            RuntimeError: the agent was already started.
        """
        if self._started:
            raise RuntimeError("agent already started")
        self._started = True
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        if cfg.metrics_listen is not None:
            self.metrics_port = await self.metrics.serve(cfg.metrics_listen)
        if cfg.listen is not None:
            self._server, self._port, self.tls_files = await open_listener(cfg, self)
        if cfg.control_planes:
            self.dialer = open_dialer(cfg, self._hub)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=32, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self._tasks.append(loop.create_task(self._metrics_loop(), name="np-agent-metrics"))
        self._tasks.append(loop.create_task(self._probe_loop(), name="np-agent-probe"))
        if cfg.gpu_interval_s > 0:
            if self._gpu_collector is None:
                self._gpu_collector = GpuCollector(fatal_xids=cfg.fatal_xids)
            self._gpu_poller = GpuPoller(self._gpu_collector, cfg.gpu_interval_s, self._on_gpu)
            self._tasks.append(loop.create_task(self._gpu_poller.run(), name="np-agent-gpu"))
        log.info("agent %s: %s%s, engine=%s (%s)", cfg.node_id,
                 f"serving NodeProbe on {cfg.listen.rpartition(':')[0]}:{self._port}" if cfg.listen else "no listener",
                 f", dialling {', '.join(cfg.control_planes)}" if cfg.control_planes else "",
                 cfg.engine_url, cfg.engine_kind)
        return self._port or 0

    async def stop(self, grace_s: float = 0.5) -> None:
        """Stop everything: background loops, open streams (ended cleanly, then cancelled after
        ``grace_s`` seconds), the gRPC server, the HTTP session and the NVML worker. Idempotent;
        never raises for cleanup failures, and never waits on one step longer than
        :func:`~node_probe.shutdown.bounded` allows."""
        if self._stopped:
            return
        self._stopped = True
        for task in self._tasks:
            task.cancel()
        await bounded(asyncio.gather(*self._tasks, return_exceptions=True), "background tasks")
        self._tasks.clear()
        if self.dialer is not None:
            # half-closed: the control planes end them
            await bounded(self.dialer.stop(grace_s), "dialled streams", grace_s)
        self._hub.end_all()
        if self._server is not None:
            await bounded(self._server.stop(grace_s), "grpc server", grace_s)
        await bounded(self._hub.close(), "served streams")
        if self._session is not None:
            await bounded(self._session.close(), "engine HTTP session")
        await bounded(self.metrics.close(), "metrics endpoint")
        if self._gpu_poller is not None:
            self._gpu_poller.close()
        log.info("node-probe %s stopped", self.cfg.node_id)

    # -- state callbacks -----------------------------------------------------------------------

    def _on_state_change(self, old: int, new: int, reason: str) -> None:
        log.info("engine state %s -> %s (%s)", STATE_NAMES.get(old, old), STATE_NAMES.get(new, new), reason)
        if self._lifecycle.cause == "refused" and self.cfg.engine_kind == "auto":
            # Process gone: whatever comes back on this port is detected afresh.
            self._prober.forget_adapter()
            self._stall.reset()

    # -- background loops ----------------------------------------------------------------------

    async def _scrape(self) -> tuple[EngineLoadReading | None, str]:
        """One ``/metrics`` scrape through the adapter; feeds the lifecycle."""
        assert self._session is not None
        cfg = self.cfg
        timeout_s = cfg.metrics_timeout_ms / 1000.0
        try:
            adapter = await self._prober.adapter(self._session)
            reading = await adapter.read_metrics(self._session, cfg.engine_url, timeout_s, cfg.metrics_url)
            self._lifecycle.observe_metrics(None)
            return reading, ""
        except EngineRequestError as err:
            self._lifecycle.observe_metrics(err)
            return None, err.detail

    async def _metrics_loop(self) -> None:
        loop = asyncio.get_running_loop()
        period = self.cfg.effective_metrics_interval_ms / 1000.0
        next_t = loop.time()
        while True:
            try:
                reading, error = await self._scrape()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop must survive anything
                log.exception("metrics scrape failed unexpectedly")
                reading, error = None, f"agent error: {type(exc).__name__}: {exc}"
            self._on_reading(reading, error, time.monotonic())
            next_t = await sleep_until_tick(loop, next_t + period, period)

    def _on_reading(self, reading: EngineLoadReading | None, error: str, now: float) -> None:
        """Take one scrape (``reading`` ``None`` with ``error`` when it failed) taken at ``now``
        (monotonic s): a generated-token counter that went back means a restart; stall
        detection runs (a new stall requests a probe); the load class re-plans the schedule."""
        if error and self._load_reading is not None:
            log.info("metrics scrape failing: %s", error)
        elif not error and self._load_reading is None:
            log.info("metrics scrape ok")
        self.metrics.scrape(error)
        tokens = None if reading is None else reading.generation_tokens_total
        if tokens is not None:
            # against the last counter read, across failed scrapes: an engine replaced between two
            # scrapes that found it down still shows a counter that went back
            if self._tokens_seen is not None and tokens < self._tokens_seen:
                self._lifecycle.observe_restart("generated-token counter went back: engine restarted")
            self._tokens_seen = tokens
        self._load_reading = reading
        self._load_msg = _load_message(reading, error)
        self._load_at = now
        if reading is not None:
            verdict = self._stall.observe(reading, now)
            if verdict.stalled and not self._stalled:
                log.warning("engine stalled: %s", verdict.detail)
                self.request_probe(verdict.detail, trigger=Trigger.STALL)
            elif self._stalled and not verdict.stalled:
                log.info("engine progressing again")
            self._stalled, self._stall_detail = verdict.stalled, verdict.detail
            if verdict.progress_age_s is None:
                self._progress_at, self._progress_detail = None, ""
            else:
                self._progress_at, self._progress_detail = now - verdict.progress_age_s, verdict.progress_detail
        else:
            # No reading, no verdict: the scrape error is the signal now (and no evidence either).
            self._stalled, self._stall_detail = False, ""
            self._progress_at, self._progress_detail = None, ""
        if self._schedule.set_busy(load_is_busy(reading, self._stalled)):
            self._probe_wake.set()  # the probe schedule follows load: re-plan now

    def _on_gpu(self, tel: probe_pb2.GpuTelemetry) -> None:
        self._gpu_seq += 1
        tel.poll_seq = self._gpu_seq
        self._gpu_msg = tel
        self._lifecycle.observe_gpu(gpu_fatal_reason(tel, self.cfg.fatal_xids))

    async def _probe_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            decision = self._schedule.decide(loop.time())
            if decision.trigger is None:
                self._probe_wake.clear()
                try:
                    await asyncio.wait_for(self._probe_wake.wait(), decision.wait_s)
                except TimeoutError:
                    pass
                continue
            answered = await self._run_probe(decision.trigger)
            self._schedule.probe_done(loop.time(), answered)

    async def _run_probe(self, trigger: Trigger) -> bool:
        """Run one probe and broadcast its result; False when it timed out or its token came
        ``probe_recheck_ms`` or later (re-check at the idle cadence)."""
        assert self._session is not None
        self._probe_seq += 1
        seq = self._probe_seq
        deep = trigger == Trigger.DEEP
        try:
            outcome = await self._prober.probe(self._session, deep)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never let a probe kill the loop
            log.exception("probe %d failed unexpectedly", seq)
            outcome = ProbeOutcome(
                False, None, probe_pb2.FAILURE_KIND_BAD_OUTPUT, 0, f"agent error: {type(exc).__name__}: {exc}"
            )
        if not (deep and outcome.failure == probe_pb2.FAILURE_KIND_BAD_OUTPUT and outcome.ttft_ms):
            # A wrong deep-check answer came from a live engine: it says nothing about liveness.
            self._lifecycle.observe_probe(outcome)
        self.metrics.probe(outcome.ok, outcome.failure, outcome.ttft_ms)
        result = probe_pb2.InferenceResult(
            seq=seq,
            ok=outcome.ok,
            ttft_ms=outcome.ttft_ms or 0.0,
            failure=outcome.failure,
            http_status=outcome.http_status,
            detail=outcome.detail,
            timeout_ms=self.cfg.deep_check_timeout_ms if deep else self.cfg.probe_timeout_ms,
            headers_ms=outcome.headers_ms or 0.0,
            trigger=trigger,
        )
        # INFO when the kind of result changes (ok -> TIMEOUT, CONNECT -> ok, ...), else DEBUG,
        # so a long outage does not flood the log.
        level = logging.INFO if outcome.failure != self._last_failure or deep else logging.DEBUG
        self._last_failure = outcome.failure
        if outcome.ok:
            log.log(level, "probe %d (%s) ok ttft=%.1f ms", seq, trigger, outcome.ttft_ms or 0.0)
        else:
            log.log(
                level,
                "probe %d (%s) failed: %s %s",
                seq,
                trigger,
                probe_pb2.FailureKind.Name(outcome.failure),
                outcome.detail,
            )
        msg = probe_pb2.AgentMessage(inference_result=result)
        self._hub.broadcast(msg)
        # A probe left without an answer, or answered slowly, is re-checked soon; a 429 is the
        # engine's own answer (saturated: keep the busy cadence, fc07).
        if outcome.ok:
            return (outcome.ttft_ms or 0.0) < self.cfg.probe_recheck_ms
        return outcome.failure != probe_pb2.FAILURE_KIND_TIMEOUT

    # -- streams -------------------------------------------------------------------------------

    async def Watch(  # gRPC method name
        self, request_iterator: AsyncIterator[probe_pb2.ControlMessage], context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[probe_pb2.AgentMessage]:
        """Serve one control plane's stream (see module docstring and :class:`StreamHub`).
        Ends when the client cancels or the agent stops."""
        if self._stopped:
            return
        if refused := check_client(self.cfg.tls_allow_clients, context, "--tls-allow-client", self.refusals,
                                   "agent", "allow_client"):  # typed identities; counted, logged per identity
            await refuse(context, request_iterator, grpc.StatusCode.PERMISSION_DENIED, refused)
        async for msg in self._hub.serve(request_iterator, context.peer() or "?", context.invocation_metadata()):
            yield msg


async def run_agent(
    cfg: AgentConfig,
    *,
    stop_event: asyncio.Event | None = None,
    on_started: Callable[[ProbeAgent, int], None] | None = None,
) -> None:
    """Run an agent until ``stop_event`` is set (or forever when it is ``None``, until the task
    is cancelled), then stop it cleanly.

    Args:
        on_started: called once with the agent and its bound gRPC port (0 without ``listen``), after
            it serves.

    Raises:
        OSError: the listen address cannot be bound, or the TLS files do not load.
    """
    agent = ProbeAgent(cfg)
    try:
        port = await agent.start()
        if on_started is not None:
            on_started(agent, port)
        if stop_event is None:
            await asyncio.Future()  # until cancelled
        else:
            await stop_event.wait()
    finally:
        await agent.stop()
