"""The relay's I/O shell against a scripted vLLM-shaped upstream (aiohttp, real HTTP) standing
in for Envoy: every trigger (health, reset, error, stall, 5xx), streaming and not."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from relay_fake_engine import generate, parse_client

from sentinel_relay.config import RelayConfig
from sentinel_relay.server import RELAY_HEADER, Relay
from sentinel_relay.sse import SSESplitter


class Upstream:
    """Serves the fake engine; ``faults`` is a list consumed one per request:
    ("cut", k) close after k events, ("error", k) in-band error after k, ("stall", k) go silent
    after k, ("500",) status 500, None: whole."""

    def __init__(self) -> None:
        self.faults: list = []
        self.bodies: list[dict] = []
        self.n = 0
        self.stalled = asyncio.Event()
        self.prefill_s = 0.0  # delay before the first event of every later request

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.n += 1
        fault = self.faults.pop(0) if self.faults else None
        kind = "chat" if request.path.endswith("chat/completions") else "completions"
        host = f"10.0.0.{self.n}:8000"
        if fault and fault[0] == "500":
            return web.json_response({"error": {"message": "cuda", "code": 500}}, status=500)
        sse, _ = generate(kind, body, rid=f"r{self.n}", created=self.n)
        if not body.get("stream"):
            if fault and fault[0] == "stall":
                await asyncio.sleep(30)
            text = "".join(parse_client(sse)["text"])
            return web.json_response({"id": f"r{self.n}", "choices": [{"text": text}]},
                                     headers={"x-sentinel-upstream-host": host})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream",
                                           "x-sentinel-upstream-host": host})
        await resp.prepare(request)
        if self.n > 1:
            await asyncio.sleep(self.prefill_s)
        events = SSESplitter().feed(sse)
        for i, ev in enumerate(events):
            if fault and i == fault[1]:
                if fault[0] == "cut":
                    request.transport.close()
                    return resp
                if fault[0] == "error":
                    await resp.write(b'data: {"error":{"message":"EngineDeadError","code":500}}\n\n')
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                if fault[0] == "stall":
                    self.stalled.set()
                    await asyncio.sleep(30)
            await resp.write(ev)
            await asyncio.sleep(0.002)
        return resp


@pytest.fixture
async def rig(serve):
    up = Upstream()
    base = await serve({("POST", "/v1/completions"): up.handle, ("POST", "/v1/chat/completions"): up.handle})
    relay = await Relay(RelayConfig(listen="127.0.0.1:0", upstream=base, stall_gap_s=0.4,
                                    first_chunk_timeout_s=0.4, ping_interval_s=0.05)).start()
    yield up, relay, f"http://127.0.0.1:{relay.port}"
    await relay.stop()


BODY = {"prompt": "w5 hello", "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
CHAT = {"messages": [{"role": "user", "content": "w9 hi"}], "max_tokens": 10, "stream": True,
        "stream_options": {"include_usage": True}}


def reference(kind, body):
    sse, gen = generate(kind, {**body, "return_token_ids": True}, rid="x")
    return parse_client(sse), gen


async def post(url, path, body):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        async with s.post(url + path, json=body) as r:
            return r.status, r.headers, await r.read()


@pytest.mark.parametrize("fault", [("cut", 4), ("error", 5), ("stall", 3), ("500",), ("cut", 0)])
@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_stream_fault_is_rescued_exactly(rig, kind, fault):
    up, relay, url = rig
    up.faults = [fault]
    up.prefill_s = 0.2 if fault[0] == "stall" else 0.0
    body = BODY if kind == "completions" else CHAT
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    status, headers, raw = await post(url, path, body)
    ref, gen = reference(kind, body)
    got = parse_client(raw)
    assert status == 200 and headers[RELAY_HEADER] == "rescue"
    assert got["text"] == ref["text"] and got["token_ids"] == []  # the ids the relay asked for stay with it
    assert up.bodies[0]["return_token_ids"] is True
    if up.n > 1 and up.bodies[1].get("prompt") != body.get("prompt"):  # a continuation: from ids, chat too
        assert up.bodies[1]["prompt"][-1] in gen and "messages" not in up.bodies[1]
    assert got["dones"] == 1 and got["finishes"] == ["length"] and got["usage"] == ref["usage"]
    assert len(got["ids"]) == 1 and not got["errors"]
    assert up.n == 2
    if fault[0] == "stall":
        assert got["pings"] >= 1  # the client heard from the relay during the rescue
    trig = {"cut": "reset", "error": "error", "stall": "stall", "500": "error"}[fault[0]]
    assert relay.metrics.rescues.labels(trig, "resumed")._value.get() == 1


async def test_health_signal_rescues_streams_on_the_ejected_node_only(rig):
    up, relay, url = rig
    up.faults = [("stall", 3)]
    task = asyncio.create_task(post(url, "/v1/completions", BODY))
    await asyncio.wait_for(up.stalled.wait(), 5)
    relay.on_node(SimpleNamespace(node_id="b", address="10.0.0.9:8000", state="UNHEALTHY"))
    relay.on_node(SimpleNamespace(node_id="a", address="10.0.0.1:8000", state="DRAINING"))
    assert relay.by_node["10.0.0.1:8000"]  # still in flight: drain lets it finish
    t0 = asyncio.get_running_loop().time()
    relay.on_node(SimpleNamespace(node_id="a", address="10.0.0.1:8000", state="UNHEALTHY"))
    _status, _, raw = await task
    assert asyncio.get_running_loop().time() - t0 < 0.3  # at once, not at the stall gap
    ref, gen = reference("completions", BODY)
    got = parse_client(raw)
    assert got["text"] == ref["text"] and got["dones"] == 1 and got["usage"] == ref["usage"]
    assert relay.metrics.rescues.labels("health", "resumed")._value.get() == 1
    assert up.bodies[1]["prompt"][-3:] == gen[:3] and up.bodies[1]["max_tokens"] == 9


async def test_last_attempt_failing_sends_one_error_event_and_no_done(rig):
    up, _relay, url = rig
    up.faults = [("cut", 3), ("cut", 1), ("cut", 1)]
    status, _, raw = await post(url, "/v1/completions", BODY)
    got = parse_client(raw)
    assert status == 200 and got["dones"] == 0 and len(got["errors"]) == 1
    assert up.n == 3  # first attempt + max_rescues (2)
    ref, _ = reference("completions", BODY)
    assert ref["text"].startswith(got["text"]) and got["text"]


async def test_refused_request_passes_through_with_header(rig):
    up, _relay, url = rig
    up.faults = [("cut", 3)]
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={**BODY, "echo": True}) as r:
            assert r.headers[RELAY_HEADER] == "passthrough; reason=echo"
            with pytest.raises(aiohttp.ClientPayloadError):  # the cut reaches the client as it was
                await r.read()
    assert "return_token_ids" not in up.bodies[0] and up.n == 1


async def test_non_streaming_reissued_on_500_and_on_ejection(rig):
    up, relay, url = rig
    up.faults = [("500",)]
    body = {"prompt": "w5 hello", "max_tokens": 5}
    status, _, raw = await post(url, "/v1/completions", body)
    assert status == 200 and up.n == 2 and up.bodies[1] == body  # the request as it was
    up.faults = [("stall",)]
    task = asyncio.create_task(post(url, "/v1/completions", body))
    for _ in range(100):
        if relay.unary.inflight:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    # a reconnect's snapshot repeating an old ejection re-issues nothing
    assert relay.on_node(SimpleNamespace(node_id="x", address="10.0.0.3:8000", state="UNHEALTHY"), True) == 0
    relay.on_node(SimpleNamespace(node_id="y", address="10.0.0.4:8000", state="HEALTHY"))
    relay.on_node(SimpleNamespace(node_id="y", address="10.0.0.4:8000", state="UNHEALTHY"))
    status, _, raw2 = await asyncio.wait_for(task, 5)
    assert status == 200 and json.loads(raw2)["choices"] == json.loads(raw)["choices"]
    assert relay.metrics.rescues.labels("health", "hedged")._value.get() == 1


async def test_ejection_reissues_only_the_non_streaming_attempts_waiting_on_that_node(rig):
    up, relay, url = rig
    a, b = "10.0.0.1:8000", "10.0.0.2:8000"
    for node_id, addr in (("a", a), ("b", b)):
        relay.on_node(SimpleNamespace(node_id=node_id, address=addr, state="HEALTHY", routable=True, weight=1))
    up.faults = [("500",), ("stall",)]  # the first attempt fails at once, the re-issue waits
    task = asyncio.create_task(post(url, "/v1/completions", {"prompt": "w5 hello", "max_tokens": 5}))
    for _ in range(200):
        if relay.unary.inflight and len(next(iter(relay.unary.inflight)).nodes) == 2:
            break
        await asyncio.sleep(0.01)
    u = next(iter(relay.unary.inflight))
    first, second = u.nodes
    assert {first, second} == {a, b}  # pinned, the re-issue away from the node that failed
    await asyncio.sleep(0.05)
    # the node of the answered attempt is ejected: nothing of this request waits there
    relay.on_node(SimpleNamespace(node_id="x", address=first, state="UNHEALTHY", routable=False, weight=1))
    assert relay.metrics.rescues.labels("health", "hedged")._value.get() == 0
    relay.on_node(SimpleNamespace(node_id="y", address=second, state="UNHEALTHY", routable=False, weight=1))
    assert relay.metrics.rescues.labels("health", "hedged")._value.get() == 1
    status, _, _ = await asyncio.wait_for(task, 5)
    assert status == 200 and up.n == 3
