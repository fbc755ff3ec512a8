"""A rescued stream is exactly what the engine would have sent. Separate processes: two
simulated engines whose tokenizer behaves like a byte-level BPE (lone bytes held back or shown as
U+FFFD), their agents, the control plane, the real Envoy and the relay. The client's bytes
through the relay, minus its ``: ping`` lines and but for the response id and created time
(which differ per request), equal the bytes of the same request sent straight to an engine;
cut at every position in a window around the interesting token (a stop string's hold-back, a
held-back byte), completions and chat, with and without stop strings, usage asked or not."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import aiohttp
import pytest
from relay_rig import relay_rig
from sim_wire import same_but_identity

from node_probe.sim import model as sim_model
from sentinel_relay.sse import SSESplitter, event_data
from xds_server.testing import wait_for

pytestmark = pytest.mark.envoy

HEADER = "x-sentinel-upstream-host"
FAST = {"probation": {"clean": "1s", "ramp_step_percent": 50, "ramp_step": "200ms"}}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PING_S = 0.2      # the relay's ping interval
IDLE_S = 10.0     # Envoy's per-try idle timeout: what released a forgotten upstream before
TOKENS = 28
PROMPT = "naïve café"


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    yield from relay_rig(tmp_path_factory, "relay-fidelity", [
        "--stall-gap-s", "4.0", "--first-chunk-timeout-s", "30", "--ping-interval-s", str(PING_S)],
        n_nodes=2, token_interval_ms=4.0, health=FAST, per_try_timeout_s=None, per_try_idle_timeout_s=IDLE_S,
        engine_args=["--byte-token-rate", "0.15"])


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


def body_for(kind: str, stop=None, usage=False, stream=True, max_tokens=TOKENS) -> dict:
    b: dict = {"max_tokens": max_tokens, "temperature": 0}
    if kind == "completions":
        b["prompt"] = PROMPT
    else:
        b["messages"] = [{"role": "user", "content": PROMPT}]
    if stop is not None:
        b["stop"] = stop
    if stream:
        b["stream"] = True
        if usage:
            b["stream_options"] = {"include_usage": True}
    return b


async def raw_post(http, url, path, body, headers=None) -> tuple[int, dict, bytes]:
    async with http.post(url + path, json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def stats(http, node) -> dict:
    async with http.get(node.engine_url + "/sim/stats") as r:
        return await r.json()


async def metric(http, admin: str, name: str, **labels) -> float:
    async with http.get(admin + "/metrics") as r:
        text = await r.text()
    want = {f'{k}="{v}"' for k, v in labels.items()}
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and want <= set(head.partition("{")[2].rstrip("}").split(",")):
            total += float(value)
    return total


async def reset_faults(http, fleet) -> None:
    for n in fleet.nodes:
        with contextlib.suppress(aiohttp.ClientError):
            await fleet.set_fault(http, n.node_id, "none")


def token_texts(kind: str, max_tokens: int = TOKENS) -> tuple[list[int], list[str]]:
    """The simulator's generation for PROMPT (ids, text released per token, no stop strings)."""
    if kind == "completions":
        pids = sim_model.tokenize(PROMPT)
    else:
        pids, _ = sim_model.chat_prompt_ids([("user", PROMPT)], add_generation_prompt=True,
                                            continue_final_message=False)
    d = sim_model.Decoder(pids, max_tokens, byte_rate=0.15)
    outs = [d.step() for _ in range(max_tokens)]
    return [o.token_id for o in outs], [o.text for o in outs]


def interesting(kind: str, with_stop: bool) -> tuple[list[str] | None, int]:
    """(stop list, index of the interesting token). With a stop string: one that begins in the
    last two characters of a token and ends in the next (the token whose text the engine holds
    back at the cut); without: the first lone byte held back (text "" while its id was sent)."""
    ids, texts = token_texts(kind)
    if with_stop:
        m = next(i for i in range(3, TOKENS - 4) if len(texts[i].strip()) >= 3 and len(texts[i + 1].strip()) >= 3
                 and "\ufffd" not in texts[i] + texts[i + 1])
        return [texts[m][-2:] + texts[m + 1][:2], "zzz"], m
    m = next(i for i, t in enumerate(texts) if t == "" and ids[i] >= sim_model.FIRST_BYTE_ID)
    return None, m


# -- the ids the relay asks for are not the client's ---------------------------------------------
@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("usage", [False, True])
async def test_token_ids_the_client_did_not_ask_for_never_reach_it(rig, http, kind, usage):
    fleet, relay_url, _admin, _ = rig
    body = body_for(kind, usage=usage)
    _, _, direct = await raw_post(http, fleet.nodes[0].engine_url, PATHS[kind], body)
    status, headers, got = await raw_post(http, relay_url, PATHS[kind], body)
    assert status == 200 and headers["x-sentinel-relay"] == "rescue"
    assert b'token_ids":[' not in got
    assert same_but_identity(got) == same_but_identity(direct)
    # a client that asks for them gets them, as from the engine
    asked = {**body, "return_token_ids": True}
    _, _, direct = await raw_post(http, fleet.nodes[0].engine_url, PATHS[kind], asked)
    _, _, got = await raw_post(http, relay_url, PATHS[kind], asked)
    assert b'token_ids":[' in got and same_but_identity(got) == same_but_identity(direct)


# -- every cut in a window around the interesting token -------------------------------------------
@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("with_stop", [False, True])
@pytest.mark.parametrize("usage", [False, True])
async def test_rescue_at_every_cut_around_the_interesting_token_is_byte_exact(rig, http, kind, with_stop, usage):
    fleet, relay_url, admin, relay = rig
    stop, m = interesting(kind, with_stop)
    # the client asks for the token ids here, so this compares the rescue itself (without them:
    # test_token_ids_the_client_did_not_ask_for_never_reach_it, and the pure core's properties)
    body = {**body_for(kind, stop, usage), "return_token_ids": True}
    _, _, direct = await raw_post(http, fleet.nodes[0].engine_url, PATHS[kind], body)
    if with_stop:
        assert b'"finish_reason":"stop"' in direct  # the stop string spans tokens m and m + 1
    resumed = await metric(http, admin, "sentinel_relay_rescues_total", outcome="resumed")
    cuts = range(max(0, m - 1), m + 3)
    try:
        for cut in cuts:
            # both engines cut their next user stream after `cut` tokens (once each): the first
            # attempt is cut there, a continuation landing on the other engine is cut again
            for n in fleet.nodes:
                await fleet.set_fault(http, n.node_id, "reset_after", after_tokens=cut, times=1)
            status, _, got = await raw_post(http, relay_url, PATHS[kind], body)
            assert status == 200
            assert same_but_identity(got) == same_but_identity(direct), (cut, relay.output_tail())
            await reset_faults(http, fleet)
    finally:
        await reset_faults(http, fleet)
    # (a cut before the first token may be retried by Envoy itself, one after the last never
    # fires: the relay then sees no fault)
    generated = direct.count(b'"token_ids":[')  # one per token chunk
    assert await metric(http, admin, "sentinel_relay_rescues_total", outcome="resumed") >= \
        resumed + sum(1 for c in cuts if 1 <= c < generated)


# -- a client leaving mid-rescue frees the engine ----------------------------------------------------
async def test_client_leaving_during_a_rescue_releases_the_upstream_within_the_ping_interval(rig, http):
    fleet, relay_url, admin, _ = rig
    body = body_for("completions")
    body["max_tokens"] = 200
    survivor = None
    try:
        async with http.post(relay_url + PATHS["completions"], json=body) as r:
            served = r.headers[HEADER]
            victim = next(n for n in fleet.nodes if n.address == served)
            survivor = next(n for n in fleet.nodes if n is not victim)
            sp, events, pings = SSESplitter(), 0, 0
            async for data in r.content.iter_any():
                for ev in sp.feed(data):
                    if event_data(ev) is None:
                        pings += 1
                    else:
                        events += 1
                if events >= 5 and survivor is not None and pings == 0 and victim.engine.alive():
                    # the rescue will wait on a long prefill there; the serving engine dies
                    await fleet.set_fault(http, survivor.node_id, "prefill", prefill_ms=60_000)
                    os.killpg(victim.engine.pid, signal.SIGKILL)
                if pings >= 2:
                    break  # the relay is rescuing: the client leaves
            assert pings >= 2

            async def waiting() -> bool:  # the continuation waits there, behind the long prefill
                return (await stats(http, survivor))["in_flight"] == 1
            await wait_for(waiting, timeout_s=5, what="the continuation on the survivor")
            r.connection.transport.abort()
        t0 = time.monotonic()

        async def released() -> bool:
            return (await stats(http, survivor))["in_flight"] == 0 and \
                await metric(http, admin, "sentinel_relay_in_flight") == 0
        await wait_for(released, timeout_s=IDLE_S / 2, what="the continuation released")
        took = time.monotonic() - t0
        # well within Envoy's idle timeout (10 s), which is what released it before
        assert took < PING_S + 2.5, took
    finally:
        if survivor is not None:
            await fleet.set_fault(http, survivor.node_id, "none")
        for n in fleet.nodes:
            if not n.engine.alive():
                n.engine.start()
        await fleet.wait_all_routed(http, timeout_s=30)


# -- a non-streaming request reaches one survivor once --------------------------------------------
async def test_non_streaming_request_reaches_one_surviving_engine_once(rig, http):
    fleet, relay_url, _admin, _ = rig
    body = body_for("completions", stream=False, max_tokens=120)  # ~0.5 s of generation
    _, _, direct = await raw_post(http, fleet.nodes[0].engine_url, PATHS["completions"], body)
    try:
        before = {n.node_id: (await stats(http, n))["requests_by_kind"]["user"] for n in fleet.nodes}
        task = asyncio.create_task(raw_post(http, relay_url, PATHS["completions"], body))
        # the node that took it
        async def taken():
            for n in fleet.nodes:
                if (await stats(http, n))["requests_by_kind"]["user"] > before[n.node_id]:
                    return n
            return None
        busy = await wait_for(taken, timeout_s=5, what="the request on an engine")
        idle = next(n for n in fleet.nodes if n is not busy)
        # the other node dies: its ejection must not re-issue a request that does not run there
        os.killpg(idle.engine.pid, signal.SIGKILL)
        status, _, got = await task
        assert status == 200
        assert json.loads(got)["choices"] == json.loads(direct)["choices"]
        await asyncio.sleep(1.0)  # the ejection reached the relay while the request ran, or after
        after = (await stats(http, busy))["requests_by_kind"]["user"]
        assert after == before[busy.node_id] + 1  # one generation, on the one survivor
    finally:
        for n in fleet.nodes:
            if not n.engine.alive():
                n.engine.start()
        await fleet.wait_all_routed(http, timeout_s=30)


# -- a garbled chunk is not a dead node; a rescue never goes back ---------------------------------
@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_garbled_event_passes_through_as_envoy_alone_would(rig, http, kind):
    fleet, relay_url, admin, _ = rig
    body = body_for(kind)
    rescues = await metric(http, admin, "sentinel_relay_rescues_total")
    try:
        for n in fleet.nodes:
            await fleet.set_fault(http, n.node_id, "garble_after", after_tokens=6, times=1)
        _, _, direct = await raw_post(http, fleet.url, PATHS[kind], body)
        await reset_faults(http, fleet)
        for n in fleet.nodes:
            await fleet.set_fault(http, n.node_id, "garble_after", after_tokens=6, times=1)
        status, _, got = await raw_post(http, relay_url, PATHS[kind], body)
    finally:
        await reset_faults(http, fleet)
    assert status == 200 and b"cmpl-garbled" in direct
    assert same_but_identity(got) == same_but_identity(direct)  # the garbled event included
    assert await metric(http, admin, "sentinel_relay_rescues_total") == rescues  # not taken for a dead node


async def test_a_rescue_never_goes_back_to_the_node_that_failed_it(rig, http):
    # One engine answers every stream with an in-band error after 5 tokens; its probes are fine,
    # so it stays routable. Each stream that starts there must be continued on the other.
    fleet, relay_url, _admin, _ = rig
    bad, good = fleet.nodes
    body = body_for("completions")
    _, _, direct = await raw_post(http, good.engine_url, PATHS["completions"], body)
    started_on_bad = 0
    try:
        await fleet.set_fault(http, bad.node_id, "error_after", after_tokens=5, times=0)
        for _ in range(40):
            before = (await stats(http, bad))["requests_by_kind"]["user"]
            status, headers, got = await raw_post(http, relay_url, PATHS["completions"], body)
            assert status == 200
            assert same_but_identity(got) == same_but_identity(direct)
            if headers[HEADER] == bad.address:
                started_on_bad += 1
                assert (await stats(http, bad))["requests_by_kind"]["user"] == before + 1  # never again
            if started_on_bad >= 5:
                break
    finally:
        await reset_faults(http, fleet)
    assert started_on_bad >= 5
