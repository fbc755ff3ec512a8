"""The relay through the real Envoy, in front of simulated engines (deterministic model): each
fault mid-generation, SSE and non-streaming, completions and chat. With the relay the client's
text equals the uninterrupted generation exactly, with one [DONE] and the right usage; without it
(the same scenario straight to Envoy) the client sees the cut or the hang."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import aiohttp
import pytest
from relay_fake_engine import parse_client
from relay_rig import relay_rig

from sentinel_relay.sse import SSESplitter, event_data
from sentinel_relay.unary import PIN_HEADER, pin_value
from xds_server.testing import Fleet, wait_for

pytestmark = pytest.mark.envoy

HEADER = "x-sentinel-upstream-host"
FAST = {"probation": {"clean": "1s", "ramp_step_percent": 50, "ramp_step": "200ms"}}
TOKENS, CUT = 40, 15     # tokens per request; the fault fires after CUT tokens
STALL_GAP_S = 4.0        # longer than a health-signal rescue, so a freeze proves the feed acted
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def body_for(kind: str, stream: bool = True) -> dict:
    b: dict = {"max_tokens": TOKENS, "temperature": 0}
    if kind == "completions":
        b["prompt"] = "The relay keeps the story going"
    else:
        b["messages"] = [{"role": "user", "content": "Tell the story of the relay"}]
    if stream:
        b["stream"] = True
        b["stream_options"] = {"include_usage": True}
    return b


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    yield from relay_rig(tmp_path_factory, "relay", [
        "--stall-gap-s", str(STALL_GAP_S), "--first-chunk-timeout-s", "1.0", "--ping-interval-s", "0.1"],
        n_nodes=3, token_interval_ms=10.0, health=FAST, per_try_timeout_s=None, per_try_idle_timeout_s=2.0)


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


def node_by_address(fleet: Fleet, address: str):
    return next(n for n in fleet.nodes if n.address == address)


async def metric(http, admin: str, name: str, **labels) -> float:
    async with http.get(admin + "/metrics") as r:
        text = await r.text()
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and want <= set(head.partition("{")[2].rstrip("}").split(",")):
            return float(value)
    return 0.0


async def run_stream(http, url, path, body, act=None, on_node=None, timeout_s=12.0) -> dict:
    """POST a streaming request, call ``await act(node)`` once CUT data chunks arrived (``node``:
    the serving engine from Envoy's header). ``on_node(address)`` False: abandon and return None
    (to wait for a request that lands on a chosen node). Returns the client's view."""
    raw, cut, events, acted, t0 = bytearray(), False, 0, False, time.monotonic()
    last, gap = t0, 0.0
    headers: dict = {}
    try:
        async with http.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            headers = dict(r.headers)
            if on_node is not None and not on_node(headers.get(HEADER)):
                return None
            sp = SSESplitter()
            async for data in r.content.iter_any():
                now = time.monotonic()
                for ev in sp.feed(data):
                    d = event_data(ev)
                    if d is not None and d != b"[DONE]":
                        events += 1
                        gap, last = max(gap, now - last), now
                raw += data
                if act is not None and not acted and events >= CUT:
                    acted = True
                    await act(headers.get(HEADER))
    except (TimeoutError, aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        cut = True
    got = parse_client(bytes(raw))
    got.update(cut=cut, gap=gap, headers=headers, elapsed=time.monotonic() - t0)
    return got


async def reference(http, fleet, kind):
    got = await run_stream(http, fleet.url, PATHS[kind], body_for(kind))
    assert got["dones"] == 1 and not got["cut"] and got["usage"][0]["completion_tokens"] == TOKENS
    return got


def assert_whole(got, ref):
    assert not got["cut"], got
    assert got["text"] == ref["text"]                      # nothing lost, nothing repeated
    assert got["dones"] == 1 and got["finishes"] == ["length"] and not got["errors"]
    assert got["usage"] == ref["usage"]                    # prompt tokens once, completion = delivered
    assert len(got["ids"]) == 1 and len(got["models"]) == 1


@contextlib.asynccontextmanager
async def all_faults(http, fleet, mode, **params):
    """Arm ``mode`` on every engine (each trips once, after CUT tokens: a continuation needs
    TOKENS - CUT < CUT tokens, so it never trips); disarm after."""
    for n in fleet.nodes:
        await fleet.set_fault(http, n.node_id, mode, after_tokens=CUT, times=1, **params)
    try:
        yield
    finally:
        for n in fleet.nodes:
            with contextlib.suppress(Exception):
                await fleet.set_fault(http, n.node_id, "none")


async def heal(http, fleet):
    for n in fleet.nodes:
        for p in (n.engine, n.agent):
            if p is not None and not p.alive():
                p.start()
            elif p is not None and getattr(p, "frozen", False):
                p.thaw()
    await fleet.wait_all_routed(http, timeout_s=30)


async def test_a_direct_client_never_sees_the_pin_header_and_a_pin_still_routes(rig, http):
    """Envoy's stateful-session filter answers with x-sentinel-pin (base64 of the serving
    endpoint's address) to a client that sent none; the header_mutation filter first in
    http_filters (so it encodes last) removes it, and a request that carries a pin (the relay's
    rescue) still lands on the pinned node."""
    fleet, *_ = rig
    await heal(http, fleet)
    for stream in (False, True):
        for _ in range(3):
            async with http.post(fleet.url + PATHS["completions"], json=body_for("completions", stream)) as r:
                await r.read()
                assert r.status == 200 and r.headers.get(HEADER), r.headers
                assert PIN_HEADER not in r.headers, dict(r.headers)
    for n in fleet.nodes:
        for _ in range(3):
            async with http.post(fleet.url + PATHS["completions"], json=body_for("completions", False),
                                 headers={PIN_HEADER: pin_value(n.address)}) as r:
                await r.read()
                assert r.status == 200 and r.headers.get(HEADER) == n.address, (n.address, dict(r.headers))
                assert PIN_HEADER not in r.headers, dict(r.headers)


# -- SSE -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("mode", ["fail_after", "error_after"])
async def test_sse_engine_error_mid_stream(rig, http, kind, mode):
    fleet, relay_url, admin, _ = rig
    ref = await reference(http, fleet, kind)
    async with all_faults(http, fleet, mode):
        direct = await run_stream(http, fleet.url, PATHS[kind], body_for(kind))
    assert direct["dones"] == (1 if mode == "error_after" else 0) and not direct["finishes"]
    assert len(direct["text"]) < len(ref["text"])          # without the relay: cut short
    trig = "reset" if mode == "fail_after" else "error"
    before = await metric(http, admin, "sentinel_relay_rescues_total", trigger=trig, outcome="resumed")
    async with all_faults(http, fleet, mode):
        got = await run_stream(http, relay_url, PATHS[kind], body_for(kind))
    assert_whole(got, ref)
    assert await metric(http, admin, "sentinel_relay_rescues_total", trigger=trig, outcome="resumed") == before + 1


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_sse_hang_after_headers(rig, http, kind):
    fleet, relay_url, _admin, _ = rig
    ref = await reference(http, fleet, kind)
    victim = fleet.nodes[0]

    seen: dict = {}

    async def routed_in_full() -> bool:  # the hang before (or an earlier test) may have lowered its share
        seen["weight"] = (await fleet.envoy_weights(http)).get(victim.node_id)
        seen["envoy"] = (await fleet.envoy_hosts(http)).get(victim.node_id)
        if seen["weight"] == 100 and seen["envoy"] == "HEALTHY":
            return True
        node = (await fleet.cp_nodes(http))[victim.node_id]
        seen["control plane"] = {k: node.get(k) for k in ("state", "reason", "weight", "probe_stream_connected")}
        return False

    async def on_victim(url):
        for _ in range(30):
            await wait_for(routed_in_full, timeout_s=20,
                           what=lambda: f"the victim routed at full weight (last seen {seen})")
            await fleet.set_fault(http, victim.node_id, "hang_after_headers", times=1)
            got = await run_stream(http, url, PATHS[kind], body_for(kind),
                                   on_node=lambda a: a == victim.address)
            if got is not None:
                return got
        pytest.fail(f"Envoy never routed to the victim: {(await fleet.cp_nodes(http))[victim.node_id]}")
    try:
        direct = await on_victim(fleet.url)
        assert direct["cut"] and direct["text"] == "" and direct["dones"] == 0
        got = await on_victim(relay_url)
        assert_whole(got, ref)
        assert got["elapsed"] < 1.0 + 2.0  # the first-chunk timeout (1 s) + the whole generation
    finally:
        await fleet.set_fault(http, victim.node_id, "none")


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("fault", ["freeze", "kill"])
async def test_sse_node_freeze_or_kill_mid_stream(rig, http, kind, fault):
    fleet, relay_url, admin, relay = rig
    ref = await reference(http, fleet, kind)

    async def strike(address):
        node = node_by_address(fleet, address)
        if fault == "freeze":   # the host freezes: engine and agent (heartbeats stop)
            node.engine.freeze()
            node.agent.freeze()
        else:                   # the engine process dies
            os.killpg(node.engine.pid, signal.SIGKILL)
    try:
        direct = await run_stream(http, fleet.url, PATHS[kind], body_for(kind), act=strike)
        assert direct["dones"] == 0 and len(direct["text"]) < len(ref["text"])
        if fault == "freeze":
            assert direct["gap"] >= 1.5 or direct["elapsed"] >= 2.0  # hung until Envoy's idle timeout
        # The struck node is out of rotation now: the relayed stream runs on another one.
        # A kill is seen by whichever comes first: the reset through Envoy or the ejection.
        # A rescue attempt that misses its first-chunk timeout (an engine starved of CPU) is
        # continued once more (trigger stall), and that one is credited with the completion.
        trigs = ("health",) if fault == "freeze" else ("health", "reset")
        log_from = relay.log_path.stat().st_size
        before = [await metric(http, admin, "sentinel_relay_rescues_total", trigger=t, outcome="resumed")
                  for t in (*trigs, "stall")]
        got = await run_stream(http, relay_url, PATHS[kind], body_for(kind), act=strike)
        assert_whole(got, ref)
        assert got["gap"] < STALL_GAP_S - 1, got["gap"]   # not the stall timer
        after = [await metric(http, admin, "sentinel_relay_rescues_total", trigger=t, outcome="resumed")
                 for t in (*trigs, "stall")]
        assert sum(after) == sum(before) + 1, relay.output_tail()
        # the first rescue came from the fault's own signal (a freeze: the ejection the feed sent)
        await wait_for(lambda: any(f"rescuing stream (trigger {t}," in relay.log_path.read_bytes()[log_from:].decode(
            errors="replace") for t in trigs), timeout_s=2.0, what="the rescue's trigger in the relay log")
    finally:
        await heal(http, fleet)


# -- non-streaming ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("fault", ["freeze", "kill"])
async def test_non_streaming_node_freeze_or_kill(rig, http, kind, fault):
    fleet, relay_url, _admin, _ = rig
    body = body_for(kind, stream=False)
    body["max_tokens"] = 60  # ~0.6 s of generation: time to strike while it runs
    async with http.post(fleet.url + PATHS[kind], json=body) as r:
        ref = await r.json()
    async def user_requests():
        out = {}
        for n in fleet.nodes:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with http.get(n.engine_url + "/sim/stats", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    out[n.node_id] = (await r.json())["requests_by_kind"].get("user", 0)
        return out

    async def strike_busy_node(before):
        # the node is unknown until the answer: strike the engine that took the request
        await asyncio.sleep(0.25)
        now = await user_requests()
        n = next(n for n in fleet.nodes if now.get(n.node_id, 0) > before.get(n.node_id, 0))
        if fault == "freeze":
            n.engine.freeze()
            n.agent.freeze()
        else:
            os.killpg(n.engine.pid, signal.SIGKILL)

    async def call(url):
        before = await user_requests()
        t0 = time.monotonic()
        t = asyncio.create_task(http.post(url + PATHS[kind], json=body,
                                          timeout=aiohttp.ClientTimeout(total=8)))
        await strike_busy_node(before)
        try:
            r = await t
            return r.status, await r.json(content_type=None), time.monotonic() - t0
        except TimeoutError:
            return None, None, time.monotonic() - t0
    try:
        direct_s = 99.0
        if fault == "freeze":
            # Without the relay: the wait for Envoy's per-try idle timeout (2 s), then its retry.
            # (A kill needs no comparison: the reset comes before the response headers, which
            # Envoy's gateway-error retry already covers; the relay must still answer right.)
            status, _direct, direct_s = await call(fleet.url)
            assert status != 200 or direct_s >= 2.0, direct_s
        status, got, relay_s = await call(relay_url)
        assert status == 200, got
        if fault == "freeze":
            # re-issued on the ejection (~0.3 s), not at Envoy's timeout
            assert relay_s < 1.8 and relay_s < direct_s, (relay_s, direct_s)
        key = "text" if kind == "completions" else "message"
        assert got["choices"][0][key] == ref["choices"][0][key]
        assert got["usage"] == ref["usage"]
    finally:
        await heal(http, fleet)
