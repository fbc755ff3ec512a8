"""Tests of node_probe.sim: the simulated vLLM-shaped engine with fault injection."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from itertools import pairwise
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


async def test_a_long_prefill_raises_kv_freezes_counters_and_a_queued_probe_answers_later(client: TestClient) -> None:
    """The long-prefill mode (measured on vLLM 0.32: 5.5 s, KV 0.008 -> 0.086): KV usage
    rises at every scrape, prompt and generation counters stay frozen, 1 running; a request sent
    meanwhile waits and gets its first token only when the prefill ends; then the prompt counter
    jumps by the prompt's 3,000 tokens and the mode is back to none. The prefill here lasts 1.5 s:
    four scrapes 0.1 s apart must fall inside it also on a loaded machine (two test workers on two
    cores took one past a 600 ms one)."""
    kv, gen, prompt = (f"vllm:{n}{{{L}}}" for n in ("kv_cache_usage_perc", "generation_tokens_total",
                                                     "prompt_tokens_total"))
    before = await scrape(client)
    state = await set_fault(client, mode="prefill", prefill_ms=1500)
    assert state["mode"] == "prefill" and state["prefill_ms"] == 1500.0
    t0 = asyncio.get_running_loop().time()
    probe = asyncio.ensure_future(client.post("/v1/completions", json=completion_body(max_tokens=1, stream=True)))
    samples = []
    for _ in range(4):
        await asyncio.sleep(0.1)
        samples.append(await scrape(client))
    assert all(b[kv] > a[kv] for a, b in pairwise(samples))
    assert all(m[gen] == before[gen] and m[prompt] == before[prompt] for m in samples)
    assert samples[-1][f"vllm:num_requests_running{{{L}}}"] == 1
    assert samples[-1][f"vllm:num_requests_waiting{{{L}}}"] == 1
    assert 0.1 < samples[-1][kv] < 0.1 + 0.078
    resp = await probe
    await read_event(resp)
    assert asyncio.get_running_loop().time() - t0 >= 1.45  # the token came after the prefill
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
    # The running stream stopped too: what still arrives are tokens generated before the freeze
    # (one every 20 ms while the fault was set: two on a starved CI host), then nothing.
    got_running: list[Any] = []
    with pytest.raises(asyncio.TimeoutError):
        while True:
            got_running.append(await asyncio.wait_for(read_event(running), 0.1))
    assert 2 + len(got_running) <= gen_before < 30, (len(got_running), gen_before)

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


# ------------------------------------------------------------------------ deterministic model
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402 - this section's imports
from hypothesis import strategies as st  # noqa: E402 - this section's imports

from node_probe.sim import model as sim_model  # noqa: E402 - this section's imports

WORD_IDS = st.integers(sim_model.FIRST_WORD_ID, sim_model.FIRST_HASHED_ID - 1)


@given(st.lists(WORD_IDS, max_size=40))
def test_generated_text_tokenizes_back_to_its_ids(ids: list[int]) -> None:
    assert sim_model.tokenize(sim_model.detokenize(ids)) == ids


@given(st.text(max_size=60), st.text(max_size=60))
def test_tokenizer_is_stable_and_ids_in_vocab(a: str, b: str) -> None:
    ids = sim_model.tokenize(a)
    assert ids == sim_model.tokenize(a)
    assert all(0 <= t < sim_model.VOCAB_SIZE for t in ids)
    assert "".join(sim_model.PIECE_RE.findall(a)) == a  # pieces cover the whole text


def test_next_token_is_a_function_of_the_whole_context() -> None:
    base = sim_model.tokenize("the same prompt")

    def gen(ids: list[int]) -> list[int]:
        d = sim_model.Decoder(ids, 30)
        while not d.finished:
            d.step()
        return d.ids

    assert gen(base) == gen(list(base))  # deterministic
    # Changing the first token (far from the end) changes the generation.
    assert gen([base[0] + 1, *base[1:]]) != gen(base)
    assert len(set(gen(base))) > 5  # not a constant or short cycle


def _drive(d: sim_model.Decoder) -> sim_model.Decoder:
    while not d.finished:
        d.step()
    return d


@given(prompt=st.lists(st.integers(0, sim_model.VOCAB_SIZE - 1), min_size=1, max_size=20),
       max_tokens=st.integers(1, 40), cut=st.integers(0, 40), min_tokens=st.integers(0, 10),
       eos=st.sampled_from([0.0, 0.08]),
       stop=st.sampled_from([(), (" fox",), (".", " the lazy")]))
def test_decoder_continuation_from_ids_is_exact(prompt, max_tokens, cut, min_tokens, eos,
                                                stop) -> None:
    """A client saw ``cut`` steps (the text released so far, which lags the ids when stop
    strings hold text back). Continuing from the ids whose text was fully seen, with max_tokens
    and min_tokens rebased, gives the rest exactly; the first continued token's text starts
    with the seen remainder (the relay drops it), and stop strings spanning the cut are found."""
    min_tokens = min(min_tokens, max_tokens)
    full = sim_model.Decoder(prompt, max_tokens, min_tokens, stop, eos_rate=eos)
    released = []
    while not full.finished:
        full.step()
        released.append(full.sent)
    j = min(cut, len(full.ids) - 1)
    seen = full.text[:released[j - 1]] if j else ""
    k = max(i for i in range(j + 1) if len(sim_model.detokenize(full.ids[:i])) <= len(seen))
    rest = _drive(sim_model.Decoder(prompt + full.ids[:k], max_tokens - k,
                                    max(0, min_tokens - k), stop, eos_rate=eos))
    assert full.ids[:k] + rest.ids == full.ids
    assert rest.finish_reason == full.finish_reason and rest.stop_reason == full.stop_reason
    partial = seen[len(sim_model.detokenize(full.ids[:k])):]
    assert rest.text.startswith(partial)
    assert seen + rest.text[len(partial):] == full.text


# ------------------------------------------------------------------------ continuation over HTTP
async def generate(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Run one request (streaming or not) and gather ids, text, finish reasons and prompt ids."""
    body = dict(body, return_token_ids=True)
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    chat = path.endswith("chat/completions")
    if not body.get("stream"):
        data = await resp.json()
        [choice] = data["choices"]
        return {"ids": choice["token_ids"],
                "text": choice["message"]["content"] if chat else choice["text"],
                "finish": [choice["finish_reason"]], "stop_reason": choice["stop_reason"],
                "prompt_ids": data["prompt_token_ids"] if chat else choice["prompt_token_ids"],
                "usage": data["usage"]}
    out: dict[str, Any] = {"ids": [], "text": "", "finish": [], "prompt_ids": None,
                           "usage": None, "done": 0}
    for _, ev in await read_sse(resp, time.monotonic()):
        if ev == "[DONE]":
            out["done"] += 1
            continue
        if ev.get("usage"):
            out["usage"] = ev["usage"]
        if chat and ev.get("prompt_token_ids") is not None:
            out["prompt_ids"] = ev["prompt_token_ids"]
        for c in ev["choices"]:
            if "role" in c.get("delta", {}):
                assert "token_ids" not in c
                continue
            out["ids"] += c["token_ids"]
            out["text"] += c["delta"]["content"] if chat else c["text"]
            if not chat and c["prompt_token_ids"] is not None:
                assert out["prompt_ids"] is None  # only in the first chunk
                out["prompt_ids"] = c["prompt_token_ids"]
            if c["finish_reason"] is not None:
                out["finish"].append(c["finish_reason"])
                out["stop_reason"] = c["stop_reason"]
    assert out["done"] == 1
    return out


def _run_http(check) -> None:
    """Run ``check(client)`` against a fresh sim app (sync wrapper for hypothesis)."""
    async def main() -> None:
        client = TestClient(TestServer(build_app(SimConfig(token_interval_ms=0, eos_rate=0.03))))
        await client.start_server()
        try:
            await check(client)
        finally:
            await client.close()
    asyncio.run(main())


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=st.text(min_size=1, max_size=40).filter(str.strip), max_tokens=st.integers(2, 30),
       cut=st.integers(0, 30), stream=st.booleans(), resume_stream=st.booleans(),
       min_tokens=st.integers(0, 5))
def test_completion_continuation_from_ids_is_exact(prompt, max_tokens, cut, stream,
                                                   resume_stream, min_tokens) -> None:
    """The relay's promise: prompt ids + first k generated ids, max_tokens - k, min_tokens
    rebased, gives exactly the rest of the uninterrupted generation, ids and text."""
    min_tokens = min(min_tokens, max_tokens)

    async def check(client: TestClient) -> None:
        full = await generate(client, "/v1/completions", {
            "prompt": prompt, "max_tokens": max_tokens, "min_tokens": min_tokens,
            "stream": stream, "stream_options": {"include_usage": True}})
        assert full["prompt_ids"] == sim_model.tokenize(prompt)
        assert full["finish"] in (["length"], ["stop"])
        assert full["usage"]["completion_tokens"] == len(full["ids"])
        assert full["usage"]["prompt_tokens"] == len(full["prompt_ids"])
        assert sim_model.detokenize(full["ids"]) == full["text"]
        k = min(cut, len(full["ids"]) - 1)
        rest = await generate(client, "/v1/completions", {
            "prompt": full["prompt_ids"] + full["ids"][:k], "max_tokens": max_tokens - k,
            "min_tokens": max(0, min_tokens - k), "stream": resume_stream})
        assert full["ids"][:k] + rest["ids"] == full["ids"]
        assert sim_model.detokenize(full["ids"][:k]) + rest["text"] == full["text"]
        assert rest["finish"] == full["finish"]
    _run_http(check)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(user=st.text(max_size=40), max_tokens=st.integers(2, 30), cut=st.integers(0, 30),
       chars=st.integers(1, 3), stream=st.booleans(), resume_stream=st.booleans())
def test_chat_continuation_from_text_is_exact_at_token_boundaries_only(user, max_tokens, cut, chars, stream,
                                                                       resume_stream) -> None:
    """Chat: the assistant text seen so far, cut at a token boundary, as a final assistant
    message with continue_final_message gives exactly the rest, ids and text. Cut inside a
    token it does not (no "healing": like a byte-level BPE, the partial piece re-tokenizes into
    another id and the model continues another context; the relay continues from ids)."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": user}]

    async def check(client: TestClient) -> None:
        full = await generate(client, "/v1/chat/completions", {
            "messages": messages, "max_tokens": max_tokens, "stream": stream})
        k = min(cut, len(full["ids"]) - 1)
        seen = sim_model.detokenize(full["ids"][:k])
        nxt = sim_model.token_text(full["ids"][k])
        part = nxt[:min(chars, max(0, len(nxt) - 1))]  # text can end inside a token
        # A cut that leaves a whole other word (" a" of " and") is ambiguous for any tokenizer:
        # the text cannot say the token was cut. The promise holds for every unambiguous cut.
        assume(sim_model.tokenize(part) == [] or part not in sim_model.WORDS)
        rest = await generate(client, "/v1/chat/completions", {
            "messages": [*messages, {"role": "assistant", "content": seen}],
            "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": max_tokens - k, "stream": resume_stream})
        assert full["ids"][:k] + rest["ids"] == full["ids"]
        assert seen + rest["text"] == full["text"]
        assert rest["finish"] == full["finish"]
        if part.strip():  # inside a token: the partial piece is a prompt id of its own
            ids, heal = sim_model.chat_prompt_ids([("assistant", seen + part)], add_generation_prompt=False,
                                                  continue_final_message=True)
            assert heal == "" and ids[-1] == sim_model.tokenize(part)[-1]
            assert ids[-1] >= sim_model.FIRST_HASHED_ID
    _run_http(check)


# ------------------------------------------------------------------------ request fields
async def test_return_token_ids_where_vllm_puts_them(client: TestClient) -> None:
    ids = sim_model.tokenize("hello world")
    resp = await client.post("/v1/completions", json=completion_body(return_token_ids=True))
    choice = (await resp.json())["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 3
    resp = await client.post("/v1/chat/completions", json=chat_body(return_token_ids=True))
    body = await resp.json()
    assert body["prompt_token_ids"] == [sim_model.BOS_ID, sim_model.ROLE_IDS["user"],
                                        *sim_model.tokenize("hello"), sim_model.END_ID,
                                        sim_model.ROLE_IDS["assistant"]]
    assert "prompt_token_ids" not in body["choices"][0]
    assert len(body["choices"][0]["token_ids"]) == 3
    # Streaming completions: prompt ids in the first chunk's choice only; ids per chunk.
    resp = await client.post("/v1/completions",
                             json=completion_body(stream=True, return_token_ids=True))
    chunks = [e for _, e in await read_sse(resp, time.monotonic())][:-1]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    assert [c["choices"][0]["prompt_token_ids"] for c in chunks[1:]] == [None, None]
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in chunks)
    # Streaming chat: prompt ids top-level on the role chunk; ids per content chunk.
    resp = await client.post("/v1/chat/completions",
                             json=chat_body(stream=True, return_token_ids=True))
    role, *chunks = [e for _, e in await read_sse(resp, time.monotonic())][:-1]
    assert role["prompt_token_ids"][0] == sim_model.BOS_ID
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in chunks)
    # Without the flag: the fields are null, as in the captures.
    resp = await client.post("/v1/completions", json=completion_body())
    choice = (await resp.json())["choices"][0]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None


async def test_token_id_prompts_batches_and_vocab_check(client: TestClient) -> None:
    ids = sim_model.tokenize("hello world")
    by_text = await generate(client, "/v1/completions", {"prompt": "hello world",
                                                         "max_tokens": 5})
    by_ids = await generate(client, "/v1/completions", {"prompt": ids, "max_tokens": 5})
    assert by_ids["ids"] == by_text["ids"] and by_ids["text"] == by_text["text"]
    resp = await client.post("/v1/completions", json={"prompt": ["a b", ids], "max_tokens": 2,
                                                      "n": 2})
    body = await resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][2]["text"] == body["choices"][3]["text"] == by_text["text"][
        :len(sim_model.detokenize(by_text["ids"][:2]))]
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] == 2 + 2  # each prompt once, not per choice
    for bad in ([1, sim_model.VOCAB_SIZE], [-1], [1, True]):
        resp = await client.post("/v1/completions", json={"prompt": bad})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"


async def test_n_choices_stream_each_finish_once(client: TestClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=3, n=2,
                                                                    stream=True))
    events = [e for _, e in await read_sse(resp, time.monotonic())]
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for ev in events[:-1]:
        for c in ev["choices"]:
            texts[c["index"]] += c["delta"].get("content", "")
            if c["finish_reason"]:
                finishes[c["index"]].append(c["finish_reason"])
    assert texts[0] == texts[1] and texts[0]
    assert finishes == {0: ["length"], 1: ["length"]}


async def test_stop_strings_cut_text_and_hold_it_back(client: TestClient) -> None:
    full = await generate(client, "/v1/completions", {"prompt": "x", "max_tokens": 40})
    words = [sim_model.token_text(t) for t in full["ids"]]
    j = 6
    stop = words[j] + words[j + 1]  # spans two tokens, found when token j+1 arrives
    first = full["text"].find(stop)
    for stream in (False, True):
        got = await generate(client, "/v1/completions", {
            "prompt": "x", "max_tokens": 40, "stop": [stop], "stream": stream})
        assert got["finish"] == ["stop"] and got["stop_reason"] == stop
        assert got["text"] == full["text"][:first]
        assert got["ids"] == full["ids"][:len(got["ids"])]
        assert len(got["ids"]) <= j + 2
    got = await generate(client, "/v1/completions", {
        "prompt": "x", "max_tokens": 40, "stop": stop, "include_stop_str_in_output": True})
    assert got["text"] == full["text"][:first + len(stop)]
    # Streaming: ids run ahead of the text by up to len(stop) - 1 characters.
    resp = await client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 40, "stop": ["zzzzzzzzzzzz"], "stream": True,
        "return_token_ids": True})
    seen_ids, seen_text, lags = [], "", []
    for _, ev in await read_sse(resp, time.monotonic()):
        if ev == "[DONE]":
            break
        c = ev["choices"][0]
        seen_ids += c["token_ids"]
        seen_text += c["text"]
        lags.append(len(sim_model.detokenize(seen_ids)) - len(seen_text))
    assert max(lags[:-1]) == 11 and lags[-1] == 0  # held back, then flushed at the finish
    assert seen_text == full["text"]


async def test_eos_min_tokens_and_ignore_eos(make_client) -> None:
    client = await make_client(token_interval_ms=0, eos_rate=0.25)
    prompts = [f"p{i}" for i in range(12)]
    stopped = []
    for p in prompts:
        got = await generate(client, "/v1/completions", {"prompt": p, "max_tokens": 30})
        if got["finish"] == ["stop"]:
            assert got["ids"][-1] == sim_model.EOS_ID and got["stop_reason"] is None
            assert got["text"] == sim_model.detokenize(got["ids"])  # EOS has no text
            stopped.append((p, len(got["ids"])))
    assert stopped  # with eos_rate 0.25 some generations end on their own
    for p, n in stopped:
        got = await generate(client, "/v1/completions",
                             {"prompt": p, "max_tokens": 30, "ignore_eos": True})
        assert got["finish"] == ["length"] and len(got["ids"]) == 30
        assert sim_model.EOS_ID not in got["ids"]
        got = await generate(client, "/v1/completions",
                             {"prompt": p, "max_tokens": 30, "min_tokens": n})
        assert len(got["ids"]) > n or got["finish"] == ["length"]
        assert sim_model.EOS_ID not in got["ids"][:n]


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
      "continue_final_message": True}, "continue_final_message"),  # add_generation_prompt
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
      "add_generation_prompt": False}, "continue_final_message"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 9, "max_tokens": 3},
     "min_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": "yes"}, "body.ignore_eos"),
])
async def test_bad_chat_fields(client: TestClient, body: dict, param: str) -> None:
    for stream in (False, True):
        resp = await client.post("/v1/chat/completions", json=dict(body, stream=stream))
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == param


async def test_prompt_too_long_like_vllm(make_client) -> None:
    client = await make_client(max_model_len=8)
    resp = await client.post("/v1/completions", json={"prompt": list(range(8, 16)),
                                                      "max_tokens": 1})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "input_tokens"


# ------------------------------------------------------------------------ mid-stream faults
async def read_raw_sse(resp: aiohttp.ClientResponse, timeout_s: float = 2.0) -> tuple[list[Any], str]:
    """Read SSE events until EOF, a cut, or ``timeout_s`` of silence.

    Returns (events, how): how is "eof", "cut" (connection error / incomplete body) or "silent".
    """
    events: list[Any] = []
    buf = b""
    while True:
        try:
            data = await asyncio.wait_for(resp.content.readany(), timeout_s)
        except TimeoutError:
            return events, "silent"
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, ConnectionError):
            return events, "cut"
        if not data:
            return events, "eof"
        buf += data
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            payload = raw[len(b"data: "):].decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))


def token_events(events: list[Any]) -> list[dict]:
    return [e for e in events if e != "[DONE]" and "choices" in e and e["choices"]
            and "role" not in e["choices"][0].get("delta", {})]


@pytest.mark.parametrize("mode,how", [("reset_after", "cut"), ("fail_after", "cut")])
async def test_cut_mid_stream_after_n_tokens(make_client, mode: str, how: str) -> None:
    client = await make_client(token_interval_ms=1)
    assert (await set_fault(client, mode=mode, after_tokens=4)) == {
        "mode": mode, "ttft_ms": 0.0, "waiting": 0, "times": 1, "after_tokens": 4,
        "replica_id": REPLICA}
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=20, stream=True))
    assert resp.status == 200
    events, got_how = await read_raw_sse(resp)
    assert got_how == how
    assert len(token_events(events)) == 4 and "[DONE]" not in events
    assert all(e["choices"][0]["finish_reason"] is None for e in token_events(events))
    # times=1: the fault was spent; the next request is whole and the mode reads none.
    assert (await (await client.get("/sim/fault")).json())["mode"] == "none"
    events = [e for _, e in await read_sse(
        await client.post("/v1/completions", json=completion_body(max_tokens=5, stream=True)),
        time.monotonic())]
    assert events[-1] == "[DONE]" and len(events) == 6


async def test_fail_after_nonstream_is_engine_dead_500(client: TestClient) -> None:
    await set_fault(client, mode="fail_after", after_tokens=2)
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=5))
    assert resp.status == 500
    assert (await resp.json())["error"]["message"].startswith("EngineCore encountered an issue")


async def test_error_after_is_vllm_in_band_error(client: TestClient) -> None:
    await set_fault(client, mode="error_after", after_tokens=3, times=0)
    for path, body in (("/v1/completions", completion_body(max_tokens=9, stream=True)),
                       ("/v1/chat/completions", chat_body(max_tokens=9, stream=True))):
        resp = await client.post(path, json=body)
        events, how = await read_raw_sse(resp)
        assert how == "eof"
        assert len(token_events(events)) == 3
        assert events[-2] == {"error": {"message": "Internal server error",
                                        "type": "InternalServerError", "param": None,
                                        "code": 500}}
        assert events[-1] == "[DONE]"
        assert all(e["choices"][0]["finish_reason"] is None for e in token_events(events))
    resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=9))
    assert resp.status == 500 and (await resp.json())["error"]["type"] == "InternalServerError"
    assert (await stats(client))["fault"] == "error_after"  # times=0: every request


async def test_freeze_after_n_tokens_then_resume_is_exact(client: TestClient) -> None:
    whole = await generate(client, "/v1/completions", {"prompt": "hello world",
                                                       "max_tokens": 12})
    await set_fault(client, mode="freeze_after", after_tokens=5)
    resp = await client.post("/v1/completions", json=completion_body(
        max_tokens=12, stream=True, return_token_ids=True))
    events, how = await read_raw_sse(resp, timeout_s=0.4)
    assert how == "silent" and len(token_events(events)) == 5
    state = await (await client.get("/sim/fault")).json()
    assert state["mode"] == "hang"  # the whole engine is frozen now
    assert (await client.get("/health")).status == 200
    await set_fault(client, mode="none")
    more, how = await read_raw_sse(resp)
    assert how == "eof" and more[-1] == "[DONE]"
    ids = [t for e in token_events(events + more) for t in e["choices"][0]["token_ids"]]
    assert ids == whole["ids"]


async def test_hang_after_headers_hits_new_requests_only(client: TestClient) -> None:
    running = await client.post("/v1/completions", json=completion_body(max_tokens=40,
                                                                        stream=True))
    await read_event(running)
    await set_fault(client, mode="hang_after_headers")
    stuck = await asyncio.wait_for(client.post("/v1/chat/completions",
                                               json=chat_body(stream=True)), 1.0)
    assert stuck.status == 200 and stuck.content_type == "text/event-stream"
    events, how = await read_raw_sse(stuck, timeout_s=0.3)
    assert (events, how) == ([], "silent")
    # The rest of the engine works: the running stream finishes, a new request is served,
    # and probes are never hit.
    rest, how = await read_raw_sse(running)
    assert how == "eof" and rest[-1] == "[DONE]"
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=2))
    assert resp.status == 200
    await set_fault(client, mode="none")
    events, how = await read_raw_sse(stuck)
    assert how == "eof" and events[-1] == "[DONE]" and len(token_events(events)) == 3


async def test_midstream_faults_spare_probes(client: TestClient) -> None:
    await set_fault(client, mode="reset_after", after_tokens=0, times=0)
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=2, stream=True),
                             headers={"x-sentinel-probe": "1"})
    events, how = await read_raw_sse(resp)
    assert how == "eof" and events[-1] == "[DONE]"
    resp = await client.post("/v1/completions", json=completion_body(max_tokens=2, stream=True))
    events, how = await read_raw_sse(resp)
    assert how == "cut" and token_events(events) == []  # after_tokens=0: before any token


@pytest.mark.parametrize("body", [
    {"mode": "reset_after", "after_tokens": -1},
    {"mode": "reset_after", "after_tokens": "3"},
    {"mode": "error_after", "times": 1.5},
    {"mode": "freeze_after", "times": True},
])
async def test_bad_midstream_fault_input_is_400(client: TestClient, body: dict) -> None:
    resp = await client.post("/sim/fault", json=body)
    assert resp.status == 400
    assert (await (await client.get("/sim/fault")).json())["mode"] == "none"
