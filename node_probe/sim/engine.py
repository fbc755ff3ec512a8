"""State of one simulated engine: configuration, fault mode, parked requests and metrics."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from node_probe.sim.capacity import Admission
from node_probe.sim.faults import PREFILL_KV_RISE, PREFILL_PROMPT_TOKENS, Faults

__all__ = ["FINISHED_REASONS", "SimConfig", "SimEngine"]

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
# How often parked requests are checked for a vanished client, in seconds.
_REAP_INTERVAL_S = 0.1


@dataclass
class SimConfig:
    """Configuration of one simulated engine.

    Attributes:
        host: address to listen on.
        port: TCP port to listen on (0 lets the OS pick one; ``main`` then reports the real one).
        replica_id: name sent in ``x-served-by`` and ``/sim/stats``; default ``sim-<port>``.
        model: the single model id served (``/v1/models``, ``model`` in responses, metric label).
        token_interval_ms: pace between streamed tokens, and delay of the first token, in ms.
        default_max_tokens: tokens generated when a request gives no ``max_tokens``.
        kv_cache_usage: value of ``vllm:kv_cache_usage_perc`` (ratio 0..1).
        max_model_len: context length in tokens; larger ``max_tokens`` is a 400 like vLLM's.
        eos_rate: chance (ratio 0..1) that the model's greedy next token is EOS in a given
            context; 0 (default) means generations always run to ``max_tokens``.
        byte_token_rate: chance (ratio 0..1) that the greedy next token is a lone byte (a
            byte-level BPE's: text held back, U+FFFD; see :mod:`node_probe.sim.model`); 0
            (default): words only, as before it existed.
        max_num_seqs: most requests decoding at once (vLLM's ``--max-num-seqs``); the rest wait
            in arrival order, probes too, and ``vllm:num_requests_waiting`` counts them; their
            first token comes after the wait. 0 (default): unlimited, nothing waits.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    replica_id: str = ""
    model: str = "sim-model"
    token_interval_ms: float = 20.0
    default_max_tokens: int = 16
    kv_cache_usage: float = 0.1
    max_model_len: int = 4096
    eos_rate: float = 0.0
    byte_token_rate: float = 0.0
    max_num_seqs: int = 0

    def __post_init__(self) -> None:
        if not self.replica_id:
            self.replica_id = f"sim-{self.port}"
        if not (math.isfinite(self.eos_rate) and 0.0 <= self.eos_rate <= 1.0):
            raise ValueError("eos_rate must be a ratio in 0..1")
        if not (math.isfinite(self.byte_token_rate) and 0.0 <= self.byte_token_rate <= 1.0):
            raise ValueError("byte_token_rate must be a ratio in 0..1")
        Admission(self.max_num_seqs)  # raises ValueError naming max_num_seqs


class SimEngine:
    """State of one simulated engine: fault mode, counters and Prometheus metrics.

    One instance lives in each app built by :func:`node_probe.sim.build_app`
    (``app[SIM_ENGINE_KEY]``), so in-process users can also inject faults without HTTP via
    :meth:`set_fault`.
    """

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.faults = Faults()
        self.closing = False
        self.requests_total = 0
        self.requests_by_kind = {"probe": 0, "user": 0}
        self.responses_by_status: dict[str, int] = {}
        self.in_flight = 0
        # Parked requests (engine hung, or hang_after_headers): future -> request.
        self._stuck: dict[asyncio.Future[bool], web.BaseRequest] = {}
        # The batch (``max_num_seqs``): requests waiting for a slot, ticket -> (future, request).
        self.admission = Admission(cfg.max_num_seqs)
        self._waiters: dict[int, tuple[asyncio.Future[bool], web.BaseRequest]] = {}
        self._tickets = 0
        self._reaper: asyncio.Task[None] | None = None
        self._prefill_t0 = 0.0  # monotonic s when the current ``prefill`` started
        self._prefill_end: asyncio.TimerHandle | None = None

        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("engine", "model_name")
        lv = ("0", cfg.model)
        self._g_running = Gauge("vllm:num_requests_running",
                                "Number of requests in model execution batches.",
                                labels, registry=self.registry).labels(*lv)
        self._g_waiting = Gauge("vllm:num_requests_waiting",
                                "Number of requests waiting to be processed.",
                                labels, registry=self.registry).labels(*lv)
        self._g_kv = Gauge("vllm:kv_cache_usage_perc",
                           "KV-cache usage. 1 means 100 percent usage.",
                           labels, registry=self.registry).labels(*lv)
        self.c_prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                labels, registry=self.registry).labels(*lv)
        self.c_gen = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                             labels, registry=self.registry).labels(*lv)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ("engine", "finished_reason", "model_name"), registry=self.registry)
        self.c_success = {r: success.labels("0", r, cfg.model) for r in FINISHED_REASONS}
        self._g_kv.set(cfg.kv_cache_usage)

    # ----------------------------------------------------------------------------- faults
    @property
    def mode(self) -> str:
        """Current fault mode (see :mod:`node_probe.sim.faults`)."""
        return self.faults.mode

    def fault_state(self) -> dict[str, Any]:
        """Current fault as JSON (:meth:`Faults.state` plus ``replica_id``)."""
        return dict(self.faults.state(), replica_id=self.cfg.replica_id)

    def set_fault(self, mode: str, *, ttft_ms: float | None = None, waiting: int | None = None,
                  after_tokens: int | None = None, times: int | None = None,
                  prefill_ms: float | None = None, rate: float | None = None,
                  min_prompt_tokens: int | None = None, knee: int | None = None) -> dict[str, Any]:
        """Switch the fault mode and return the new state; parked requests resume unless the
        new mode is ``hang`` or ``prefill`` (whose end is a timer on the running loop).

        Raises:
            ValueError: unknown mode or out-of-range value (nothing changes); ``prefill``
                without a running event loop.
        """
        loop = None
        if mode == "prefill":
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise ValueError("prefill needs a running event loop") from None
        self.faults.set(mode, ttft_ms=ttft_ms, waiting=waiting, after_tokens=after_tokens,
                        times=times, prefill_ms=prefill_ms, rate=rate, min_prompt_tokens=min_prompt_tokens,
                        knee=knee)
        if self._prefill_end is not None:
            self._prefill_end.cancel()
            self._prefill_end = None
        self._g_kv.set(self.cfg.kv_cache_usage)
        if loop is not None:
            self._prefill_t0 = time.monotonic()
            self._prefill_end = loop.call_later(self.faults.prefill_ms / 1000.0, self._finish_prefill)
        if mode not in ("hang", "prefill"):
            self._release_stuck(True)
        return self.fault_state()

    def _finish_prefill(self) -> None:
        """The long prompt is prefilled: its tokens are counted, queued requests run."""
        self._prefill_end = None
        self.c_prompt.inc(PREFILL_PROMPT_TOKENS)
        self.set_fault("none")

    def close(self) -> None:
        """Stop serving tokens: parked and streaming requests end (called on app shutdown)."""
        self.closing = True
        if self._prefill_end is not None:
            self._prefill_end.cancel()
            self._prefill_end = None
        self._release_stuck(False)
        for ticket, (fut, _) in list(self._waiters.items()):
            self._refuse(ticket, fut)

    def _release_stuck(self, proceed: bool) -> None:
        for fut in list(self._stuck):
            if not fut.done():
                fut.set_result(proceed)

    async def wait_runnable(self, request: web.BaseRequest) -> bool:
        """Wait while the engine is hung.

        Returns True when the request may produce its next token, False when it must stop (its
        client went away while parked, or the app is shutting down).
        """
        if self.closing:
            return False
        if self.faults.mode not in ("hang", "prefill"):
            return True
        return await self.park(request)

    @property
    def decoding(self) -> int:
        """Requests in the batch now: holding a slot (``max_num_seqs`` set), else all in flight."""
        return self.admission.running if self.cfg.max_num_seqs else self.in_flight

    async def admit(self, request: web.BaseRequest) -> bool:
        """Wait for a slot in the batch (FIFO; at once when ``max_num_seqs`` is 0 or a slot is
        free). True: the slot is held, and :meth:`leave` must be called once; False: no slot (the
        client went away while waiting, or the app is shutting down). A cancelled wait gives its
        slot back."""
        if self.closing:
            return False
        self._tickets += 1
        ticket = self._tickets
        if self.admission.arrive(ticket):
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = (fut, request)
        self._ensure_reaper()
        try:
            return await fut
        except asyncio.CancelledError:
            if not self.admission.withdraw(ticket) and fut.done() and not fut.cancelled() and fut.result():
                self.leave()  # admitted just before the cancel: pass the slot on
            raise
        finally:
            self._waiters.pop(ticket, None)

    def leave(self) -> None:
        """A request that held a slot ended: the next waiting ones run."""
        for ticket in self.admission.finish():
            entry = self._waiters.get(ticket)
            if entry is not None and not entry[0].done():
                entry[0].set_result(True)

    def _refuse(self, ticket: int, fut: asyncio.Future[bool]) -> None:
        if self.admission.withdraw(ticket) and not fut.done():
            fut.set_result(False)

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap())

    async def park(self, request: web.BaseRequest) -> bool:
        """Park a request until the fault mode is changed; same result as :meth:`wait_runnable`."""
        if self.closing:
            return False
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._stuck[fut] = request
        self._ensure_reaper()
        try:
            return await fut
        finally:
            self._stuck.pop(fut, None)

    async def _reap(self) -> None:
        # aiohttp does not cancel handlers on disconnect by default, so parked requests whose
        # client is gone are found here (one task for all of them) and released; so are
        # requests waiting for a slot in the batch.
        while self._stuck or self._waiters:
            await asyncio.sleep(_REAP_INTERVAL_S)
            for fut, req in list(self._stuck.items()):
                if _gone(req) and not fut.done():
                    fut.set_result(False)
            for ticket, (wfut, req) in list(self._waiters.items()):
                if _gone(req):
                    self._refuse(ticket, wfut)

    # ----------------------------------------------------------------------------- metrics
    def render_metrics(self) -> bytes:
        """Prometheus text exposition of the engine's metrics."""
        if self.faults.mode == "prefill":
            # the long prompt runs; requests that arrived meanwhile wait behind it
            frac = min(1.0, (time.monotonic() - self._prefill_t0) / (self.faults.prefill_ms / 1000.0))
            self._g_kv.set(self.cfg.kv_cache_usage + PREFILL_KV_RISE * frac)
            queued = self.admission.waiting
            self._g_running.set(1 + max(0, self.in_flight - len(self._stuck) - queued))
            self._g_waiting.set(len(self._stuck) + queued)
            return generate_latest(self.registry)
        self._g_running.set(self.decoding)
        self._g_waiting.set(self.admission.waiting + (self.faults.waiting if self.faults.mode == "queue" else 0))
        return generate_latest(self.registry)

    def stats(self) -> dict[str, Any]:
        """Traffic counters as JSON.

        ``requests_total`` and ``requests_by_kind`` count inference requests at arrival (bad ones
        too), ``in_flight`` those being served now (waiting for a slot included), ``running``
        and ``waiting`` the batch (``max_num_seqs``), ``responses_by_status`` inference
        responses by HTTP status once their headers went out.
        """
        return {
            "replica_id": self.cfg.replica_id,
            "requests_total": self.requests_total,
            "requests_by_kind": dict(self.requests_by_kind),
            "in_flight": self.in_flight,
            "running": self.decoding,
            "waiting": self.admission.waiting,
            "max_num_seqs": self.cfg.max_num_seqs,
            "responses_by_status": dict(self.responses_by_status),
            "fault": self.faults.mode,
        }

    def count_status(self, status: int) -> None:
        key = str(status)
        self.responses_by_status[key] = self.responses_by_status.get(key, 0) + 1


def _gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
