"""Engine adapters (node_probe.engines): vLLM against real vLLM 0.32.0 captures, SGLang, TGI and
Triton/TensorRT-LLM against fixtures in each engine's documented format (tests/fixtures/),
auto-detection, and the probe details every adapter shares (TTFT to content, headers_ms, EOS,
429, deep-check reads)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from node_probe.agent import _load_message
from node_probe.engines import (
    ADAPTERS,
    ENGINE_KINDS,
    SGLANG,
    TGI,
    TRITON,
    VLLM,
    EngineRequestError,
    detect_engine_kind,
    get_adapter,
    kind_from_metrics,
    run_probe,
)
from node_probe.proto import probe_pb2
from xds_server.testing import free_port

VLLM_FIX = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32.0-cpu"
FIX = Path(__file__).resolve().parents[1] / "fixtures"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def vllm_body(name: str) -> bytes:
    """Body of a captured vLLM response (de-chunked)."""
    data = (VLLM_FIX / name).read_bytes()
    head, _, body = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return body
    out = b""
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += body[:size]
        body = body[size + 2:]
    return out




def sse(body: bytes, delays: list[float] | None = None, seen: list | None = None,
        status: int = 200) -> Handler:
    """Replays an SSE body one event at a time (``delays[i]`` s before event i)."""
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e.strip()]

    async def handler(request: web.Request) -> web.StreamResponse:
        if seen is not None:
            seen.append((dict(request.headers), await request.json()))
        resp = web.StreamResponse(status=status)
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        for i, ev in enumerate(events):
            if delays and i < len(delays) and delays[i]:
                await asyncio.sleep(delays[i])
            await resp.write(ev)
        await resp.write_eof()
        return resp

    return handler


def text(body: str, status: int = 200, ctype: str = "text/plain") -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=body, status=status, content_type=ctype)

    return handler


# ---------------------------------------------------------------------------------------------
# registry


def test_registry_and_kinds():
    assert ENGINE_KINDS == ("auto", "vllm", "sglang", "tgi", "triton", "openai")
    assert get_adapter("vllm") is VLLM
    assert {k: a.kind for k, a in ADAPTERS.items()} == {k: k for k in ADAPTERS}
    assert ADAPTERS["vllm"].cache_salt_field == "cache_salt"
    assert all(ADAPTERS[k].cache_salt_field is None for k in ("sglang", "tgi", "triton", "openai"))


# ---------------------------------------------------------------------------------------------
# vLLM (real captures)


def test_vllm_metrics_real_capture_groups_and_progress():
    r = VLLM.parse_metrics(vllm_body("13_metrics_during_load.raw").decode())
    assert (r.requests_running, r.requests_waiting, r.generation_tokens_total) == (3.0, 0.0, 247.0)
    assert r.kv_cache_metric == "vllm:kv_cache_usage_perc"
    assert set(r.groups) == {"0"}  # the engine label
    g = r.groups["0"]
    assert (g.running, g.waiting, g.progress) == (3.0, 0.0, 250.0)  # 247 generated + 3 prompt
    assert r.stall_capable and "vllm:generation_tokens_total" in r.progress_metric


def test_vllm_keepalive_dead_metrics_still_parse():
    # Engine dead, API kept alive: /metrics answers 200 with stale numbers (fixture 12b).
    r = VLLM.parse_metrics(vllm_body("12b_keepalive_dead_metrics.raw").decode())
    assert r.requests_running is not None and r.kv_cache_metric == "vllm:kv_cache_usage_perc"


def _g(name: str, engine: str, value) -> str:
    return f'{name}{{engine="{engine}",model_name="m"}} {value}\n'


def test_kv_cache_read_from_old_or_new_vllm_gauge_counted_once_max_across_engines():
    """fc12: vLLM renamed its KV gauge; both generations are read, never counted twice, max
    across engines, and unknown stays unknown (never 0 or 1), with the metric name kept."""
    a = VLLM
    old = a.parse_metrics(_g("vllm:gpu_cache_usage_perc", "0", 0.91))
    assert old.kv_cache_usage_ratio == pytest.approx(0.91)
    assert old.kv_cache_metric == "vllm:gpu_cache_usage_perc"
    both = a.parse_metrics(_g("vllm:gpu_cache_usage_perc", "0", 0.91) + _g("vllm:kv_cache_usage_perc", "0", 0.91))
    assert both.kv_cache_usage_ratio == pytest.approx(0.91)  # counted once
    assert both.kv_cache_metric == "vllm:kv_cache_usage_perc"
    two = a.parse_metrics(_g("vllm:kv_cache_usage_perc", "0", 0.91) + _g("vllm:kv_cache_usage_perc", "1", 0.40))
    assert two.kv_cache_usage_ratio == pytest.approx(0.91)  # max across engines
    neither = a.parse_metrics(_g("vllm:num_requests_running", "0", 2))
    assert neither.kv_cache_usage_ratio is None and neither.kv_cache_metric == ""
    # ... and on the wire: unset (unknown), not 0.
    msg = _load_message(neither, "")
    assert msg.metrics_ok and not msg.HasField("kv_cache_usage_ratio") and msg.kv_cache_metric == ""
    assert _load_message(old, "").kv_cache_metric == "vllm:gpu_cache_usage_perc"


def test_vllm_per_engine_groups_keep_a_stuck_engine_visible():
    a = VLLM
    text_ = (_g("vllm:num_requests_running", "0", 2) + _g("vllm:num_requests_running", "1", 5)
             + _g("vllm:num_requests_waiting", "1", 4)
             + _g("vllm:generation_tokens_total", "0", 100) + _g("vllm:generation_tokens_total", "1", 900))
    r = a.parse_metrics(text_)
    assert (r.requests_running, r.requests_waiting, r.generation_tokens_total) == (7, 4, 1000)
    assert r.groups["0"].running == 2 and r.groups["1"].progress == 900
    assert r.groups["0"].waiting is None  # engine 0 has no waiting sample: unknown, not 0


def test_vllm_v0_prefix_hit_rate_gauge():
    r = VLLM.parse_metrics('vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.3\n')
    assert r.prefix_cache_hit_ratio == pytest.approx(0.3)


async def test_vllm_probe_request_shape_cache_salt_and_header(serve, session):
    seen: list = []
    url = await serve({("POST", "/v1/completions"): sse(vllm_body("05_completion_stream.raw"), [0.03], seen)})
    out = await run_probe(session, VLLM, url, "local/tiny-llama-1", 2.0)
    assert out.ok and out.http_status == 200 and 25 <= out.ttft_ms < 1000, out
    assert out.headers_ms is not None and 0 < out.headers_ms <= out.ttft_ms
    headers, body = seen[0]
    assert headers.get("x-sentinel-probe") == "1"
    assert body["cache_salt"] and isinstance(body["cache_salt"], str)
    assert (body["max_tokens"], body["temperature"], body["stream"], body["model"]) == \
        (1, 0, True, "local/tiny-llama-1")


async def test_vllm_fatal_500_after_sigkill_is_engine_fatal(serve, session):
    url = await serve({("POST", "/v1/completions"): text(
        vllm_body("sigkill_fine_v1_completions_500.raw").decode(), 500, "application/json")})
    out = await run_probe(session, VLLM, url, "m", 2.0)
    assert out.failure == probe_pb2.FAILURE_KIND_ENGINE_FATAL and out.http_status == 500
    assert out.headers_ms is not None


async def test_role_only_first_chunk_is_not_a_token(serve, session):
    role = json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}]})
    tok = json.dumps({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]})
    body = f"data: {role}\n\ndata: {tok}\n\ndata: [DONE]\n\n".encode()
    url = await serve({("POST", "/v1/completions"): sse(body, [0.0, 0.2])})
    out = await run_probe(session, VLLM, url, "m", 2.0)
    assert out.ok and out.ttft_ms >= 190 and out.text == "hi", out
    assert out.headers_ms < 100  # headers came at once; the token did not


async def test_eos_as_first_token_counts(serve, session):
    # Greedy first token = end of sequence: empty text, finish_reason "stop". The engine decoded.
    eos = json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
    url = await serve({("POST", "/v1/completions"): sse(f"data: {eos}\n\ndata: [DONE]\n\n".encode())})
    out = await run_probe(session, VLLM, url, "m", 2.0)
    assert out.ok, out


async def test_429_is_http_status_marked_as_load(serve, session):
    url = await serve({("POST", "/v1/completions"): text('{"error":{"message":"Too many requests"}}', 429)})
    out = await run_probe(session, VLLM, url, "m", 2.0)
    assert out.failure == probe_pb2.FAILURE_KIND_HTTP_STATUS and out.http_status == 429
    assert "load, not death" in out.detail


async def test_deep_probe_reads_the_whole_answer(serve, session):
    chunks = [json.dumps({"choices": [{"index": 0, "text": t, "finish_reason": f}]})
              for t, f in ((" 2", None), ("\n", None), ("3", "length"))]
    seen: list = []
    body = "".join(f"data: {c}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"
    url = await serve({("POST", "/v1/completions"): sse(body, seen=seen)})
    out = await run_probe(session, VLLM, url, "m", 2.0, deep_prompt="1+1=", max_tokens=4)
    assert out.ok and out.text == " 2\n3"
    assert seen[0][1]["prompt"] == "1+1=" and seen[0][1]["max_tokens"] == 4  # prompt not altered
    assert seen[0][1]["cache_salt"]


# ---------------------------------------------------------------------------------------------
# SGLang


def test_sglang_metrics_fixture_tp_ranks_counted_once():
    r = SGLANG.parse_metrics((FIX / "sglang" / "metrics.txt").read_text())
    assert (r.requests_running, r.requests_waiting) == (14.0, 3.0)  # two TP ranks report the same
    assert r.kv_cache_usage_ratio == pytest.approx(0.41) and r.kv_cache_metric == "sglang:token_usage"
    assert r.prefix_cache_hit_ratio == pytest.approx(0.25)
    assert r.generation_tokens_total == 337125.0
    assert not r.stall_capable  # its token counter moves only when requests finish


async def test_sglang_probe_random_prefix_no_salt(serve, session):
    seen: list = []
    url = await serve({("POST", "/v1/completions"): sse((FIX / "sglang" / "completion_stream.sse").read_bytes(),
                                                        seen=seen)})
    a = SGLANG
    out = await run_probe(session, a, url, "meta-llama/Llama-3.1-8B-Instruct", 2.0)
    out2 = await run_probe(session, a, url, "meta-llama/Llama-3.1-8B-Instruct", 2.0)
    assert out.ok and out2.ok and out.text == " Paris"
    b1, b2 = seen[0][1], seen[1][1]
    assert "cache_salt" not in b1
    assert b1["prompt"] != b2["prompt"] and len(b1["prompt"].split()) >= 8  # random prefix > 1 block
    assert (b1["max_tokens"], b1["temperature"], b1["stream"]) == (1, 0, True)


# ---------------------------------------------------------------------------------------------
# TGI


def test_tgi_metrics_fixture():
    r = TGI.parse_metrics((FIX / "tgi" / "metrics.txt").read_text())
    assert (r.requests_running, r.requests_waiting) == (24.0, 9.0)
    assert r.kv_cache_usage_ratio is None and r.kv_cache_metric == ""  # TGI has no KV metric
    assert r.generation_tokens_total == 402117.0
    assert r.groups[""].progress == 977 + 120341  # successful prefill + decode forwards
    assert r.stall_capable and r.progress_metric == "tgi_batch_inference_success"


async def test_tgi_probe_generate_stream(serve, session):
    seen: list = []
    url = await serve({("POST", "/generate_stream"): sse((FIX / "tgi" / "generate_stream.sse").read_bytes(),
                                                         [0.02], seen)})
    out = await run_probe(session, TGI, url, None, 2.0)
    assert out.ok and out.text == " Paris" and out.ttft_ms >= 15, out
    body = seen[0][1]
    assert body["parameters"] == {"max_new_tokens": 1, "do_sample": False, "details": False}
    assert len(body["inputs"].split()) >= 8 and "model" not in body


async def test_tgi_error_event_cuda_is_engine_fatal(serve, session):
    url = await serve({("POST", "/generate_stream"): sse((FIX / "tgi" / "generate_stream_error.sse").read_bytes())})
    out = await run_probe(session, TGI, url, None, 2.0)
    assert out.failure == probe_pb2.FAILURE_KIND_ENGINE_FATAL and out.http_status == 200


async def test_tgi_special_token_counts(serve, session):
    ev = json.dumps({"index": 1, "token": {"id": 2, "text": "", "logprob": 0.0, "special": True},
                     "generated_text": "", "details": None})
    url = await serve({("POST", "/generate_stream"): sse(f"data:{ev}\n\n".encode())})
    assert (await run_probe(session, TGI, url, None, 2.0)).ok


# ---------------------------------------------------------------------------------------------
# Triton / TensorRT-LLM


def test_triton_metrics_fixture():
    r = TRITON.parse_metrics((FIX / "triton" / "metrics_trtllm.txt").read_text())
    assert (r.requests_running, r.requests_waiting) == (17.0, 5.0)
    assert r.kv_cache_usage_ratio == pytest.approx(0.625)
    assert r.kv_cache_metric == 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}'
    assert r.groups["tensorrt_llm"].progress == 88213 and r.stall_capable


def test_triton_kv_from_used_over_max_and_pending_queue():
    text_ = (
        'nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 6\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 300\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 1200\n'
        'nv_inference_pending_request_count{model="ensemble",version="1"} 2\n'
        'nv_inference_pending_request_count{model="tensorrt_llm",version="1"} 1\n'
    )
    r = TRITON.parse_metrics(text_)
    assert r.requests_running == 6 and r.requests_waiting == 3
    assert r.kv_cache_usage_ratio == pytest.approx(0.25)
    assert not r.stall_capable  # no iteration counter in this page


def test_triton_metrics_url_port_8002():
    a = TRITON
    assert a.metrics_url("http://10.0.0.5:8000") == "http://10.0.0.5:8002/metrics"
    assert a.metrics_url("http://[::1]:8000/") == "http://[::1]:8002/metrics"
    assert a.metrics_url("http://h:8000", "http://h:9000/m") == "http://h:9000/m"
    assert VLLM.metrics_url("http://h:8000/") == "http://h:8000/metrics"


async def test_triton_discovery_and_probe(serve, session):
    seen: list = []
    url = await serve({
        ("POST", "/v2/repository/index"): text((FIX / "triton" / "repository_index.json").read_text(),
                                               ctype="application/json"),
        ("POST", "/v2/models/ensemble/generate_stream"): sse(
            (FIX / "triton" / "generate_stream.sse").read_bytes(), seen=seen),
    })
    a = TRITON
    model = await a.discover_model(session, url, 1.0)
    assert model == "ensemble"
    out = await run_probe(session, a, url, model, 2.0)
    assert out.ok and out.text == " Paris", out
    body = seen[0][1]
    assert (body["max_tokens"], body["top_k"], body["stream"]) == (1, 1, True)


async def test_triton_error_event_is_engine_fatal(serve, session):
    url = await serve({("POST", "/v2/models/ensemble/generate_stream"): sse(
        (FIX / "triton" / "generate_stream_error.sse").read_bytes())})
    out = await run_probe(session, TRITON, url, "ensemble", 2.0)
    assert out.failure == probe_pb2.FAILURE_KIND_ENGINE_FATAL, out


async def test_triton_discovery_without_ready_models_fails(serve, session):
    url = await serve({("POST", "/v2/repository/index"): text('[{"name":"x","state":"UNAVAILABLE"}]')})
    with pytest.raises(EngineRequestError) as ei:
        await TRITON.discover_model(session, url, 1.0)
    assert ei.value.kind == probe_pb2.FAILURE_KIND_BAD_OUTPUT


# ---------------------------------------------------------------------------------------------
# auto-detection


def test_kind_from_metrics_prefixes():
    assert kind_from_metrics((FIX / "tgi" / "metrics.txt").read_text()) == "tgi"
    assert kind_from_metrics((FIX / "triton" / "metrics_trtllm.txt").read_text()) == "triton"
    assert kind_from_metrics((FIX / "sglang" / "metrics.txt").read_text()) == "sglang"
    assert kind_from_metrics("# HELP x\nprocess_cpu_seconds_total 1\n") is None


async def test_detect_each_family(serve, session):
    vllm = await serve({("GET", "/metrics"): text(vllm_body("03a_metrics_before_requests.raw").decode())})
    tgi = await serve({("GET", "/info"): text((FIX / "tgi" / "info.json").read_text(), ctype="application/json")})
    triton = await serve({("GET", "/v2/health/ready"): text("")})
    sglang = await serve({("GET", "/v1/models"): text(
        '{"object":"list","data":[{"id":"m","object":"model","owned_by":"sglang"}]}', ctype="application/json")})
    other = await serve({("GET", "/v1/models"): text('{"data":[{"id":"m","owned_by":"me"}]}')})
    results = [await detect_engine_kind(session, u, 1.0) for u in (vllm, tgi, triton, sglang, other)]
    assert results == ["vllm", "tgi", "triton", "sglang", "openai"]


async def test_detect_refused_raises_connect(session):
    port = free_port()
    with pytest.raises(EngineRequestError) as ei:
        await detect_engine_kind(session, f"http://127.0.0.1:{port}", 1.0)
    assert ei.value.kind == probe_pb2.FAILURE_KIND_CONNECT


async def test_detect_hanging_metrics_falls_through(serve, session):
    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response()

    url = await serve({("GET", "/metrics"): hang, ("GET", "/v1/models"): text(
        '{"data":[{"id":"m","owned_by":"vllm"}]}')})
    t0 = time.monotonic()
    assert await detect_engine_kind(session, url, 0.2) == "vllm"
    assert time.monotonic() - t0 < 1.5


def test_probe_header_has_one_meaning_for_the_probe_and_the_simulated_engine():
    from node_probe import sim
    from node_probe.engines import PROBE_HEADER, PROBE_HEADER_VALUE

    assert (PROBE_HEADER, PROBE_HEADER_VALUE) == ("x-sentinel-probe", "1")
    assert sim.PROBE_HEADER == PROBE_HEADER


def test_finished_requests_counter_sums_every_finish_reason():
    # real vLLM after 9 requests: vllm:request_success_total{finished_reason="length"} 9, the other
    # reasons 0; the agent sends the sum (shedding reads capacity from its rate)
    r = VLLM.parse_metrics(vllm_body("03b_metrics_after_requests.raw").decode())
    assert r.requests_finished_total == 9.0
    assert _load_message(r, "").requests_finished_total == 9.0
    assert VLLM.parse_metrics(vllm_body("13_metrics_during_load.raw").decode()).requests_finished_total == 0.0
    assert TGI.parse_metrics((FIX / "tgi" / "metrics.txt").read_text()).requests_finished_total == 1811.0
    assert not _load_message(TGI.parse_metrics(""), "").HasField("requests_finished_total")  # unknown: unset
