"""HTTP layer of the simulated engine: vLLM 0.32's OpenAI-compatible wire format.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming and not),
``GET /health``, ``GET /v1/models``, ``GET /metrics``, ``GET|POST /sim/fault``,
``GET /sim/stats``. Response shapes follow the captures in ``tests/fixtures/vllm-0.32.0-cpu``;
with ``return_token_ids`` they carry ids where vLLM puts them:

- completions: each choice has ``token_ids`` (the ids of that chunk's tokens; in a non-streaming
  body all of them) and ``prompt_token_ids`` (non-streaming: always; streaming: in the choice's
  first chunk, null after);
- chat: each choice has ``token_ids``; ``prompt_token_ids`` is top-level (non-streaming body; in
  a stream, on the role chunk that opens each choice).

A stream sends one chunk per generated token and choice, in order; the last chunk of a choice has
its ``finish_reason`` ("length" or "stop") and ``stop_reason`` (the matched stop string or null).
With ``stream_options.include_usage`` a ``choices: []`` usage chunk precedes ``data: [DONE]``.
Faults are described in :mod:`node_probe.sim.faults`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import struct
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from node_probe.sim.engine import SimConfig, SimEngine
from node_probe.sim.faults import FAULT_FIELDS, FAULT_MODES, GARBLED_EVENT
from node_probe.sim.model import Decoder
from node_probe.sim.protocol import BadRequest, Job, parse_job

__all__ = ["CUDA_ERROR_MESSAGE", "ENGINE_DEAD_MESSAGE", "PROBE_HEADER", "SERVED_BY_HEADER",
           "SIM_ENGINE_KEY", "build_app"]

#: Header that marks a request as a health probe (any non-empty value).
PROBE_HEADER = "x-sentinel-probe"
#: Header added to every response, naming the replica that served it.
SERVED_BY_HEADER = "x-served-by"
#: Body of the 500 answered under the ``error`` fault (what a vLLM with a broken GPU says).
CUDA_ERROR_MESSAGE = "CUDA error: an illegal memory access was encountered"
#: Message of the 500 a non-streaming request gets under ``fail_after`` (vLLM, EngineCore dead).
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
#: Message of vLLM's in-band error event (``error_after``).
GENERATION_ERROR_MESSAGE = "Internal server error"

SIM_ENGINE_KEY = web.AppKey("sim_engine", SimEngine)

_FP = "vllm-0.32.0-sim"
_INFERENCE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def error_body(message: str, type_: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _j(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class _Cut(Exception):
    """The request's connection was cut by a fault (nothing more may be written)."""


class _Exchange:
    """One inference request being served: its decoders and how its chunks are written."""

    def __init__(self, job: Job, cfg: SimConfig) -> None:
        self.job = job
        self.cfg = cfg
        self.req_id = ("chatcmpl-" if job.chat else "cmpl-") + secrets.token_hex(8)
        self.created = int(time.time())
        self.decoders = [Decoder(list(ids), job.max_tokens, job.min_tokens, job.stop,
                                 job.ignore_eos, job.include_stop_str_in_output, cfg.eos_rate,
                                 heal, cfg.byte_token_rate) for ids, heal in job.prompts for _ in range(job.n)]
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        self.head = (f'data: {{"id":"{self.req_id}","object":"{obj}","created":{self.created},'
                     f'"model":{_j(cfg.model)},"choices":[')
        self.ids_sent = [False] * len(self.decoders)

    @property
    def produced(self) -> int:
        return sum(len(d.ids) for d in self.decoders)

    def prompt_ids(self, choice: int) -> list[int]:
        return self.decoders[choice].prompt_ids

    def opening(self) -> bytes:
        """Chat: the role chunk of each choice (no token); completions: nothing."""
        if not self.job.chat:
            return b""
        out = []
        for i in range(len(self.decoders)):
            pids = _j(self.prompt_ids(i)) if self.job.return_token_ids else "null"
            out.append(f'{self.head}{{"index":{i},"delta":{{"role":"assistant","content":""}},'
                       f'"logprobs":null,"finish_reason":null}}],"prompt_token_ids":{pids},'
                       f'"prompt_text":null}}\n\n')
        return "".join(out).encode()

    def chunk(self, i: int, text: str, tid: int, finish: str | None, stop: Any) -> str:
        job = self.job
        tids = f"[{tid}]" if job.return_token_ids else "null"
        end = "}]}\n\n" if finish is None else \
            "}]" + ("" if job.include_usage else f',"system_fingerprint":"{_FP}"') + "}\n\n"
        fin = "null" if finish is None else f'"{finish}","stop_reason":{_j(stop)}'
        if job.chat:
            return (f'{self.head}{{"index":{i},"delta":{{"content":{_j(text)}}},"logprobs":null,'
                    f'"finish_reason":{fin},"token_ids":{tids}{end}')
        pids = "null"
        if job.return_token_ids and not self.ids_sent[i]:
            self.ids_sent[i] = True
            pids = _j(self.prompt_ids(i))
        if finish is None:
            fin += ',"stop_reason":null'
        return (f'{self.head}{{"index":{i},"text":{_j(text)},"logprobs":null,'
                f'"finish_reason":{fin},"prompt_token_ids":{pids},"token_ids":{tids}{end}')

    def usage(self) -> dict[str, int]:
        p, c = self.job.prompt_tokens, self.produced
        return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}

    def usage_chunk(self) -> bytes:
        obj = "chat.completion.chunk" if self.job.chat else "text_completion"
        body = {"id": self.req_id, "object": obj, "created": self.created,
                "model": self.cfg.model, "choices": [], "usage": self.usage(),
                "system_fingerprint": _FP}
        return b"data: " + _j(body).encode() + b"\n\n"

    def full_body(self) -> dict[str, Any]:
        job = self.job
        usage = dict(self.usage(), prompt_tokens_details=None, completion_tokens_details=None)
        choices = []
        for i, d in enumerate(self.decoders):
            tids = list(d.ids) if job.return_token_ids else None
            if job.chat:
                choices.append({
                    "index": i,
                    "message": {"role": "assistant", "content": d.text, "refusal": None,
                                "annotations": None, "audio": None, "function_call": None,
                                "reasoning": None},
                    "logprobs": None, "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason, "token_ids": tids, "routed_experts": None})
            else:
                choices.append({
                    "index": i, "text": d.text, "logprobs": None,
                    "finish_reason": d.finish_reason, "stop_reason": d.stop_reason,
                    "token_ids": tids, "prompt_logprobs": None,
                    "prompt_token_ids": self.prompt_ids(i) if job.return_token_ids else None,
                    "routed_experts": None})
        common = {"id": self.req_id, "created": self.created, "model": self.cfg.model,
                  "choices": choices, "service_tier": None, "system_fingerprint": _FP,
                  "usage": usage}
        if job.chat:
            return {**common, "object": "chat.completion", "prompt_logprobs": None,
                    "prompt_token_ids": self.prompt_ids(0) if job.return_token_ids else None,
                    "prompt_text": None, "kv_transfer_params": None,
                    "ec_transfer_params": None, "metrics": None}
        return {**common, "object": "text_completion", "kv_transfer_params": None,
                "ec_transfer_params": None, "metrics": None}


def _reset(request: web.BaseRequest) -> None:
    """Abort the request's TCP connection with RST (SO_LINGER 0)."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


async def _inference(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[SIM_ENGINE_KEY]
    cfg = engine.cfg
    probe = bool(request.headers.get(PROBE_HEADER))
    engine.requests_total += 1
    engine.requests_by_kind["probe" if probe else "user"] += 1
    try:
        job = parse_job(await request.read(), chat, served_model=cfg.model,
                        default_max_tokens=cfg.default_max_tokens,
                        max_model_len=cfg.max_model_len)
    except BadRequest as exc:
        return web.json_response(error_body(exc.message, exc.type, exc.param, exc.status),
                                 status=exc.status)
    if engine.mode == "error" or engine.faults.fails_request(probe, job.prompt_tokens):  # user_error
        return web.json_response(error_body(CUDA_ERROR_MESSAGE, "InternalServerError", None, 500),
                                 status=500)

    ex = _Exchange(job, cfg)
    loop = asyncio.get_running_loop()
    finished = "abort"
    resp: web.StreamResponse | None = None
    engine.in_flight += 1
    slot = False  # a slot in the batch is held (max_num_seqs)
    try:
        hang_here = engine.faults.on_headers(probe)
        if job.stream:
            resp = web.StreamResponse(status=200)
            resp.content_type = "text/event-stream"
            resp.charset = "utf-8"
            resp.headers["Cache-Control"] = "no-cache"
            await resp.prepare(request)  # headers go out at once, like vLLM
        if hang_here and not await engine.park(request):
            raise _Cut
        slot = await engine.admit(request)  # waits FIFO while max_num_seqs decode: TTFT includes it
        if not slot:
            raise _Cut
        interval_s = cfg.token_interval_ms / 1000.0 * engine.faults.load_factor(engine.decoding - 1)  # load_slow
        first_delay_s = engine.faults.ttft_ms / 1000.0 if engine.mode == "slow" else interval_s
        pending = ex.opening()
        deadline = loop.time() + first_delay_s
        while not all(d.finished for d in ex.decoders):
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            fired = engine.faults.on_token(ex.produced, probe)
            if fired == "garble_after" and resp is not None:
                await resp.write(GARBLED_EVENT)
            if fired in ("reset_after", "fail_after", "error_after"):
                finished = "abort" if fired == "reset_after" else "error"
                return await _fail(request, resp, fired)
            if not await engine.wait_runnable(request):
                raise _Cut
            now = loop.time()
            if now - deadline > interval_s:  # fell behind (or was hung): no burst to catch up
                deadline = now
            if ex.produced == 0:
                engine.c_prompt.inc(job.prompt_tokens)
            parts = []
            for i, d in enumerate(ex.decoders):
                if not d.finished:
                    out = d.step()
                    engine.c_gen.inc()
                    if resp is not None:
                        parts.append(ex.chunk(i, out.text, out.token_id, out.finish_reason,
                                              out.stop_reason))
            deadline += interval_s
            if resp is not None:
                await resp.write(pending + "".join(parts).encode())
                pending = b""
        finished = ex.decoders[0].finish_reason or "length"
        if resp is None:
            return web.json_response(ex.full_body(), dumps=_j)
        await resp.write((ex.usage_chunk() if job.include_usage else b"") + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    except _Cut:
        # Parked request released by shutdown or a vanished client: nobody to answer.
        if resp is not None:
            return resp
        raise web.HTTPServiceUnavailable() from None
    except ConnectionError:  # client went away mid-stream (ConnectionResetError and kin)
        finished = "abort"
        return resp if resp is not None else web.Response(status=499)
    finally:
        engine.in_flight -= 1
        if slot:
            engine.leave()
        engine.c_success[finished].inc()


async def _fail(request: web.Request, resp: web.StreamResponse | None,
                fired: str) -> web.StreamResponse:
    """Carry out a mid-stream fault (see :mod:`node_probe.sim.faults`)."""
    if fired == "reset_after":
        _reset(request)
        return resp if resp is not None else web.Response(status=499)
    if resp is None:
        message = ENGINE_DEAD_MESSAGE if fired == "fail_after" else GENERATION_ERROR_MESSAGE
        return web.json_response(error_body(message, "InternalServerError", None, 500),
                                 status=500)
    if fired == "fail_after":
        if request.transport is not None:
            request.transport.close()  # FIN after what was written: no last chunk, no [DONE]
        return resp
    err = error_body(GENERATION_ERROR_MESSAGE, "InternalServerError", None, 500)
    await resp.write(b"data: " + _j(err).encode() + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


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
    return web.json_response(error_body(message, "BadRequestError", None, 400), status=400)


async def _set_fault(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE_KEY]
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _fault_error("body must be a JSON object")
    if not isinstance(body, dict):
        return _fault_error("body must be a JSON object")
    unknown = set(body) - FAULT_FIELDS
    if unknown:
        return _fault_error(f"unknown fields: {', '.join(sorted(unknown))}")
    mode = body.get("mode")
    ttft = body.get("ttft_ms")
    if not isinstance(mode, str):
        return _fault_error(f"mode must be one of {', '.join(FAULT_MODES)}")
    if ttft is not None and (isinstance(ttft, bool) or not isinstance(ttft, (int, float))):
        return _fault_error("ttft_ms must be a number >= 0")
    try:
        state = engine.set_fault(mode, ttft_ms=ttft, waiting=body.get("waiting"),
                                 after_tokens=body.get("after_tokens"), times=body.get("times"),
                                 prefill_ms=body.get("prefill_ms"), rate=body.get("rate"),
                                 min_prompt_tokens=body.get("min_prompt_tokens"), knee=body.get("knee"))
    except ValueError as exc:
        return _fault_error(str(exc))
    return web.json_response(state)


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[SIM_ENGINE_KEY].stats())


def build_app(cfg: SimConfig) -> web.Application:
    """Build the aiohttp application of one simulated engine.

    The engine state is at ``app[SIM_ENGINE_KEY]`` (a :class:`SimEngine`). On app shutdown,
    parked requests and running streams are ended so shutdown is prompt.
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
