"""The OpenAI-compatible adapters (vLLM as the probe, the generic one for metrics) against real
vLLM 0.32.0 fixture bytes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from node_probe.engines import OPENAI, VLLM, EngineRequestError, run_probe
from node_probe.engines.http_helpers import is_engine_fatal_text
from node_probe.engines.openai_compat import fetch_models
from node_probe.proto import probe_pb2
from xds_server.testing import free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32.0-cpu"
MODEL = "local/tiny-llama-1"



# ---------------------------------------------------------------------------------------------
# fixture helpers


def raw_response(name: str) -> tuple[int, dict[str, str], list[bytes]]:
    """Split a captured ``.raw`` HTTP response into status, headers and body chunks (one entry
    per HTTP chunk when chunked, i.e. one per SSE event as vLLM wrote them)."""
    data = (FIXTURES / name).read_bytes()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        chunks = []
        rest = body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            chunks.append(rest[:size])
            rest = rest[size + 2 :]
        return status, headers, chunks
    return status, headers, [body]


def metrics_text(name: str) -> str:
    return b"".join(raw_response(name)[2]).decode()



Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]




def replay(name: str, delays: list[float] | None = None, seen: list | None = None) -> Handler:
    """Handler that replays a fixture's status, content type and chunks; ``delays[i]`` seconds
    are slept before chunk i."""
    status, headers, chunks = raw_response(name)

    async def handler(request: web.Request) -> web.StreamResponse:
        if seen is not None:
            seen.append((dict(request.headers), await request.json()))
        resp = web.StreamResponse(status=status)
        resp.content_type = headers["content-type"].split(";")[0]
        await resp.prepare(request)
        for i, chunk in enumerate(chunks):
            if delays and i < len(delays) and delays[i]:
                await asyncio.sleep(delays[i])
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    return handler


def sse_handler(events: list[tuple[float, str]], status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=status)
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        for delay, data in events:
            if delay:
                await asyncio.sleep(delay)
            await resp.write(f"data: {data}\n\n".encode())
        await resp.write_eof()
        return resp

    return handler


# ---------------------------------------------------------------------------------------------
# parse_metrics


def test_parse_real_vllm_metrics_after_requests():
    r = OPENAI.parse_metrics(metrics_text("03b_metrics_after_requests.raw"))
    assert r.requests_running == 0.0
    assert r.requests_waiting == 0.0
    assert r.kv_cache_usage_ratio == 0.0
    assert r.kv_cache_metric == "vllm:kv_cache_usage_perc"
    assert r.prefix_cache_hit_ratio == 0.0  # 0 hits / 62 queries
    assert r.generation_tokens_total == 11.0


def test_parse_real_vllm_metrics_during_load():
    r = OPENAI.parse_metrics(metrics_text("13_metrics_during_load.raw"))
    assert r.requests_running == 3.0
    assert r.requests_waiting == 0.0
    assert r.kv_cache_usage_ratio == pytest.approx(0.00073260073260073)
    assert r.generation_tokens_total == 247.0
    assert r.prefix_cache_hit_ratio == 0.0  # 0 hits / 3 queries


def test_parse_fixture_txt_body_matches_raw():
    txt = (FIXTURES / "03b_metrics_after_requests.txt").read_text()
    body = txt.split("## BODY (de-chunked)\n", 1)[1].split("\n## ", 1)[0]
    assert OPENAI.parse_metrics(body) == OPENAI.parse_metrics(metrics_text("03b_metrics_after_requests.raw"))


def _gauge(name: str, engine: str, value: float) -> str:
    return f'{name}{{engine="{engine}",model_name="m"}} {value}\n'


def test_kv_only_old_name():
    r = OPENAI.parse_metrics(_gauge("vllm:gpu_cache_usage_perc", "0", 0.91))
    assert r.kv_cache_usage_ratio == pytest.approx(0.91)
    assert r.kv_cache_metric == "vllm:gpu_cache_usage_perc"


def test_kv_both_names_counted_once_new_preferred():
    text = _gauge("vllm:gpu_cache_usage_perc", "0", 0.91) + _gauge("vllm:kv_cache_usage_perc", "0", 0.91)
    r = OPENAI.parse_metrics(text)
    assert r.kv_cache_usage_ratio == pytest.approx(0.91)
    assert r.kv_cache_metric == "vllm:kv_cache_usage_perc"


def test_kv_two_engines_takes_max():
    text = _gauge("vllm:kv_cache_usage_perc", "0", 0.91) + _gauge("vllm:kv_cache_usage_perc", "1", 0.40)
    assert OPENAI.parse_metrics(text).kv_cache_usage_ratio == pytest.approx(0.91)


def test_kv_neither_name_is_unknown():
    r = OPENAI.parse_metrics(_gauge("vllm:num_requests_running", "0", 1))
    assert r.kv_cache_usage_ratio is None
    assert r.kv_cache_metric == ""
    assert r.requests_waiting is None  # unknown, not 0
    assert r.prefix_cache_hit_ratio is None
    assert r.generation_tokens_total is None


def test_counts_summed_over_engines_and_prefix_ratio():
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        + _gauge("vllm:num_requests_running", "0", 2)
        + _gauge("vllm:num_requests_running", "1", 3)
        + _gauge("vllm:num_requests_waiting", "0", 7)
        + _gauge("vllm:num_requests_waiting", "1", 1)
        + "# TYPE vllm:prefix_cache_queries counter\n"
        + _gauge("vllm:prefix_cache_queries_total", "0", 60)
        + _gauge("vllm:prefix_cache_queries_total", "1", 40)
        + "# TYPE vllm:prefix_cache_hits counter\n"
        + _gauge("vllm:prefix_cache_hits_total", "0", 20)
        + _gauge("vllm:prefix_cache_hits_total", "1", 5)
        + _gauge("vllm:generation_tokens_total", "0", 100)
        + _gauge("vllm:generation_tokens_total", "1", 23)
        + _gauge("vllm:external_prefix_cache_queries_total", "0", 999)
    )
    r = OPENAI.parse_metrics(text)
    assert r.requests_running == 5
    assert r.requests_waiting == 8
    assert r.prefix_cache_hit_ratio == pytest.approx(0.25)
    assert r.generation_tokens_total == 123


def test_prefix_ratio_unknown_without_queries_and_nan_ignored():
    text = (
        _gauge("vllm:prefix_cache_queries_total", "0", 0)
        + _gauge("vllm:prefix_cache_hits_total", "0", 0)
        + _gauge("vllm:kv_cache_usage_perc", "0", "NaN")
    )
    r = OPENAI.parse_metrics(text)
    assert r.prefix_cache_hit_ratio is None
    assert r.kv_cache_usage_ratio is None


def test_sglang_names():
    text = (
        'sglang:num_running_reqs{model_name="m"} 4\n'
        'sglang:num_queue_reqs{model_name="m"} 2\n'
        'sglang:token_usage{model_name="m"} 0.5\n'
        'sglang:cache_hit_rate{model_name="m"} 0.25\n'
    )
    r = OPENAI.parse_metrics(text)
    assert (r.requests_running, r.requests_waiting) == (4, 2)
    assert r.kv_cache_usage_ratio == 0.5 and r.kv_cache_metric == "sglang:token_usage"
    assert r.prefix_cache_hit_ratio == 0.25


def test_parse_metrics_rejects_garbage():
    with pytest.raises(ValueError):
        OPENAI.parse_metrics('vllm:num_requests_running{engine="0"} not-a-number\n')


def test_fatal_text_matcher():
    body = raw_response("sigkill_fine_v1_completions_500.raw")[2][0].decode()
    assert is_engine_fatal_text(body)
    for text in ("CUDA error: an illegal memory access", "torch.OutOfMemoryError: CUDA out of memory",
                 "vllm.v1.engine.exceptions.EngineDeadError", "engine dead"):
        assert is_engine_fatal_text(text)
    assert not is_engine_fatal_text('{"error":{"message":"Too many requests"}}')


# ---------------------------------------------------------------------------------------------
# run_probe through the vLLM adapter


async def test_probe_completion_stream_ok_and_request_shape(serve, session):
    seen: list = []
    url = await serve({("POST", "/v1/completions"): replay("05_completion_stream.raw", [0.05], seen)})
    out = await run_probe(session, VLLM, url, MODEL, 2.0)
    assert out.ok, out
    assert out.failure == probe_pb2.FAILURE_KIND_UNSPECIFIED
    assert out.http_status == 200
    assert 45 <= out.ttft_ms < 1000
    out2 = await run_probe(session, VLLM, url, MODEL, 2.0)
    assert out2.ok
    (h1, b1), (_h2, b2) = seen
    assert h1.get("x-sentinel-probe") == "1"
    assert b1["model"] == MODEL
    assert (b1["max_tokens"], b1["temperature"], b1["stream"]) == (1, 0, True)
    assert isinstance(b1["cache_salt"], str) and b1["cache_salt"]
    int(b1["cache_salt"], 16)
    assert b1["cache_salt"] != b2["cache_salt"]
    assert b1["prompt"] != b2["prompt"] and 0 < len(b1["prompt"]) <= 16


async def test_probe_chat_stream_ttft_is_content_not_role(serve, session):
    # role-only chunk at once, the content chunk 150 ms later
    url = await serve({("POST", "/v1/completions"): replay("07_chat_stream.raw", [0.0, 0.15])})
    out = await run_probe(session, VLLM, url, MODEL, 2.0)
    assert out.ok, out
    assert out.ttft_ms >= 145


async def test_probe_headers_then_silence_is_timeout(serve, session):
    async def frozen(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200)
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        await asyncio.sleep(30)
        return resp

    url = await serve({("POST", "/v1/completions"): frozen})
    t0 = time.monotonic()
    out = await run_probe(session, VLLM, url, MODEL, 0.3)
    elapsed = time.monotonic() - t0
    assert out.failure == probe_pb2.FAILURE_KIND_TIMEOUT, out
    assert not out.ok and out.http_status == 200
    assert 0.29 <= elapsed < 0.6


async def test_probe_no_headers_is_timeout(serve, session):
    async def stuck(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)
        return web.Response()

    url = await serve({("POST", "/v1/completions"): stuck})
    out = await run_probe(session, VLLM, url, MODEL, 0.2)
    assert out.failure == probe_pb2.FAILURE_KIND_TIMEOUT and out.http_status == 0


async def test_probe_500_engine_dead_is_engine_fatal(serve, session):
    url = await serve({("POST", "/v1/completions"): replay("sigkill_fine_v1_completions_500.raw")})
    out = await run_probe(session, VLLM, url, MODEL, 2.0)
    assert out.failure == probe_pb2.FAILURE_KIND_ENGINE_FATAL, out
    assert out.http_status == 500
    assert "EngineCore encountered an issue" in out.detail


@pytest.mark.parametrize("status", [429, 503, 400])
async def test_probe_http_status(serve, session, status):
    async def h(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy", "code": status}}, status=status)

    url = await serve({("POST", "/v1/completions"): h})
    out = await run_probe(session, VLLM, url, MODEL, 2.0)
    assert out.failure == probe_pb2.FAILURE_KIND_HTTP_STATUS, out
    assert out.http_status == status


async def test_probe_unknown_model_404_from_fixture(serve, session):
    url = await serve({("POST", "/v1/completions"): replay("08d_unknown_model.raw")})
    out = await run_probe(session, VLLM, url, "nope", 2.0)
    assert out.failure == probe_pb2.FAILURE_KIND_HTTP_STATUS and out.http_status == 404


async def test_probe_connection_refused_is_connect(session):
    out = await run_probe(session, VLLM, f"http://127.0.0.1:{free_port()}", MODEL, 1.0)
    assert out.failure == probe_pb2.FAILURE_KIND_CONNECT, out
    assert out.http_status == 0 and not out.answered


async def test_probe_closed_without_response_is_connect(session):
    # What an in-flight request saw when vLLM's EngineCore was SIGKILLed (0 bytes back).
    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        out = await run_probe(session, VLLM, f"http://127.0.0.1:{port}", MODEL, 1.0)
    finally:
        server.close()
        await server.wait_closed()
    assert out.failure == probe_pb2.FAILURE_KIND_CONNECT, out


async def test_probe_done_without_token_is_bad_output(serve, session):
    role_only = json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    empty = json.dumps({"choices": [{"index": 0, "text": ""}]})
    url = await serve({("POST", "/v1/completions"): sse_handler([(0, role_only), (0, empty), (0, "[DONE]")])})
    out = await run_probe(session, VLLM, url, MODEL, 2.0)
    assert out.failure == probe_pb2.FAILURE_KIND_BAD_OUTPUT, out
    assert out.http_status == 200 and not out.ok


async def test_probe_stream_closed_without_token_is_bad_output(serve, session):
    url = await serve({("POST", "/v1/completions"): sse_handler([])})
    out = await run_probe(session, VLLM, url, MODEL, 2.0)
    assert out.failure == probe_pb2.FAILURE_KIND_BAD_OUTPUT


async def test_probe_unparseable_chunk_is_bad_output(serve, session):
    url = await serve({("POST", "/v1/completions"): sse_handler([(0, "{not json")])})
    out = await run_probe(session, VLLM, url, MODEL, 2.0)
    assert out.failure == probe_pb2.FAILURE_KIND_BAD_OUTPUT
    assert "unparseable" in out.detail


async def test_probe_error_chunk_after_200_is_engine_fatal(serve, session):
    err = json.dumps({"error": {"message": "CUDA error: an illegal memory access was encountered",
                                "type": "InternalServerError", "code": 500}})
    url = await serve({("POST", "/v1/completions"): sse_handler([(0, err), (0, "[DONE]")])})
    out = await run_probe(session, VLLM, url, MODEL, 2.0)
    assert out.failure == probe_pb2.FAILURE_KIND_ENGINE_FATAL, out
    assert out.http_status == 200


async def test_probe_non_streaming_answer_accepted(serve, session):
    url = await serve({("POST", "/v1/completions"): replay("04_completion_nostream.raw")})
    out = await run_probe(session, VLLM, url, MODEL, 2.0)
    assert out.ok, out


async def test_probe_closes_stream_right_after_first_token(serve, session):
    finished = asyncio.Event()
    cancelled = asyncio.Event()
    token = json.dumps({"choices": [{"index": 0, "text": "a"}]})

    async def long_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200)
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        try:
            await resp.write(f"data: {token}\n\n".encode())
            for _ in range(100):
                await asyncio.sleep(0.02)
                await resp.write(f"data: {token}\n\n".encode())
            finished.set()
        except (asyncio.CancelledError, ConnectionError):
            cancelled.set()
            raise
        return resp

    url = await serve({("POST", "/v1/completions"): long_stream})
    t0 = time.monotonic()
    out = await run_probe(session, VLLM, url, MODEL, 2.0)
    assert out.ok and time.monotonic() - t0 < 0.5
    await asyncio.wait_for(cancelled.wait(), 1.0)
    assert not finished.is_set()


# ---------------------------------------------------------------------------------------------
# fetch_models / read_metrics


async def test_fetch_models_from_fixture(serve, session):
    url = await serve({("GET", "/v1/models"): replay("02_models.raw")})
    assert await fetch_models(session, url, 1.0) == [MODEL]


async def test_read_metrics_ok_and_errors(serve, session):
    async def boom(request: web.Request) -> web.Response:
        return web.Response(status=500, text="internal")

    url = await serve({("GET", "/metrics"): replay("13_metrics_during_load.raw")})
    reading = await OPENAI.read_metrics(session, url, 1.0)
    assert reading.requests_running == 3.0

    bad = await serve({("GET", "/metrics"): boom})
    with pytest.raises(EngineRequestError) as ei:
        await OPENAI.read_metrics(session, bad, 1.0)
    assert ei.value.kind == probe_pb2.FAILURE_KIND_HTTP_STATUS and ei.value.http_status == 500

    with pytest.raises(EngineRequestError) as ei:
        await OPENAI.read_metrics(session, f"http://127.0.0.1:{free_port()}", 1.0)
    assert ei.value.kind == probe_pb2.FAILURE_KIND_CONNECT and not ei.value.answered
