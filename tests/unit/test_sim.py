"""Tests of node_probe.sim: the simulated vLLM-shaped engine with fault injection."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from node_probe.sim import SIM_ENGINE_KEY, SimConfig, build_app
from xds_server.testing import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-model"
REPLICA = "sim-test-1"
CUDA_BODY = {"error": {"message": "CUDA error: an illegal memory access was encountered",
                       "type": "InternalServerError", "param": None, "code": 500}}


@pytest.fixture
async def make_client():
    """Factory for a TestClient talking to a fresh sim app; all are closed at teardown."""
    clients: list[TestClient] = []

    async def _make(**kwargs: Any) -> TestClient:
        kwargs.setdefault("replica_id", REPLICA)
        kwargs.setdefault("token_interval_ms", 5.0)
        client = TestClient(TestServer(build_app(SimConfig(**kwargs))))
        await client.start_server()
        clients.append(client)
        return client

    yield _make
    for client in clients:
        await client.close()


@pytest.fixture
async def client(make_client) -> TestClient:
    return await make_client()


async def read_sse(resp: aiohttp.ClientResponse, t0: float) -> list[tuple[float, Any]]:
    """Read a whole SSE body: (seconds since t0, parsed JSON or the string '[DONE]') per event."""
    events: list[tuple[float, Any]] = []
    buf = b""
    async for data in resp.content.iter_any():
        buf += data
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            assert raw.startswith(b"data: "), raw
            payload = raw[len(b"data: "):].decode()
            events.append((time.monotonic() - t0,
                           payload if payload == "[DONE]" else json.loads(payload)))
    assert buf == b""
    return events


async def read_event(resp: aiohttp.ClientResponse) -> Any:
    """Read one SSE event (``data: ...`` line plus blank line) and parse it."""
    line = await resp.content.readline()
    assert line.startswith(b"data: "), line
    assert await resp.content.readline() == b"\n"
    payload = line[len(b"data: "):].strip().decode()
    return payload if payload == "[DONE]" else json.loads(payload)


async def scrape(client: TestClient) -> dict[str, float]:
    """Scrape /metrics into {'name{label=value,...}': value} for the sample lines."""
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(await resp.text()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


L = f"engine=0,model_name={MODEL}"


def completion_body(max_tokens: int = 3, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello world", "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **extra}


def chat_body(max_tokens: int = 3, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}


async def set_fault(client: TestClient, **body: Any) -> dict[str, Any]:
    resp = await client.post("/sim/fault", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def stats(client: TestClient) -> dict[str, Any]:
    resp = await client.get("/sim/stats")
    assert resp.status == 200
    return await resp.json()


# ------------------------------------------------------------------------ plain endpoints
async def test_health_models_and_served_by(client: TestClient) -> None:
    resp = await client.get("/health")
    assert resp.status == 200
    assert await resp.read() == b""
    assert resp.headers["x-served-by"] == REPLICA

    resp = await client.get("/v1/models")
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["object"] == "model"
    assert body["data"][0]["owned_by"] == "vllm"
    assert resp.headers["x-served-by"] == REPLICA

    for path in ("/metrics", "/sim/fault", "/sim/stats", "/no/such/path"):
        resp = await client.get(path)
        assert resp.headers["x-served-by"] == REPLICA, path
    assert resp.status == 404
    resp = await client.head("/health")  # like vLLM: HEAD /health is 405
    assert resp.status == 405
    assert resp.headers["x-served-by"] == REPLICA


async def test_default_replica_id_names_port() -> None:
    assert SimConfig(port=8123).replica_id == "sim-8123"
    assert SimConfig(port=8123, replica_id="a").replica_id == "a"


# ------------------------------------------------------------------------ inference shapes
async def test_completion_nonstream_shape(client: TestClient) -> None:
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=4))
    assert resp.status == 200
    assert resp.content_type == "application/json"
    assert resp.headers["x-served-by"] == REPLICA
    body = await resp.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert len(body["choices"]) == 1
    choice = body["choices"][0]
    assert choice["index"] == 0
    assert isinstance(choice["text"], str) and choice["text"].strip()
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["prompt_tokens"] == 2
    assert body["usage"]["total_tokens"] == 6


async def test_chat_nonstream_shape(client: TestClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    assert resp.status == 200
    body = await resp.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant"
    assert isinstance(msg["content"], str) and msg["content"].strip()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 2


async def test_completion_stream_shape(client: TestClient) -> None:
    t0 = time.monotonic()
    resp = await client.post("/v1/completions",
                             json=completion_body(max_tokens=5, stream=True, cache_salt="x1"))
    assert resp.status == 200
    assert resp.content_type == "text/event-stream"
    assert resp.headers["x-served-by"] == REPLICA
    events = [e for _, e in await read_sse(resp, t0)]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 5  # no role chunk in completions
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for i, c in enumerate(chunks):
        assert c["object"] == "text_completion"
        assert c["model"] == MODEL
        [choice] = c["choices"]
        assert "delta" not in choice
        assert isinstance(choice["text"], str) and choice["text"]
        assert choice["finish_reason"] == ("length" if i == 4 else None)
    assert "usage" not in chunks[-1]


async def test_chat_stream_shape(client: TestClient) -> None:
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4, stream=True))
    assert resp.status == 200
    assert resp.content_type == "text/event-stream"
    events = [e for _, e in await read_sse(resp, t0)]
    assert events[-1] == "[DONE]"
    role, *tokens = events[:-1]
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["choices"][0]["finish_reason"] is None
    assert len(tokens) == 4
    for i, c in enumerate(tokens):
        assert c["id"] == role["id"]
        [choice] = c["choices"]
        assert list(choice["delta"]) == ["content"]
        assert choice["delta"]["content"]
        assert choice["finish_reason"] == ("length" if i == 3 else None)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", completion_body(max_tokens=3, stream=True)),
    ("/v1/chat/completions", chat_body(max_tokens=3, stream=True)),
])
async def test_stream_include_usage(client: TestClient, path: str, body: dict) -> None:
    body = dict(body, stream_options={"include_usage": True}, cache_salt="s")
    resp = await client.post(path, json=body)
    events = [e for _, e in await read_sse(resp, time.monotonic())]
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 3
    token_chunks = [e for e in events[:-2]
                    if e["choices"][0].get("delta", {}).get("content") or e["choices"][0].get("text")]
    assert len(token_chunks) == 3
    assert len(events) == 3 + 2 + (1 if path.endswith("chat/completions") else 0)


async def test_default_max_tokens(make_client) -> None:
    client = await make_client(default_max_tokens=7)
    resp = await client.post("/v1/completions", json={"prompt": "hi"})
    assert (await resp.json())["usage"]["completion_tokens"] == 7


async def test_stream_pacing(make_client) -> None:
    client = await make_client(token_interval_ms=20.0)
    t0 = time.monotonic()
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=10, stream=True))
    t_headers = time.monotonic() - t0
    events = await read_sse(resp, t0)
    token_times = [t for t, e in events if e != "[DONE]"]
    assert len(token_times) == 10
    assert t_headers < 0.1  # headers go out at once
    assert token_times[-1] >= 0.18  # 10 tokens x 20 ms
    assert token_times[0] >= 0.015  # first token after one interval
    assert token_times[-1] - token_times[0] >= 0.15  # streamed, not sent in one burst
    assert token_times[-1] < 2.0


# ------------------------------------------------------------------------ metrics
async def test_metrics_names_labels_and_values(client: TestClient) -> None:
    m = await scrape(client)
    assert m[f"vllm:num_requests_running{{{L}}}"] == 0
    assert m[f"vllm:num_requests_waiting{{{L}}}"] == 0
    assert m[f"vllm:kv_cache_usage_perc{{{L}}}"] == pytest.approx(0.1)
    assert m[f"vllm:generation_tokens_total{{{L}}}"] == 0
    assert m[f"vllm:prompt_tokens_total{{{L}}}"] == 0

    for _ in range(2):
        resp = await client.post("/v1/completions", json=completion_body(max_tokens=3))
        assert resp.status == 200
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=4, stream=True))
    await read_sse(resp, time.monotonic())

    m = await scrape(client)
    assert m[f"vllm:generation_tokens_total{{{L}}}"] == 10
    assert m[f"vllm:prompt_tokens_total{{{L}}}"] == 6  # 3 x "hello world"
    assert m[f"vllm:request_success_total{{engine=0,finished_reason=length,model_name={MODEL}}}"] == 3
    assert m[f"vllm:request_success_total{{engine=0,finished_reason=abort,model_name={MODEL}}}"] == 0
    assert m[f"vllm:num_requests_running{{{L}}}"] == 0


async def test_metrics_running_and_queue_fault(client: TestClient) -> None:
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=200, stream=True))
    await read_event(resp)
    m = await scrape(client)
    assert m[f"vllm:num_requests_running{{{L}}}"] == 1
    resp.close()

    state = await set_fault(client, mode="queue", waiting=150)
    assert state["mode"] == "queue" and state["waiting"] == 150
    m = await scrape(client)
    assert m[f"vllm:num_requests_waiting{{{L}}}"] == 150
    # inference still works under queue
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=2))
    assert resp.status == 200
    assert (await resp.json())["usage"]["completion_tokens"] == 2

    await set_fault(client, mode="none")
    m = await scrape(client)
    assert m[f"vllm:num_requests_waiting{{{L}}}"] == 0


async def test_hang_under_load_shows_running_with_frozen_counter(client: TestClient) -> None:
    """What stall detection reads: under load, a hang keeps the stuck requests counted as
    running while the generation-token counter stops (and /health stays 200)."""
    streams = [await client.post("/v1/completions", json=completion_body(max_tokens=500, stream=True))
               for _ in range(3)]
    for resp in streams:
        await read_event(resp)
    await asyncio.sleep(0.1)
    before = await scrape(client)
    await asyncio.sleep(0.1)
    moving = await scrape(client)
    gen = f"vllm:generation_tokens_total{{{L}}}"
    run = f"vllm:num_requests_running{{{L}}}"
    assert moving[run] == 3 and moving[gen] > before[gen]  # busy and progressing
    await set_fault(client, mode="hang")
    await asyncio.sleep(0.05)
    frozen = await scrape(client)
    await asyncio.sleep(0.3)
    later = await scrape(client)
    assert later[run] == 3 and later[gen] == frozen[gen]
    assert (await client.get("/health")).status == 200
    await set_fault(client, mode="none")
    await asyncio.sleep(0.1)
    assert (await scrape(client))[gen] > later[gen]
    for resp in streams:
        resp.close()


async def test_prefill_600ms_kv_rises_counters_frozen_and_a_queued_probe_answers_after_it(client: TestClient) -> None:
    """The long-prefill mode (issue 11, measured on vLLM 0.32: 5.5 s, KV 0.008 -> 0.086): KV usage
    rises at every scrape, prompt and generation counters stay frozen, 1 running; a request sent
    meanwhile waits and gets its first token only when the prefill ends; then the prompt counter
    jumps by the prompt's 3,000 tokens and the mode is back to none."""
    kv, gen, prompt = (f"vllm:{n}{{{L}}}" for n in ("kv_cache_usage_perc", "generation_tokens_total",
                                                     "prompt_tokens_total"))
    before = await scrape(client)
    state = await set_fault(client, mode="prefill", prefill_ms=600)
    assert state["mode"] == "prefill" and state["prefill_ms"] == 600.0
    t0 = asyncio.get_running_loop().time()
    probe = asyncio.ensure_future(client.post("/v1/completions", json=completion_body(max_tokens=1, stream=True)))
    samples = []
    for _ in range(4):
        await asyncio.sleep(0.1)
        samples.append(await scrape(client))
    assert all(b[kv] > a[kv] for a, b in zip(samples, samples[1:]))
    assert all(m[gen] == before[gen] and m[prompt] == before[prompt] for m in samples)
    assert samples[-1][f"vllm:num_requests_running{{{L}}}"] == 1
    assert samples[-1][f"vllm:num_requests_waiting{{{L}}}"] == 1
    assert 0.1 < samples[-1][kv] < 0.1 + 0.078
    resp = await probe
    await read_event(resp)
    assert asyncio.get_running_loop().time() - t0 >= 0.55  # the token came after the prefill
    resp.close()
    after = await scrape(client)
    assert after[prompt] >= before[prompt] + 3000 and after[kv] == 0.1
    assert (await (await client.get("/sim/fault")).json())["mode"] == "none"


# ------------------------------------------------------------------------ faults
async def test_fault_get_and_set(client: TestClient) -> None:
    resp = await client.get("/sim/fault")
    assert (await resp.json())["mode"] == "none"
    state = await set_fault(client, mode="slow", ttft_ms=300)
    assert state == {"mode": "slow", "ttft_ms": 300.0, "waiting": 0, "replica_id": REPLICA}
    resp = await client.get("/sim/fault")
    assert await resp.json() == state
    state = await set_fault(client, mode="none")
    assert state["mode"] == "none" and state["ttft_ms"] == 0


@pytest.mark.parametrize("body", [
    {"mode": "explode"},
    {"mode": 3},
    {},
    {"mode": "slow", "ttft_ms": -5},
    {"mode": "slow", "ttft_ms": "fast"},
    {"mode": "queue", "waiting": -1},
    {"mode": "queue", "waiting": 2.5},
    {"mode": "queue", "waiting": True},
    {"mode": "none", "typo": 1},
    {"mode": "prefill", "prefill_ms": 0},
    {"mode": "prefill", "prefill_ms": "long"},
    [1, 2],
])
async def test_bad_fault_input_is_400(client: TestClient, body: Any) -> None:
    await set_fault(client, mode="queue", waiting=7)
    resp = await client.post("/sim/fault", json=body)
    assert resp.status == 400
    assert resp.headers["x-served-by"] == REPLICA
    assert (await resp.json())["error"]["code"] == 400
    resp = await client.post("/sim/fault", data=b"{not json")
    assert resp.status == 400
    state = await (await client.get("/sim/fault")).json()
    assert state["mode"] == "queue" and state["waiting"] == 7  # unchanged


async def test_hang_stream_headers_then_nothing_then_resume(client: TestClient) -> None:
    # A stream already running when the engine freezes.
    running = await client.post("/v1/completions",
                                json=completion_body(max_tokens=30, stream=True))
    await read_event(running)
    await read_event(running)
    await set_fault(client, mode="hang")
    gen_before = (await scrape(client))[f"vllm:generation_tokens_total{{{L}}}"]

    # A new stream gets 200 SSE headers at once, then no chunk.
    t0 = time.monotonic()
    stuck = await asyncio.wait_for(
        client.post("/v1/chat/completions", json=chat_body(max_tokens=3, stream=True)), 1.0)
    assert time.monotonic() - t0 < 0.3
    assert stuck.status == 200
    assert stuck.content_type == "text/event-stream"
    assert stuck.headers["x-served-by"] == REPLICA
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(stuck.content.readline(), 0.3)
    # The running stream stopped too (it may have had at most one token on the wire).
    got_running: list[Any] = []
    with pytest.raises(asyncio.TimeoutError):
        while True:
            got_running.append(await asyncio.wait_for(read_event(running), 0.1))
    assert len(got_running) <= 1

    # /health and /metrics stay up; the token counter is frozen; both requests count as running.
    assert (await client.get("/health")).status == 200
    m = await scrape(client)
    assert m[f"vllm:generation_tokens_total{{{L}}}"] == gen_before
    assert m[f"vllm:num_requests_running{{{L}}}"] == 2
    assert (await stats(client))["in_flight"] == 2

    await set_fault(client, mode="none")
    events = [e for _, e in await asyncio.wait_for(read_sse(stuck, time.monotonic()), 2.0)]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(events) == 1 + 3 + 1 and events[-1] == "[DONE]"
    rest = [e for _, e in await asyncio.wait_for(read_sse(running, time.monotonic()), 2.0)]
    assert rest[-1] == "[DONE]"
    assert 2 + len(got_running) + len(rest) - 1 == 30
    m = await scrape(client)
    assert m[f"vllm:generation_tokens_total{{{L}}}"] == 33
    assert (await stats(client))["in_flight"] == 0


async def test_hang_nonstream_sends_nothing_then_resumes(client: TestClient) -> None:
    await set_fault(client, mode="hang")
    task = asyncio.create_task(client.post("/v1/completions", json=completion_body(max_tokens=2)))
    done, _ = await asyncio.wait({task}, timeout=0.3)
    assert not done  # no status line, no headers
    resp = await client.get("/health")
    assert resp.status == 200
    await set_fault(client, mode="none")
    resp = await asyncio.wait_for(task, 2.0)
    assert resp.status == 200
    assert (await resp.json())["usage"]["completion_tokens"] == 2


async def test_hang_validation_errors_still_answered(client: TestClient) -> None:
    await set_fault(client, mode="hang")
    resp = await asyncio.wait_for(client.post("/v1/completions", json={"max_tokens": 1}), 1.0)
    assert resp.status == 400


async def test_slow_ttft(client: TestClient) -> None:
    await set_fault(client, mode="slow", ttft_ms=250)
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2, stream=True))
    assert time.monotonic() - t0 < 0.2  # headers still at once
    events = await read_sse(resp, t0)
    first_content = next(t for t, e in events
                         if e != "[DONE]" and e["choices"][0]["delta"].get("content"))
    assert first_content >= 0.25
    assert events[-1][1] == "[DONE]"
    assert len(events) == 1 + 2 + 1

    t0 = time.monotonic()
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=1))
    assert resp.status == 200
    assert time.monotonic() - t0 >= 0.25

    await set_fault(client, mode="none")
    t0 = time.monotonic()
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=1))
    assert time.monotonic() - t0 < 0.2


@pytest.mark.parametrize("stream", [False, True])
async def test_error_fault_is_500_with_cuda_text(client: TestClient, stream: bool) -> None:
    await set_fault(client, mode="error")
    resp = await client.post("/v1/completions", json=completion_body(stream=stream))
    assert resp.status == 500
    assert resp.content_type == "application/json"
    assert resp.headers["x-served-by"] == REPLICA
    assert await resp.json() == CUDA_BODY
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=stream))
    assert resp.status == 500
    assert "illegal memory access" in (await resp.json())["error"]["message"]
    assert (await client.get("/health")).status == 200
    await set_fault(client, mode="none")
    resp = await client.post("/v1/completions", json=completion_body(stream=stream))
    assert resp.status == 200


# ------------------------------------------------------------------------ stats, disconnects
async def test_stats_probe_vs_user(client: TestClient) -> None:
    for _ in range(3):
        resp = await client.post("/v1/completions", json=completion_body(max_tokens=1, stream=True),
                                 headers={"x-sentinel-probe": "cp-1"})
        await read_sse(resp, time.monotonic())
    for _ in range(2):
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
        assert resp.status == 200
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=1),
                             headers={"x-sentinel-probe": ""})  # empty value: not a probe
    assert resp.status == 200
    s = await stats(client)
    assert s["replica_id"] == REPLICA
    assert s["requests_total"] == 6
    assert s["requests_by_kind"] == {"probe": 3, "user": 3}
    assert s["in_flight"] == 0
    assert s["responses_by_status"] == {"200": 6}


async def test_client_disconnect_mid_stream_does_not_leak(client: TestClient) -> None:
    engine = client.server.app[SIM_ENGINE_KEY]
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=500, stream=True))
    await read_event(resp)
    assert engine.in_flight == 1
    resp.close()  # drop the connection mid-stream
    for _ in range(100):
        if engine.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.in_flight == 0
    m = await scrape(client)
    assert m[f"vllm:request_success_total{{engine=0,finished_reason=abort,model_name={MODEL}}}"] == 1
    assert m[f"vllm:generation_tokens_total{{{L}}}"] < 500


async def test_client_disconnect_while_hung_does_not_leak(client: TestClient) -> None:
    engine = client.server.app[SIM_ENGINE_KEY]
    await set_fault(client, mode="hang")
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=5, stream=True))
    task = asyncio.create_task(client.post("/v1/completions", json=completion_body(max_tokens=5)))
    await asyncio.sleep(0.05)
    assert engine.in_flight == 2
    resp.close()
    task.cancel()
    for _ in range(100):
        if engine.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.in_flight == 0
    assert (await client.get("/health")).status == 200


# ------------------------------------------------------------------------ bad requests
@pytest.mark.parametrize("path,data,status,param", [
    ("/v1/completions", b'{"model": "x", "prompt": ', 400, "body.25"),
    ("/v1/completions", b"", 400, "body"),
    ("/v1/completions", json.dumps({"model": MODEL, "max_tokens": 1}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": "abc"}).encode(), 400,
     "body.max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 100000}).encode(), 400,
     "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400,
     "temperature"),
    ("/v1/completions", json.dumps({"prompt": "hi", "cache_salt": ""}).encode(), 400,
     "cache_salt"),
    ("/v1/completions", json.dumps({"prompt": "hi", "cache_salt": 123}).encode(), 400,
     "cache_salt"),
    ("/v1/completions", json.dumps({"model": "nope", "prompt": "hi"}).encode(), 404, "model"),
    ("/v1/chat/completions", json.dumps({"model": MODEL}).encode(), 400, "body.messages"),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, "messages"),
    ("/v1/chat/completions", b"[1, 2]", 400, "body"),
])
async def test_bad_requests(client: TestClient, path: str, data: bytes, status: int,
                            param: str) -> None:
    payloads = [data]
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):  # the same error must come before any streaming starts
        payloads.append(json.dumps(dict(parsed, stream=True)).encode())
    for payload in payloads:
        resp = await client.post(path, data=payload, headers={"Content-Type": "application/json"})
        assert resp.status == status
        assert resp.content_type == "application/json"  # an error, not an event stream
        assert resp.headers["x-served-by"] == REPLICA
        err = (await resp.json())["error"]
        assert err["code"] == status
        assert err["param"] == param
        assert err["message"]
    assert (await stats(client))["in_flight"] == 0


async def test_unknown_fields_accepted(client: TestClient) -> None:
    resp = await client.post("/v1/completions", json=completion_body(
        max_tokens=1, stream=True, cache_salt="abc123", stream_options={"include_usage": False},
        ignore_eos=True, top_p=0.9, some_future_field={"x": 1}))
    assert resp.status == 200
    events = [e for _, e in await read_sse(resp, time.monotonic())]
    assert len(events) == 2 and events[-1] == "[DONE]"


# ------------------------------------------------------------------------ real process

async def test_cli_subprocess_serves_and_exits_cleanly_on_sigterm() -> None:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "node_probe.sim", "--port", str(port), "--token-interval-ms", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT, env=env)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 10.0)
        assert line.decode().strip() == \
            f"sim-engine sim-{port} listening on http://127.0.0.1:{port}"
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{base}/v1/completions",
                                    json={"prompt": "hi", "max_tokens": 3}) as resp:
                assert resp.status == 200
                assert resp.headers["x-served-by"] == f"sim-{port}"
                assert (await resp.json())["usage"]["completion_tokens"] == 3
            # Leave a request stuck in a hang: shutdown must still be prompt and clean.
            async with session.post(f"{base}/sim/fault", json={"mode": "hang"}) as resp:
                assert resp.status == 200
            stuck = await session.post(f"{base}/v1/completions",
                                       json={"prompt": "hi", "max_tokens": 3, "stream": True})
            assert stuck.status == 200
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(asyncio.to_thread(proc.wait), 8.0)
            assert rc == 0
            assert time.monotonic() - t0 < 5.0
            stuck.close()
        err = proc.stderr.read().decode()
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
