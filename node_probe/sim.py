"""Simulated OpenAI-compatible LLM engine with fault injection.

Used by ``xds-server demo`` and by integration tests that put a real Envoy in front of several
simulated engines. The wire format follows what a real vLLM 0.32 answers (see
``shared/fixtures/vllm-0.32.0-cpu``):

- ``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming (SSE, ``data: {json}``
  per token then ``data: [DONE]``) and non-streaming; a chat stream opens with a role-only chunk
  ``{"role": "assistant", "content": ""}`` that carries no token.
- ``GET /health`` (200, empty body), ``GET /v1/models``, ``GET /metrics`` (Prometheus text with
  vLLM's metric names and ``engine``/``model_name`` labels).
- Bad requests are 400 JSON errors (404 for an unknown model) sent before any streaming starts.

Fault injection (``POST /sim/fault``), modelled on how a real engine fails:

- ``hang``: the engine is frozen. New inference requests are accepted and never answered (a
  stream gets its 200 SSE headers at once and then nothing); in-flight streams stop producing
  tokens; ``/health`` and ``/metrics`` stay 200 with a frozen generation-token counter. Setting the
  mode back to ``none`` resumes every stuck request.
- ``slow``: the first token of every new request comes after ``ttft_ms`` milliseconds.
- ``error``: inference answers HTTP 500 with a CUDA error body before any streaming starts.
- ``queue``: ``/metrics`` reports ``waiting`` requests waiting; inference still works.
- ``prefill``: one long prompt is being prefilled in chunks for ``prefill_ms`` (default 5,500 ms,
  measured on a real vLLM 0.32: a 3,000-token prompt under ``--max-num-batched-tokens 256``).
  Like vLLM v1, which counts prompt tokens only when a prefill completes, the prompt and
  generation counters stay frozen while ``vllm:kv_cache_usage_perc`` rises linearly by 0.078
  (0.008 -> 0.086 measured) and ``/metrics`` shows 1 running; requests arriving meanwhile queue
  behind it (``waiting``) and get their first token when it ends. Then the prompt counter
  advances by the prompt's tokens, KV usage returns to its idle value and the mode to ``none``.
  Deterministic: every value is a function of the time since the fault was set.

Every response carries ``x-served-by: <replica_id>``; a request carrying a non-empty
``x-sentinel-probe`` header is counted as a probe in ``GET /sim/stats``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

__all__ = ["FAULT_MODES", "SIM_ENGINE_KEY", "SimConfig", "SimEngine", "build_app", "main"]

#: Fault modes accepted by ``POST /sim/fault``.
FAULT_MODES = ("none", "hang", "slow", "error", "queue", "prefill")

#: Header that marks a request as a health probe (any non-empty value).
PROBE_HEADER = "x-sentinel-probe"
#: Header added to every response, naming the replica that served it.
SERVED_BY_HEADER = "x-served-by"

#: Default first-token delay for ``slow`` when the fault request gives no ``ttft_ms`` (ms).
DEFAULT_SLOW_TTFT_MS = 1000.0
#: Default waiting count for ``queue`` when the fault request gives no ``waiting``.
DEFAULT_QUEUE_WAITING = 120
#: Default length of a ``prefill`` (ms), its prompt (tokens) and KV-usage rise (ratio): measured
#: on vLLM 0.32 (CPU build, hidden 1024, 8 layers, --max-num-batched-tokens 256), issue 11.
DEFAULT_PREFILL_MS = 5500.0
PREFILL_PROMPT_TOKENS = 3000
PREFILL_KV_RISE = 0.078

#: Body of the 500 answered under the ``error`` fault (what a vLLM with a broken GPU says).
CUDA_ERROR_MESSAGE = "CUDA error: an illegal memory access was encountered"

_SYSTEM_FINGERPRINT = "vllm-0.32.0-sim"
_FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
_INFERENCE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# How often stuck (hung) requests are checked for a vanished client, in seconds.
_REAP_INTERVAL_S = 0.1
# Deterministic "vocabulary" the simulated model cycles through.
_VOCAB = (
    " The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
    " Tokens", " flow", " like", " water", " through", " a", " healthy", " engine", ",",
    " steady", " and", " on", " time",
)
_VOCAB_JSON = tuple(json.dumps(tok) for tok in _VOCAB)


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
    """

    host: str = "127.0.0.1"
    port: int = 8000
    replica_id: str = ""
    model: str = "sim-model"
    token_interval_ms: float = 20.0
    default_max_tokens: int = 16
    kv_cache_usage: float = 0.1
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if not self.replica_id:
            self.replica_id = f"sim-{self.port}"


class _BadRequest(Exception):
    """A request rejected before the engine sees it (answered as a vLLM-style JSON error)."""

    def __init__(self, message: str, param: str | None, *, type_: str = "BadRequestError",
                 status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.type = type_
        self.status = status


def _error_body(message: str, type_: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(exc: _BadRequest) -> web.Response:
    return web.json_response(_error_body(exc.message, exc.type, exc.param, exc.status),
                             status=exc.status)


def _pydantic_style(kind: str, loc: str, msg: str, input_repr: str) -> _BadRequest:
    """A 400 worded like vLLM's FastAPI/pydantic validation errors (fixtures 08a, 08b, 08e)."""
    text = (f"1 validation error:\n  {{'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}', "
            f"'input': '{input_repr}'}}")
    return _BadRequest(text, loc, type_="Bad Request")


class SimEngine:
    """State of one simulated engine: fault mode, counters and Prometheus metrics.

    One instance lives in each app built by :func:`build_app` (``app[SIM_ENGINE_KEY]``), so
    in-process users can also inject faults without HTTP via :meth:`set_fault`.
    """

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.mode = "none"
        self.ttft_ms = 0.0  # first-token delay under ``slow``, ms
        self.waiting = 0  # reported waiting requests under ``queue``
        self.prefill_ms = 0.0  # length of the current ``prefill``, ms
        self._prefill_t0 = 0.0  # monotonic s when it started
        self._prefill_end: asyncio.TimerHandle | None = None
        self.closing = False
        self.requests_total = 0
        self.requests_by_kind = {"probe": 0, "user": 0}
        self.responses_by_status: dict[str, int] = {}
        self.in_flight = 0
        # Requests parked while the engine is hung: future -> request (to spot vanished clients).
        self._stuck: dict[asyncio.Future[bool], web.BaseRequest] = {}
        self._reaper: asyncio.Task[None] | None = None

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
        self._c_prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                 labels, registry=self.registry).labels(*lv)
        self._c_gen = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                              labels, registry=self.registry).labels(*lv)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ("engine", "finished_reason", "model_name"), registry=self.registry)
        self._c_success = {r: success.labels("0", r, cfg.model) for r in _FINISHED_REASONS}
        self._g_kv.set(cfg.kv_cache_usage)

    # ----------------------------------------------------------------------------- faults
    def fault_state(self) -> dict[str, Any]:
        """Current fault as JSON: ``mode``, ``ttft_ms`` (ms, 0 unless slow), ``waiting``, and
        ``prefill_ms`` while a ``prefill`` runs."""
        state: dict[str, Any] = {"mode": self.mode, "ttft_ms": self.ttft_ms, "waiting": self.waiting,
                                 "replica_id": self.cfg.replica_id}
        if self.mode == "prefill":
            state["prefill_ms"] = self.prefill_ms
        return state

    def set_fault(self, mode: str, *, ttft_ms: float | None = None,
                  waiting: int | None = None, prefill_ms: float | None = None) -> dict[str, Any]:
        """Switch the fault mode and return the new state.

        Args:
            mode: one of :data:`FAULT_MODES`.
            ttft_ms: first-token delay for ``slow`` in ms (default 1000).
            waiting: waiting-request count reported under ``queue`` (default 120).
            prefill_ms: length of a ``prefill`` in ms (default 5500); it needs a running event
                loop (its end is a timer).

        Raises:
            ValueError: unknown mode or out-of-range value; ``prefill`` without a running loop.
        """
        if mode not in FAULT_MODES:
            raise ValueError(f"mode must be one of {', '.join(FAULT_MODES)}")
        if ttft_ms is not None and not (math.isfinite(ttft_ms) and ttft_ms >= 0):
            raise ValueError("ttft_ms must be a finite number >= 0")
        if waiting is not None and waiting < 0:
            raise ValueError("waiting must be an integer >= 0")
        if prefill_ms is not None and not (math.isfinite(prefill_ms) and prefill_ms > 0):
            raise ValueError("prefill_ms must be a finite number > 0")
        if self._prefill_end is not None:
            self._prefill_end.cancel()
            self._prefill_end = None
        self.prefill_ms = 0.0
        if mode == "prefill":
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise ValueError("prefill needs a running event loop") from None
            self.prefill_ms = float(DEFAULT_PREFILL_MS if prefill_ms is None else prefill_ms)
            self._prefill_t0 = time.monotonic()
            self._prefill_end = loop.call_later(self.prefill_ms / 1000.0, self._finish_prefill)
        self._g_kv.set(self.cfg.kv_cache_usage)
        self.mode = mode
        self.ttft_ms = float(DEFAULT_SLOW_TTFT_MS if ttft_ms is None else ttft_ms) \
            if mode == "slow" else 0.0
        self.waiting = int(DEFAULT_QUEUE_WAITING if waiting is None else waiting) \
            if mode == "queue" else 0
        if mode not in ("hang", "prefill"):
            self._release_stuck(True)
        return self.fault_state()

    def _finish_prefill(self) -> None:
        """The long prompt is prefilled: its tokens are counted, queued requests run."""
        self._prefill_end = None
        self._c_prompt.inc(PREFILL_PROMPT_TOKENS)
        self.set_fault("none")

    def close(self) -> None:
        """Stop serving tokens: parked and streaming requests end (called on app shutdown)."""
        self.closing = True
        if self._prefill_end is not None:
            self._prefill_end.cancel()
            self._prefill_end = None
        self._release_stuck(False)

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
        if self.mode not in ("hang", "prefill"):
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._stuck[fut] = request
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap())
        try:
            return await fut
        finally:
            self._stuck.pop(fut, None)

    async def _reap(self) -> None:
        # aiohttp does not cancel handlers on disconnect by default, so parked requests whose
        # client is gone are found here (one task for all of them) and released.
        while self._stuck:
            await asyncio.sleep(_REAP_INTERVAL_S)
            for fut, req in list(self._stuck.items()):
                transport = req.transport
                if (transport is None or transport.is_closing()) and not fut.done():
                    fut.set_result(False)

    # ----------------------------------------------------------------------------- metrics
    def render_metrics(self) -> bytes:
        """Prometheus text exposition of the engine's metrics."""
        if self.mode == "prefill":
            # the long prompt runs; requests that arrived meanwhile wait behind it
            frac = min(1.0, (time.monotonic() - self._prefill_t0) / (self.prefill_ms / 1000.0))
            self._g_kv.set(self.cfg.kv_cache_usage + PREFILL_KV_RISE * frac)
            self._g_running.set(1 + max(0, self.in_flight - len(self._stuck)))
            self._g_waiting.set(len(self._stuck))
            return generate_latest(self.registry)
        self._g_running.set(self.in_flight)
        self._g_waiting.set(self.waiting if self.mode == "queue" else 0)
        return generate_latest(self.registry)

    def stats(self) -> dict[str, Any]:
        """Traffic counters as JSON.

        ``requests_total`` and ``requests_by_kind`` count inference requests at arrival (bad ones
        too), ``in_flight`` those being served now, ``responses_by_status`` inference responses
        by HTTP status once their headers went out.
        """
        return {
            "replica_id": self.cfg.replica_id,
            "requests_total": self.requests_total,
            "requests_by_kind": dict(self.requests_by_kind),
            "in_flight": self.in_flight,
            "responses_by_status": dict(self.responses_by_status),
            "fault": self.mode,
        }

    def count_status(self, status: int) -> None:
        key = str(status)
        self.responses_by_status[key] = self.responses_by_status.get(key, 0) + 1


SIM_ENGINE_KEY = web.AppKey("sim_engine", SimEngine)


# --------------------------------------------------------------------------------- requests
@dataclass
class _Job:
    """A validated inference request."""

    chat: bool
    stream: bool
    max_tokens: int
    prompt_tokens: int
    include_usage: bool


def _parse_job(raw: bytes, chat: bool, cfg: SimConfig) -> _Job:
    if not raw.strip():
        raise _pydantic_style("missing", "body", "Field required", "None")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = getattr(exc, "pos", 0)
        text = (f"1 validation error:\n  {{'type': 'json_invalid', 'loc': 'body.{pos}', "
                f"'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
                f"'ctx': {{'error': '{getattr(exc, 'msg', 'invalid')}'}}}}")
        raise _BadRequest(text, f"body.{pos}", type_="Bad Request") from None
    if not isinstance(body, dict):
        raise _pydantic_style("model_attributes_type", "body",
                              "Input should be a valid dictionary or object", type(body).__name__)

    model = body.get("model")
    if model is not None and model != cfg.model:
        raise _BadRequest(f"The model `{model}` does not exist.", "model",
                          type_="NotFoundError", status=404)

    if chat:
        messages = body.get("messages")
        if messages is None:
            raise _pydantic_style("missing", "body.messages", "Field required", "<body>")
        if not isinstance(messages, list) or not messages or \
                not all(isinstance(m, dict) and "role" in m for m in messages):
            raise _BadRequest("messages must be a non-empty list of objects with a role.",
                              "messages")
        words = 0
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                words += len(content.split())
            elif isinstance(content, list):
                words += sum(len(str(p.get("text", "")).split()) for p in content
                             if isinstance(p, dict))
        prompt_tokens = 8 + 4 * len(messages) + words  # crude chat-template overhead
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            prompt_tokens = max(1, len(prompt.split()))
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompt_tokens = len(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) and p for p in prompt):
            prompt_tokens = max(1, sum(len(p.split()) for p in prompt))
        else:
            raise _BadRequest("Either prompt or prompt_embeds must be provided and non-empty. "
                              "(parameter=prompt)", "prompt")

    max_tokens = body.get("max_tokens")
    if chat and max_tokens is None:
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = cfg.default_max_tokens
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise _pydantic_style("int_parsing", "body.max_tokens",
                              "Input should be a valid integer", str(max_tokens))
    if max_tokens < 1:
        raise _BadRequest(f"max_tokens must be at least 1, got {max_tokens}. "
                          f"(parameter=max_tokens, value={max_tokens})", "max_tokens")
    if max_tokens > cfg.max_model_len:
        raise _BadRequest(f"max_tokens={max_tokens} cannot be greater than max_model_len="
                          f"{cfg.max_model_len}. Please request fewer output tokens. "
                          f"(parameter=max_tokens, value={max_tokens})", "max_tokens")

    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise _pydantic_style("float_parsing", "body.temperature",
                                  "Input should be a valid number", str(temperature))
        if temperature < 0:
            raise _BadRequest(f"temperature must be non-negative, got {float(temperature)}. "
                              f"(parameter=temperature, value={float(temperature)})",
                              "temperature")

    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _BadRequest("Parameter 'cache_salt' must be a non-empty string if provided. "
                          "(parameter=cache_salt)", "cache_salt")

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _pydantic_style("bool_parsing", "body.stream", "Input should be a valid boolean",
                              str(stream))
    opts = body.get("stream_options")
    include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
    return _Job(chat=chat, stream=stream, max_tokens=max_tokens, prompt_tokens=prompt_tokens,
                include_usage=include_usage)


def _usage(job: _Job, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": job.prompt_tokens,
            "total_tokens": job.prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


async def _inference(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[SIM_ENGINE_KEY]
    cfg = engine.cfg
    engine.requests_total += 1
    engine.requests_by_kind["probe" if request.headers.get(PROBE_HEADER) else "user"] += 1
    try:
        job = _parse_job(await request.read(), chat, cfg)
    except _BadRequest as exc:
        return _error_response(exc)
    if engine.mode == "error":
        return web.json_response(_error_body(CUDA_ERROR_MESSAGE, "InternalServerError", None, 500),
                                 status=500)

    loop = asyncio.get_running_loop()
    interval_s = cfg.token_interval_ms / 1000.0
    first_delay_s = engine.ttft_ms / 1000.0 if engine.mode == "slow" else interval_s
    req_id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(8)
    created = int(time.time())
    model_json = json.dumps(cfg.model)
    offset = secrets.randbelow(len(_VOCAB))
    produced = 0
    finished = "abort"
    resp: web.StreamResponse | None = None

    engine.in_flight += 1
    try:
        if job.stream:
            resp = web.StreamResponse(status=200)
            resp.content_type = "text/event-stream"
            resp.charset = "utf-8"
            resp.headers["Cache-Control"] = "no-cache"
            await resp.prepare(request)  # headers go out at once, like vLLM
            head = (f'data: {{"id":"{req_id}","object":"'
                    f'{"chat.completion.chunk" if chat else "text_completion"}",'
                    f'"created":{created},"model":{model_json},"choices":[{{"index":0,')
            if chat:
                role_chunk = (head + '"delta":{"role":"assistant","content":""},'
                              '"logprobs":null,"finish_reason":null}],'
                              '"prompt_token_ids":null,"prompt_text":null}\n\n').encode()
                tok_prefix = head + '"delta":{"content":'
                mid_suffix = ('},"logprobs":null,"finish_reason":null,'
                              '"token_ids":null}]}\n\n')
                last_suffix = ('},"logprobs":null,"finish_reason":"length","stop_reason":null,'
                               '"token_ids":null}]' + _fp_tail(job) + '}\n\n')
            else:
                role_chunk = b""
                tok_prefix = head + '"text":'
                mid_suffix = (',"logprobs":null,"finish_reason":null,"stop_reason":null,'
                              '"prompt_token_ids":null,"token_ids":null}]}\n\n')
                last_suffix = (',"logprobs":null,"finish_reason":"length","stop_reason":null,'
                               '"prompt_token_ids":null,"token_ids":null}]'
                               + _fp_tail(job) + '}\n\n')
        deadline = loop.time() + first_delay_s
        pieces: list[str] = []
        while produced < job.max_tokens:
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if not await engine.wait_runnable(request):
                break
            now = loop.time()
            if now - deadline > interval_s:  # fell behind (or was hung): no burst to catch up
                deadline = now
            if produced == 0:
                engine._c_prompt.inc(job.prompt_tokens)
            idx = (offset + produced) % len(_VOCAB)
            produced += 1
            engine._c_gen.inc()
            deadline += interval_s
            if resp is None:
                pieces.append(_VOCAB[idx])
                continue
            last = produced == job.max_tokens
            chunk = (tok_prefix + _VOCAB_JSON[idx] + (last_suffix if last else mid_suffix)).encode()
            if produced == 1 and role_chunk:
                chunk = role_chunk + chunk
            await resp.write(chunk)
        else:
            finished = "length"

        if resp is not None:
            if finished == "length":
                tail = b""
                if job.include_usage:
                    usage = {"id": req_id,
                             "object": "chat.completion.chunk" if chat else "text_completion",
                             "created": created, "model": cfg.model, "choices": [],
                             "usage": _usage(job, produced),
                             "system_fingerprint": _SYSTEM_FINGERPRINT}
                    tail = b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n"
                await resp.write(tail + b"data: [DONE]\n\n")
                await resp.write_eof()
            return resp
        if finished != "length":
            # Parked request released by shutdown or a vanished client: nobody to answer.
            raise web.HTTPServiceUnavailable()
        return web.json_response(_full_body(job, req_id, created, cfg.model, "".join(pieces),
                                            produced))
    except ConnectionError:  # client went away mid-stream (ConnectionResetError and kin)
        finished = "abort"
        return resp if resp is not None else web.Response(status=499)
    finally:
        engine.in_flight -= 1
        engine._c_success[finished].inc()


def _fp_tail(job: _Job) -> str:
    """Fields vLLM puts after ``choices`` in the last token chunk (fingerprint unless usage)."""
    if job.include_usage:
        return ""
    return f',"system_fingerprint":"{_SYSTEM_FINGERPRINT}"'


def _full_body(job: _Job, req_id: str, created: int, model: str, text: str,
               produced: int) -> dict[str, Any]:
    usage = dict(_usage(job, produced), prompt_tokens_details=None, completion_tokens_details=None)
    if job.chat:
        choice = {"index": 0,
                  "message": {"role": "assistant", "content": text, "refusal": None,
                              "annotations": None, "audio": None, "function_call": None,
                              "reasoning": None},
                  "logprobs": None, "finish_reason": "length", "stop_reason": None,
                  "token_ids": None, "routed_experts": None}
        return {"id": req_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "service_tier": None,
                "system_fingerprint": _SYSTEM_FINGERPRINT, "usage": usage,
                "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
              "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
              "prompt_token_ids": None, "routed_experts": None}
    return {"id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "service_tier": None, "system_fingerprint": _SYSTEM_FINGERPRINT,
            "usage": usage, "kv_transfer_params": None, "ec_transfer_params": None,
            "metrics": None}


# --------------------------------------------------------------------------------- handlers
async def _completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _inference(request, chat=True)


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[SIM_ENGINE_KEY].cfg
    created = int(time.time())
    return web.json_response({"object": "list", "data": [{
        "id": cfg.model, "object": "model", "created": created, "owned_by": "vllm",
        "root": cfg.model, "parent": None, "max_model_len": cfg.max_model_len,
        "permission": [{"id": "modelperm-" + secrets.token_hex(8), "object": "model_permission",
                        "created": created, "allow_create_engine": False,
                        "allow_sampling": True, "allow_logprobs": True,
                        "allow_search_indices": False, "allow_view": True,
                        "allow_fine_tuning": False, "organization": "*", "group": None,
                        "is_blocking": False}]}]})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[SIM_ENGINE_KEY].render_metrics()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _get_fault(request: web.Request) -> web.Response:
    return web.json_response(request.app[SIM_ENGINE_KEY].fault_state())


def _fault_error(message: str) -> web.Response:
    return web.json_response(_error_body(message, "BadRequestError", None, 400), status=400)


async def _set_fault(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE_KEY]
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _fault_error("body must be a JSON object")
    if not isinstance(body, dict):
        return _fault_error("body must be a JSON object")
    unknown = set(body) - {"mode", "ttft_ms", "waiting", "prefill_ms"}
    if unknown:
        return _fault_error(f"unknown fields: {', '.join(sorted(unknown))}")
    mode = body.get("mode")
    ttft = body.get("ttft_ms")
    waiting = body.get("waiting")
    prefill = body.get("prefill_ms")
    if not isinstance(mode, str):
        return _fault_error(f"mode must be one of {', '.join(FAULT_MODES)}")
    if ttft is not None and (isinstance(ttft, bool) or not isinstance(ttft, (int, float))):
        return _fault_error("ttft_ms must be a number >= 0")
    if waiting is not None and (isinstance(waiting, bool) or not isinstance(waiting, int)):
        return _fault_error("waiting must be an integer >= 0")
    if prefill is not None and (isinstance(prefill, bool) or not isinstance(prefill, (int, float))):
        return _fault_error("prefill_ms must be a number > 0")
    try:
        state = engine.set_fault(mode, ttft_ms=ttft, waiting=waiting, prefill_ms=prefill)
    except ValueError as exc:
        return _fault_error(str(exc))
    return web.json_response(state)


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[SIM_ENGINE_KEY].stats())


def build_app(cfg: SimConfig) -> web.Application:
    """Build the aiohttp application of one simulated engine.

    The engine state is at ``app[SIM_ENGINE_KEY]`` (a :class:`SimEngine`). On app shutdown,
    requests parked by a ``hang`` fault and running streams are ended so shutdown is prompt.
    """
    app = web.Application()
    engine = SimEngine(cfg)
    app[SIM_ENGINE_KEY] = engine
    served_by = cfg.replica_id

    async def on_prepare(request: web.BaseRequest, response: web.StreamResponse) -> None:
        response.headers[SERVED_BY_HEADER] = served_by
        if request.path in _INFERENCE_PATHS:
            engine.count_status(response.status)

    async def on_shutdown(app: web.Application) -> None:
        engine.close()

    app.on_response_prepare.append(on_prepare)
    app.on_shutdown.append(on_shutdown)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/health", _health, allow_head=False)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/sim/fault", _get_fault)
    app.router.add_post("/sim/fault", _set_fault)
    app.router.add_get("/sim/stats", _stats)
    return app


# --------------------------------------------------------------------------------- CLI
def _parse_args(argv: list[str] | None) -> SimConfig:
    parser = argparse.ArgumentParser(
        prog="sim-engine",
        description="Simulated OpenAI-compatible LLM engine (vLLM-shaped) with fault injection.")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000,
                        help="listen port (default 8000; 0 picks a free one)")
    parser.add_argument("--replica-id", default="", help="name in x-served-by (default sim-PORT)")
    parser.add_argument("--model", default="sim-model", help="served model id (default sim-model)")
    parser.add_argument("--token-interval-ms", type=float, default=20.0,
                        help="pace between streamed tokens in ms (default 20)")
    args = parser.parse_args(argv)
    if args.token_interval_ms < 0 or not math.isfinite(args.token_interval_ms):
        parser.error("--token-interval-ms must be a finite number >= 0")
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in 0..65535")
    return SimConfig(host=args.host, port=args.port, replica_id=args.replica_id,
                     model=args.model, token_interval_ms=args.token_interval_ms)


async def _serve(cfg: SimConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner: web.AppRunner | None = None
    try:
        if cfg.port == 0:
            # Bind first so the default replica id can name the real port.
            sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((cfg.host, 0))
            port = sock.getsockname()[1]
            if cfg.replica_id == "sim-0":
                cfg.replica_id = f"sim-{port}"
            cfg.port = port
            app = build_app(cfg)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                   shutdown_timeout=2.0)
            await runner.setup()
            site: web.BaseSite = web.SockSite(runner, sock)
        else:
            app = build_app(cfg)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                   shutdown_timeout=2.0)
            await runner.setup()
            site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        print(f"sim-engine {cfg.replica_id} listening on http://{host}:{cfg.port}", flush=True)
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if runner is not None:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Run one simulated engine until SIGTERM or SIGINT.

    Args:
        argv: command-line arguments without the program name (``--host --port --replica-id
            --model --token-interval-ms``); ``None`` reads ``sys.argv[1:]``.

    Returns:
        0 after a clean shutdown; 1 when the port cannot be bound.
    """
    cfg = _parse_args(argv)
    try:
        asyncio.run(_serve(cfg))
    except OSError as exc:
        print(f"sim-engine: cannot listen on {cfg.host}:{cfg.port}: {exc}", file=sys.stderr,
              flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
