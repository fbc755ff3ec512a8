"""The node_probe agent: a gRPC ``NodeProbe`` server that runs beside one inference engine.

One agent per inference node. Control planes dial it and open ``Watch`` streams (DESIGN.md §3):

* every stream gets an unprompted ``Heartbeat`` every ``heartbeat_interval_ms`` (fixed-rate on
  ``loop.time()``, no drift) carrying the latest *cached* telemetry: a heartbeat never waits on
  a scrape, a probe or NVML;
* each ``Ping{seq}`` is answered at once with ``Pong{seq, processing_us}``;
* ``ProbeNow`` asks for an immediate micro-probe (rate-limited, see :class:`AgentConfig`);
* every micro-probe result (``InferenceResult``) is pushed to *every* connected stream, so
  several control planes never multiply the probe load on the GPU.

Background work runs once per agent, not per stream: a ``/metrics`` scrape loop (every
heartbeat interval by default) that also runs stall detection, a GPU collection loop (NVML in a
worker thread) and the micro-probe loop on the agent's own jittered schedule.

The engine is reached through an adapter (:mod:`node_probe.engines`) chosen by ``engine_kind``
or detected. Cadence follows load: while the engine is idle (nothing running or waiting) it is
probed often (``probe_idle_interval_s``, default 0.5 s: an idle engine that freezes shows
nothing in ``/health`` or ``/metrics``); while it is busy and its progress counter can prove
progress, at the slow cadence (``probe_interval_s``, 3-5 s with the default jitter) and stall
detection covers the gap: running > 0 with a frozen counter for ``stall_window_ms`` sets
``Telemetry.stalled`` and starts an immediate (rate-limited) probe.

Engine lifecycle reported in telemetry (see :class:`EngineLifecycle`): COLD until the engine
first answers HTTP, WARMING until the first successful probe, READY after; FAILED on a fatal
engine error, on a refused connection after having been up, or on a lost GPU / fatal Xid.

Usage from code/tests::

    agent = ProbeAgent(AgentConfig(engine_url="http://127.0.0.1:8000", listen="127.0.0.1:0"))
    port = await agent.start()
    ...
    await agent.stop()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import aiohttp
import grpc

from node_probe.engines import (
    ADAPTERS,
    ENGINE_KINDS,
    EngineAdapter,
    EngineLoadReading,
    EngineRequestError,
    ProbeOutcome,
    detect_engine_kind,
    run_probe,
)
from node_probe.proto import probe_pb2, probe_pb2_grpc
from node_probe.stall import StallDetector
from node_probe.telemetry import FATAL_XIDS, GpuCollector, gpu_fatal_reason

__all__ = ["AgentConfig", "EngineLifecycle", "ProbeAgent", "run_agent"]

log = logging.getLogger(__name__)

_UINT32_MAX = 2**32 - 1
_STATE_NAMES = {v: k for k, v in probe_pb2.EngineState.items()}

#: ``InferenceResult.trigger`` values.
TRIGGER_SCHEDULED = "scheduled"
TRIGGER_PROBE_NOW = "probe_now"
TRIGGER_STALL = "stall"
TRIGGER_DEEP = "deep"


# --------------------------------------------------------------------------------------------
# Configuration


@dataclass
class AgentConfig:
    """Agent settings. Durations carry their unit in the name.

    Attributes:
        engine_url: engine root URL, e.g. ``http://127.0.0.1:8000``.
        listen: gRPC listen address ``HOST:PORT``; port 0 picks a free port (returned by
            :meth:`ProbeAgent.start`).
        node_id: reported in every heartbeat; default: this host's name.
        heartbeat_interval_ms: heartbeat period per stream.
        engine_kind: ``"auto"`` (detect from ``/metrics`` and the endpoints the engine serves)
            or one of ``vllm``, ``sglang``, ``tgi``, ``triton``, ``openai``.
        metrics_url: the engine's Prometheus page; ``None``: the adapter's default (the engine
            URL + ``/metrics``; Triton: port 8002 of the engine host).
        metrics_interval_ms: ``/metrics`` scrape period (also the stall-detection sampling
            period); ``None``: the heartbeat interval.
        metrics_timeout_ms: deadline for one scrape.
        stall_window_ms: how long the engine's progress counter may stay frozen while requests
            run before telemetry says ``stalled``.
        probe_interval_s: mean period between scheduled micro-probes while the engine is busy
            (requests running or waiting, and its progress counter makes stall detection
            possible). Default 4 s, i.e. 3-5 s with the default jitter.
        probe_idle_interval_s: mean period while the engine is idle, its load unknown or its
            progress unobservable; never longer than ``probe_interval_s``. ``None``: same as
            ``probe_interval_s``.
        probe_jitter_ratio: each probe interval is uniform in ``[i*(1-j), i*(1+j)]``; 0..<1.
        probe_timeout_ms: deadline for the first token of one probe (also for model discovery).
        model: model id to probe; ``None`` discovers it (``/v1/models``; Triton: repository
            index), re-discovered after a 404.
        deep_check_interval_s: period of the deep check, a fixed arithmetic prompt whose answer
            is checked (catches silently corrupt weights); ``None`` or 0: off.
        deep_check_prompt, deep_check_expect: its prompt and the text the answer must contain.
        deep_check_max_tokens: tokens the deep check may generate.
        deep_check_timeout_ms: deadline of a deep check (whole answer).
        gpu_interval_s: NVML collection period; 0 or less disables GPU telemetry.
        fatal_xids: Xid codes that mark the engine FAILED (default
            :data:`node_probe.telemetry.FATAL_XIDS`: 48, 63, 64, 74, 79, 94, 95).
        min_probe_now_interval_ms: minimum spacing of probes triggered by ``ProbeNow`` (or by
            stall detection). A request inside the window is not dropped: all such requests
            are coalesced into one probe at the window's end.
        stream_queue_max: outbound messages buffered per stream; beyond it messages for that
            stream are dropped (and counted) rather than growing memory for a stuck client.
        grpc_keepalive_time_ms: server-side HTTP/2 keepalive ping period (detects dead
            control planes on silent networks).

    Raises:
        ValueError: (on construction) a value is out of range.
    """

    engine_url: str
    listen: str = "127.0.0.1:50051"
    node_id: str = field(default_factory=socket.gethostname)
    heartbeat_interval_ms: int = 100
    engine_kind: str = "auto"
    metrics_url: str | None = None
    metrics_interval_ms: int | None = None
    metrics_timeout_ms: int = 1000
    stall_window_ms: int = 1000
    probe_interval_s: float = 4.0
    probe_idle_interval_s: float | None = 0.5
    probe_jitter_ratio: float = 0.25
    probe_timeout_ms: int = 800
    model: str | None = None
    deep_check_interval_s: float | None = None
    deep_check_prompt: str = "1+1="
    deep_check_expect: str = "2"
    deep_check_max_tokens: int = 4
    deep_check_timeout_ms: int = 3000
    gpu_interval_s: float = 1.0
    fatal_xids: frozenset[int] = FATAL_XIDS
    min_probe_now_interval_ms: int = 1000
    stream_queue_max: int = 1024
    grpc_keepalive_time_ms: int = 10_000

    def __post_init__(self) -> None:
        if not self.engine_url.startswith(("http://", "https://")):
            raise ValueError(f"engine_url must start with http:// or https://: {self.engine_url!r}")
        if self.metrics_url is not None and not self.metrics_url.startswith(("http://", "https://")):
            raise ValueError(f"metrics_url must start with http:// or https://: {self.metrics_url!r}")
        if self.engine_kind not in ENGINE_KINDS:
            raise ValueError(f"engine_kind must be one of {', '.join(ENGINE_KINDS)}: {self.engine_kind!r}")
        if ":" not in self.listen:
            raise ValueError(f"listen must be HOST:PORT: {self.listen!r}")
        if not 1 <= self.heartbeat_interval_ms <= _UINT32_MAX:
            raise ValueError("heartbeat_interval_ms must be >= 1")
        if (self.metrics_interval_ms is not None and self.metrics_interval_ms < 1) \
                or self.metrics_timeout_ms < 1:
            raise ValueError("metrics_interval_ms and metrics_timeout_ms must be >= 1")
        if self.stall_window_ms < 1:
            raise ValueError("stall_window_ms must be >= 1")
        if self.probe_interval_s <= 0:
            raise ValueError("probe_interval_s must be > 0")
        if self.probe_idle_interval_s is not None and self.probe_idle_interval_s <= 0:
            raise ValueError("probe_idle_interval_s must be > 0")
        if not 0 <= self.probe_jitter_ratio < 1:
            raise ValueError("probe_jitter_ratio must be in [0, 1)")
        if not 1 <= self.probe_timeout_ms <= _UINT32_MAX:
            raise ValueError("probe_timeout_ms must be >= 1")
        if self.deep_check_interval_s is not None and self.deep_check_interval_s < 0:
            raise ValueError("deep_check_interval_s must be >= 0")
        if self.deep_check_interval_s and (not self.deep_check_prompt or not self.deep_check_expect):
            raise ValueError("deep_check_prompt and deep_check_expect must not be empty")
        if self.deep_check_max_tokens < 1 or not 1 <= self.deep_check_timeout_ms <= _UINT32_MAX:
            raise ValueError("deep_check_max_tokens and deep_check_timeout_ms must be >= 1")
        if self.min_probe_now_interval_ms < 0:
            raise ValueError("min_probe_now_interval_ms must be >= 0")
        if self.stream_queue_max < 1:
            raise ValueError("stream_queue_max must be >= 1")
        if not self.node_id:
            raise ValueError("node_id must not be empty")
        self.fatal_xids = frozenset(self.fatal_xids)

    @property
    def effective_metrics_interval_ms(self) -> int:
        """The scrape period in use (``metrics_interval_ms`` or the heartbeat interval)."""
        return self.metrics_interval_ms or self.heartbeat_interval_ms

    @property
    def effective_idle_interval_s(self) -> float:
        """The idle probe period in use (never longer than the busy one)."""
        if self.probe_idle_interval_s is None:
            return self.probe_interval_s
        return min(self.probe_idle_interval_s, self.probe_interval_s)


# --------------------------------------------------------------------------------------------
# Engine lifecycle


class EngineLifecycle:
    """Engine lifecycle state machine (``probe_pb2.EngineState`` values).

    * COLD until the engine first answers HTTP (``/metrics`` or a probe, any status);
    * WARMING while it answers but no probe has succeeded yet (weights loading, compiling: the
      control plane counts no failures here), and again after a restart;
    * READY after a successful probe (from any state but a GPU-fatal FAILED);
    * FAILED on ENGINE_FATAL, on a refused/reset connection after the engine had been up
      (WARMING or READY), or while the GPU is lost / has a fatal Xid. From FAILED it goes back
      to WARMING when the engine answers again, except after a fatal error: an engine kept
      alive after its EngineCore died keeps serving ``/metrics`` (stale), so only a refused
      connection (process gone) or a successful probe clears a fatal FAILED. A GPU-fatal
      FAILED lasts while the GPU telemetry says so, then goes to WARMING.
    """

    def __init__(self, on_change: Callable[[int, int, str], None] | None = None) -> None:
        self.state: int = probe_pb2.ENGINE_STATE_COLD
        self.reason = "no engine answer yet"
        #: what caused the last transition: "answered", "refused", "fatal", "probe_ok",
        #: "restart" or "gpu".
        self.cause = ""
        self._fatal_latched = False
        self._gpu_fatal: str | None = None
        self._on_change = on_change

    def _set(self, new: int, reason: str, cause: str = "") -> None:
        if new != self.state:
            self.cause = cause
            old, self.state = self.state, new
            self.reason = reason
            if self._on_change is not None:
                self._on_change(old, new, reason)

    def _answered(self, reason: str) -> None:
        if self._gpu_fatal:
            return
        if self.state == probe_pb2.ENGINE_STATE_COLD or (
            self.state == probe_pb2.ENGINE_STATE_FAILED and not self._fatal_latched
        ):
            self._set(probe_pb2.ENGINE_STATE_WARMING, reason, "answered")

    def _refused(self, reason: str) -> None:
        self._fatal_latched = False
        if self.state in (probe_pb2.ENGINE_STATE_WARMING, probe_pb2.ENGINE_STATE_READY):
            self._set(probe_pb2.ENGINE_STATE_FAILED, reason, "refused")

    def _fatal(self, reason: str) -> None:
        self._fatal_latched = True
        self._set(probe_pb2.ENGINE_STATE_FAILED, reason, "fatal")

    def observe_metrics(self, error: EngineRequestError | None) -> None:
        """Feed the result of one ``/metrics`` scrape (``None`` = success)."""
        if error is None:
            self._answered("metrics answered")
        elif error.kind == probe_pb2.FAILURE_KIND_ENGINE_FATAL:
            self._fatal(f"metrics: {error.detail}")
        elif error.kind == probe_pb2.FAILURE_KIND_CONNECT:
            self._refused(f"metrics: {error.detail}")
        elif error.answered:
            self._answered(f"metrics answered HTTP {error.http_status}")

    def observe_probe(self, outcome: ProbeOutcome) -> None:
        """Feed the outcome of one micro-probe (or of its model discovery)."""
        if outcome.ok:
            self._fatal_latched = False
            if not self._gpu_fatal:
                self._set(probe_pb2.ENGINE_STATE_READY, "probe ok", "probe_ok")
        elif outcome.failure == probe_pb2.FAILURE_KIND_ENGINE_FATAL:
            self._fatal(f"probe: {outcome.detail}")
        elif outcome.failure == probe_pb2.FAILURE_KIND_CONNECT:
            self._refused(f"probe: {outcome.detail}")
        elif outcome.answered:
            self._answered(f"probe answered HTTP {outcome.http_status}")

    def observe_restart(self, reason: str) -> None:
        """The engine restarted without us seeing it down (its counters went back): a READY
        engine goes back through WARMING."""
        if self.state == probe_pb2.ENGINE_STATE_READY and not self._gpu_fatal:
            self._set(probe_pb2.ENGINE_STATE_WARMING, reason, "restart")

    def observe_gpu(self, fatal_reason: str | None) -> None:
        """Feed the GPU verdict of one NVML collection (``None``: nothing fatal)."""
        if fatal_reason:
            self._gpu_fatal = fatal_reason
            self._set(probe_pb2.ENGINE_STATE_FAILED, f"gpu: {fatal_reason}", "gpu")
        elif self._gpu_fatal:
            self._gpu_fatal = None
            if self.state == probe_pb2.ENGINE_STATE_FAILED and not self._fatal_latched:
                self._set(probe_pb2.ENGINE_STATE_WARMING, "gpu fault cleared", "gpu")


# --------------------------------------------------------------------------------------------
# Per-stream state


@dataclass(frozen=True)
class _HeartbeatTick:
    seq: int


@dataclass(frozen=True)
class _PendingPong:
    seq: int
    received_ns: int


_CLOSE = object()


@dataclass(eq=False)
class _Stream:
    id: int
    peer: str
    queue: asyncio.Queue[Any]
    control_plane_id: str = ""
    hb_seq: int = 0
    dropped: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def _clamp_u32(value: float) -> int:
    return int(min(max(value, 0), _UINT32_MAX))


def _load_message(
    reading: EngineLoadReading | None, error: str
) -> probe_pb2.EngineLoad:
    msg = probe_pb2.EngineLoad(metrics_ok=reading is not None, metrics_error=error)
    if reading is not None:
        for name in (
            "requests_waiting",
            "requests_running",
            "kv_cache_usage_ratio",
            "prefix_cache_hit_ratio",
            "generation_tokens_total",
        ):
            value = getattr(reading, name)
            if value is not None:
                setattr(msg, name, value)
        msg.kv_cache_metric = reading.kv_cache_metric
    return msg


def _load_class(reading: EngineLoadReading | None, stalled: bool) -> str:
    """"busy" when the engine runs or queues requests and stall detection can watch it;
    "idle" otherwise (idle, unknown load, or progress not observable)."""
    if reading is None or stalled or not reading.stall_capable:
        return "idle"
    if (reading.requests_running or 0) > 0 or (reading.requests_waiting or 0) > 0:
        return "busy"
    return "idle"


# --------------------------------------------------------------------------------------------
# The agent


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
        self._streams: set[_Stream] = set()
        self._stream_ids = itertools.count(1)
        self._probe_seq = 0
        self._last_failure: int | None = None
        self._adapter: EngineAdapter | None = (
            None if cfg.engine_kind == "auto" else ADAPTERS[cfg.engine_kind]
        )
        self._adapter_lock = asyncio.Lock()
        self._model: str | None = cfg.model
        self._model_discovered = False
        self._load_reading: EngineLoadReading | None = None
        self._load_msg = probe_pb2.EngineLoad(metrics_ok=False, metrics_error="no scrape yet")
        self._load_at: float | None = None
        self._load_class = "idle"
        self._stall = StallDetector(cfg.stall_window_ms / 1000.0)
        self._stalled = False
        self._stall_detail = ""
        if cfg.gpu_interval_s > 0:
            self._gpu_msg = probe_pb2.GpuTelemetry()
        else:
            self._gpu_msg = probe_pb2.GpuTelemetry(
                state=probe_pb2.NVML_STATE_ABSENT, error="GPU telemetry disabled"
            )
        self._probe_now_pending = False
        self._probe_now_trigger = TRIGGER_PROBE_NOW
        self._last_probe_now_at: float | None = None
        self._last_deep_at: float | None = None
        self._probe_wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._server: grpc.aio.Server | None = None
        self._gpu_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._port: int | None = None
        self._started = False
        self._stopped = False

    # -- public state --------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """Bound gRPC port once started, else ``None``."""
        return self._port

    @property
    def engine_state(self) -> int:
        """Current ``probe_pb2.EngineState`` value."""
        return self._lifecycle.state

    @property
    def engine_kind(self) -> str | None:
        """Adapter in use (``None`` while ``auto`` has not detected the engine yet)."""
        return None if self._adapter is None else self._adapter.kind

    @property
    def probe_count(self) -> int:
        """Number of micro-probes started so far (= seq of the latest InferenceResult)."""
        return self._probe_seq

    @property
    def subscriber_count(self) -> int:
        """Number of open ``Watch`` streams."""
        return len(self._streams)

    @property
    def stalled(self) -> bool:
        """Latest stall verdict (see :mod:`node_probe.stall`)."""
        return self._stalled

    def telemetry(self) -> probe_pb2.Telemetry:
        """The telemetry a heartbeat sent now would carry (cached values, never blocks)."""
        tel = probe_pb2.Telemetry(engine_state=self._lifecycle.state, stalled=self._stalled,
                                  stall_detail=self._stall_detail)
        tel.engine_load.CopyFrom(self._load_msg)
        if self._load_at is not None:
            tel.engine_load.age_ms = _clamp_u32((time.monotonic() - self._load_at) * 1000.0)
        tel.gpu.CopyFrom(self._gpu_msg)
        return tel

    def request_probe(self, reason: str = "", *, trigger: str = TRIGGER_PROBE_NOW) -> None:
        """Ask for an immediate micro-probe (what ``ProbeNow`` does).

        Rate-limited: probes triggered this way start at least ``min_probe_now_interval_ms``
        apart; requests inside the window are coalesced into one probe at its end.
        """
        log.debug("probe requested (%s): %s", trigger, reason or "(no reason)")
        if not self._probe_now_pending or trigger == TRIGGER_PROBE_NOW:
            self._probe_now_trigger = trigger
        self._probe_now_pending = True
        self._probe_wake.set()

    # -- start / stop --------------------------------------------------------------------------

    async def start(self) -> int:
        """Bind the gRPC server, start the background loops and return the bound port.

        Raises:
            OSError: the listen address cannot be bound.
            RuntimeError: the agent was already started.
        """
        if self._started:
            raise RuntimeError("agent already started")
        self._started = True
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        server = grpc.aio.server(
            options=[
                ("grpc.keepalive_time_ms", cfg.grpc_keepalive_time_ms),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.so_reuseport", 0),
            ]
        )
        probe_pb2_grpc.add_NodeProbeServicer_to_server(self, server)
        try:
            port = server.add_insecure_port(cfg.listen)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {cfg.listen}: {exc}") from exc
        if not port:
            raise OSError(f"cannot listen on {cfg.listen}")
        self._server = server
        self._port = port
        await server.start()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=32, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self._tasks.append(loop.create_task(self._metrics_loop(), name="np-agent-metrics"))
        self._tasks.append(loop.create_task(self._probe_loop(), name="np-agent-probe"))
        if cfg.gpu_interval_s > 0:
            if self._gpu_collector is None:
                self._gpu_collector = GpuCollector(fatal_xids=cfg.fatal_xids)
            self._gpu_executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="np-nvml"
            )
            self._tasks.append(loop.create_task(self._gpu_loop(), name="np-agent-gpu"))
        log.info(
            "agent %s serving NodeProbe on %s:%d, engine=%s (%s)",
            cfg.node_id,
            cfg.listen.rpartition(":")[0],
            port,
            cfg.engine_url,
            cfg.engine_kind,
        )
        return port

    async def stop(self, grace_s: float = 0.5) -> None:
        """Stop everything: background loops, open streams (ended cleanly, then cancelled after
        ``grace_s`` seconds), the gRPC server, the HTTP session and the NVML worker. Idempotent;
        never raises for cleanup failures."""
        if self._stopped:
            return
        self._stopped = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for st in list(self._streams):
            try:
                st.queue.put_nowait(_CLOSE)
            except asyncio.QueueFull:
                pass  # the server stop below cancels it
        if self._server is not None:
            try:
                await self._server.stop(grace_s)
            except Exception:  # noqa: BLE001
                log.exception("grpc server stop failed")
        for st in list(self._streams):
            await self._close_stream(st)
        if self._session is not None:
            await self._session.close()
        if self._gpu_executor is not None:
            close = getattr(self._gpu_collector, "close", None)
            if close is not None:
                self._gpu_executor.submit(close)  # runs after a stuck collect, never blocks us
            self._gpu_executor.shutdown(wait=False, cancel_futures=False)
        log.info("node-probe %s stopped", self.cfg.node_id)

    # -- state callbacks -----------------------------------------------------------------------

    def _on_state_change(self, old: int, new: int, reason: str) -> None:
        log.info(
            "engine state %s -> %s (%s)",
            _STATE_NAMES.get(old, old),
            _STATE_NAMES.get(new, new),
            reason,
        )
        if self._lifecycle.cause == "refused" and self.cfg.engine_kind == "auto":
            # Process gone: whatever comes back on this port is detected afresh.
            self._adapter = None
            self._stall.reset()

    # -- engine adapter ------------------------------------------------------------------------

    async def _get_adapter(self) -> EngineAdapter:
        """The adapter in use, detecting the engine first when ``engine_kind`` is auto.

        Raises:
            EngineRequestError: detection found no answering engine (CONNECT / TIMEOUT).
        """
        if self._adapter is not None:
            return self._adapter
        async with self._adapter_lock:
            if self._adapter is None:
                assert self._session is not None
                kind = await detect_engine_kind(
                    self._session, self.cfg.engine_url, self.cfg.metrics_timeout_ms / 1000.0,
                    self.cfg.metrics_url,
                )
                self._adapter = ADAPTERS[kind]
                log.info("engine detected as %s", kind)
            return self._adapter

    # -- background loops ----------------------------------------------------------------------

    @staticmethod
    async def _sleep_until(loop: asyncio.AbstractEventLoop, next_t: float, period: float) -> float:
        """Sleep to the next tick of a fixed-rate grid; skip ticks missed in a stall.
        Returns the tick slept to."""
        now = loop.time()
        if now - next_t > period:
            next_t += ((now - next_t) // period) * period
        await asyncio.sleep(max(0.0, next_t - now))
        return next_t

    async def _scrape(self) -> tuple[EngineLoadReading | None, str]:
        """One ``/metrics`` scrape through the adapter; feeds the lifecycle."""
        assert self._session is not None
        cfg = self.cfg
        timeout_s = cfg.metrics_timeout_ms / 1000.0
        try:
            adapter = await self._get_adapter()
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
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything
                log.exception("metrics scrape failed unexpectedly")
                reading, error = None, f"agent error: {type(exc).__name__}: {exc}"
            self._on_reading(reading, error, time.monotonic())
            next_t = await self._sleep_until(loop, next_t + period, period)

    def _on_reading(self, reading: EngineLoadReading | None, error: str, now: float) -> None:
        if error and self._load_reading is not None:
            log.info("metrics scrape failing: %s", error)
        elif not error and self._load_reading is None:
            log.info("metrics scrape ok")
        previous = self._load_reading
        if (reading is not None and previous is not None
                and reading.generation_tokens_total is not None
                and previous.generation_tokens_total is not None
                and reading.generation_tokens_total < previous.generation_tokens_total):
            self._lifecycle.observe_restart("generated-token counter went back: engine restarted")
        self._load_reading = reading
        self._load_msg = _load_message(reading, error)
        self._load_at = now
        if reading is not None:
            verdict = self._stall.observe(reading, now)
            if verdict.stalled and not self._stalled:
                log.warning("engine stalled: %s", verdict.detail)
                self.request_probe(verdict.detail, trigger=TRIGGER_STALL)
            elif self._stalled and not verdict.stalled:
                log.info("engine progressing again")
            self._stalled, self._stall_detail = verdict.stalled, verdict.detail
        elif self._stalled:
            # No reading, no verdict: the scrape error is the signal now.
            self._stalled, self._stall_detail = False, ""
        load_class = _load_class(reading, self._stalled)
        if load_class != self._load_class:
            self._load_class = load_class
            self._probe_wake.set()  # the probe schedule follows load: re-plan now

    async def _gpu_loop(self) -> None:
        loop = asyncio.get_running_loop()
        period = self.cfg.gpu_interval_s
        stuck_after = max(5.0, 5 * period)
        collector = self._gpu_collector
        next_t = loop.time()
        while True:
            started = loop.time()
            fut = loop.run_in_executor(self._gpu_executor, collector.collect)
            while True:
                done, _ = await asyncio.wait({fut}, timeout=stuck_after)
                if done:
                    break
                stuck = probe_pb2.GpuTelemetry()
                stuck.CopyFrom(self._gpu_msg)
                stuck.state = probe_pb2.NVML_STATE_ERROR
                stuck.error = f"NVML collect stuck for {loop.time() - started:.0f} s"
                self._gpu_msg = stuck
                log.warning("GPU telemetry: %s", stuck.error)
            try:
                self._gpu_msg = fut.result()
            except Exception as exc:  # noqa: BLE001
                log.exception("GPU collect failed unexpectedly")
                self._gpu_msg = probe_pb2.GpuTelemetry(
                    state=probe_pb2.NVML_STATE_ERROR, error=f"collector: {type(exc).__name__}: {exc}"
                )
            self._lifecycle.observe_gpu(gpu_fatal_reason(self._gpu_msg, self.cfg.fatal_xids))
            next_t = await self._sleep_until(loop, next_t + period, period)

    def _base_probe_interval(self) -> float:
        if _load_class(self._load_reading, self._stalled) == "busy":
            return self.cfg.probe_interval_s
        return self.cfg.effective_idle_interval_s

    def _next_probe_interval(self) -> float:
        """The next scheduled-probe interval under the current load, with jitter."""
        j = self.cfg.probe_jitter_ratio
        return self._base_probe_interval() * random.uniform(1 - j, 1 + j)

    def _deep_due(self, now: float) -> bool:
        interval = self.cfg.deep_check_interval_s
        if not interval:
            return False
        return self._last_deep_at is None or now - self._last_deep_at >= interval

    async def _probe_loop(self) -> None:
        loop = asyncio.get_running_loop()
        min_gap = self.cfg.min_probe_now_interval_ms / 1000.0
        j = self.cfg.probe_jitter_ratio
        last_end: float | None = None  # first probe right at start
        jitter = 1.0
        while True:
            now = loop.time()
            due = now if last_end is None else last_end + self._base_probe_interval() * jitter
            forced_ok_at = None
            if self._probe_now_pending:
                forced_ok_at = (
                    now if self._last_probe_now_at is None else max(now, self._last_probe_now_at + min_gap)
                )
                due = min(due, forced_ok_at)
            if now < due:
                self._probe_wake.clear()
                try:
                    await asyncio.wait_for(self._probe_wake.wait(), due - now)
                except TimeoutError:
                    pass
                continue
            trigger = TRIGGER_SCHEDULED
            if forced_ok_at is not None and now >= forced_ok_at:
                trigger = self._probe_now_trigger
                self._probe_now_pending = False
                self._last_probe_now_at = now
            elif self._deep_due(now):
                trigger = TRIGGER_DEEP
                self._last_deep_at = now
            await self._run_probe(trigger)
            last_end = loop.time()
            jitter = random.uniform(1 - j, 1 + j)

    async def _resolve_model(self, adapter: EngineAdapter, timeout_s: float) -> str | None:
        """The model to probe (raises :class:`EngineRequestError` when discovery fails)."""
        if self._model or not adapter.needs_model:
            return self._model
        assert self._session is not None
        try:
            model = await adapter.discover_model(self._session, self.cfg.engine_url, timeout_s)
        except EngineRequestError as err:
            raise EngineRequestError(err.kind, f"model discovery: {err.detail}", err.http_status) from err
        self._model = model
        self._model_discovered = True
        log.info("probing model %s (discovered)", model)
        return model

    async def _probe_once(self, trigger: str) -> ProbeOutcome:
        assert self._session is not None
        cfg = self.cfg
        deep = trigger == TRIGGER_DEEP
        timeout_s = (cfg.deep_check_timeout_ms if deep else cfg.probe_timeout_ms) / 1000.0
        try:
            adapter = await self._get_adapter()
            model = await self._resolve_model(adapter, cfg.probe_timeout_ms / 1000.0)
        except EngineRequestError as err:
            return ProbeOutcome(False, None, err.kind, err.http_status, err.detail)
        outcome = await run_probe(
            self._session, adapter, cfg.engine_url, model, timeout_s,
            deep_prompt=cfg.deep_check_prompt if deep else None,
            max_tokens=cfg.deep_check_max_tokens if deep else 1,
        )
        if outcome.http_status == 404 and self._model_discovered:
            self._model = None  # engine restarted with another model: rediscover
            self._model_discovered = False
        if deep and outcome.ok and cfg.deep_check_expect not in outcome.text:
            outcome = ProbeOutcome(
                False, outcome.ttft_ms, probe_pb2.FAILURE_KIND_BAD_OUTPUT, outcome.http_status,
                f"deep check: {cfg.deep_check_prompt!r} answered {outcome.text[:80]!r}, "
                f"expected {cfg.deep_check_expect!r}",
                outcome.headers_ms, outcome.text,
            )
        return outcome

    async def _run_probe(self, trigger: str) -> None:
        self._probe_seq += 1
        seq = self._probe_seq
        deep = trigger == TRIGGER_DEEP
        try:
            outcome = await self._probe_once(trigger)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - never let a probe kill the loop
            log.exception("probe %d failed unexpectedly", seq)
            outcome = ProbeOutcome(
                False, None, probe_pb2.FAILURE_KIND_BAD_OUTPUT, 0, f"agent error: {type(exc).__name__}: {exc}"
            )
        if not (deep and outcome.failure == probe_pb2.FAILURE_KIND_BAD_OUTPUT and outcome.ttft_ms):
            # A wrong deep-check answer came from a live engine: it says nothing about liveness.
            self._lifecycle.observe_probe(outcome)
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
        for st in list(self._streams):
            self._enqueue(st, msg)

    # -- streams -------------------------------------------------------------------------------

    def _enqueue(self, st: _Stream, item: Any) -> None:
        try:
            st.queue.put_nowait(item)
        except asyncio.QueueFull:
            st.dropped += 1
            if st.dropped == 1 or st.dropped % 100 == 0:
                log.warning(
                    "stream %d (%s): outbound queue full, %d message(s) dropped",
                    st.id,
                    st.peer,
                    st.dropped,
                )

    async def _heartbeat_loop(self, st: _Stream) -> None:
        loop = asyncio.get_running_loop()
        period = self.cfg.heartbeat_interval_ms / 1000.0
        next_t = loop.time()  # first heartbeat as soon as the stream opens
        while True:
            st.hb_seq += 1
            self._enqueue(st, _HeartbeatTick(st.hb_seq))
            next_t = await self._sleep_until(loop, next_t + period, period)

    async def _read_loop(self, st: _Stream, requests: AsyncIterator[probe_pb2.ControlMessage]) -> None:
        try:
            async for msg in requests:
                kind = msg.WhichOneof("msg")
                if kind == "ping":
                    self._enqueue(st, _PendingPong(msg.ping.seq, time.perf_counter_ns()))
                elif kind == "probe_now":
                    self.request_probe(msg.probe_now.reason or f"stream {st.id}")
                elif kind == "hello":
                    st.control_plane_id = msg.hello.control_plane_id
                    log.info(
                        "stream %d: hello from control plane %r (%s)",
                        st.id,
                        st.control_plane_id,
                        st.peer,
                    )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the client went away; the writer ends too
            log.debug("stream %d: read side ended: %r", st.id, exc)
        # Half-closed by the client: keep sending heartbeats until it cancels.

    def _materialize(self, st: _Stream, item: Any) -> probe_pb2.AgentMessage:
        if isinstance(item, _HeartbeatTick):
            return probe_pb2.AgentMessage(
                heartbeat=probe_pb2.Heartbeat(
                    seq=item.seq,
                    interval_ms=self.cfg.heartbeat_interval_ms,
                    node_id=self.cfg.node_id,
                    telemetry=self.telemetry(),
                )
            )
        if isinstance(item, _PendingPong):
            processing_us = (time.perf_counter_ns() - item.received_ns) // 1000
            return probe_pb2.AgentMessage(pong=probe_pb2.Pong(seq=item.seq, processing_us=processing_us))
        return item

    async def _close_stream(self, st: _Stream) -> None:
        if st not in self._streams:
            return
        self._streams.discard(st)
        for task in st.tasks:
            task.cancel()
        await asyncio.gather(*st.tasks, return_exceptions=True)
        st.tasks.clear()
        log.info(
            "stream %d closed (%s, control plane %r, %d dropped)",
            st.id,
            st.peer,
            st.control_plane_id,
            st.dropped,
        )

    async def Watch(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[probe_pb2.ControlMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[probe_pb2.AgentMessage]:
        """Serve one control plane's stream (see module docstring). Ends when the client
        cancels or the agent stops; per-stream tasks and the queue are cleaned up either way."""
        loop = asyncio.get_running_loop()
        st = _Stream(
            id=next(self._stream_ids),
            peer=context.peer() or "?",
            queue=asyncio.Queue(maxsize=self.cfg.stream_queue_max),
        )
        if self._stopped:
            return
        self._streams.add(st)
        log.info("stream %d opened by %s", st.id, st.peer)
        st.tasks.append(loop.create_task(self._heartbeat_loop(st), name=f"np-stream-{st.id}-heartbeat"))
        st.tasks.append(
            loop.create_task(self._read_loop(st, request_iterator), name=f"np-stream-{st.id}-reader")
        )
        try:
            while True:
                item = await st.queue.get()
                if item is _CLOSE:
                    return
                yield self._materialize(st, item)
        finally:
            await self._close_stream(st)


# --------------------------------------------------------------------------------------------
# Running


async def run_agent(
    cfg: AgentConfig,
    *,
    stop_event: asyncio.Event | None = None,
    on_started: Callable[[ProbeAgent, int], None] | None = None,
) -> None:
    """Run an agent until ``stop_event`` is set (or forever when it is ``None``, until the task
    is cancelled), then stop it cleanly.

    Args:
        on_started: called once with the agent and its bound port, after it serves.

    Raises:
        OSError: the listen address cannot be bound.
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
