"""Live prompt sampling by the relay (``--sample-prompts``): which text is a request's prompt, the
ratio and bounds, the config and flag, the relay's shell filling the buffer with the cluster the
feed names, and sending them with ``RoutingFeed/SubmitPrompts`` to a real grpc.aio server
(accepted/refused, an older control plane's UNIMPLEMENTED, no feed): counted, never raised."""
from __future__ import annotations

import json
from types import SimpleNamespace

import aiohttp
import grpc
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from relay_fake_engine import engine_handler

from sentinel_relay.cli import _parser, config_fields
from sentinel_relay.config import RelayConfig, RelayConfigError, load_relay_config
from sentinel_relay.metrics import RelayMetrics
from sentinel_relay.prompts import PromptSampler
from sentinel_relay.sampling import PromptBuffer, extract_prompt
from sentinel_relay.server import Relay
from xds_server.proto import routing_pb2, routing_pb2_grpc

FEED = ["127.0.0.1:18000"]


def test_the_prompt_is_the_completions_string_or_the_last_user_message():
    assert extract_prompt("completions", {"prompt": "Once upon"}) == "Once upon"
    assert extract_prompt("completions", {"prompt": [1, 2, 3]}) is None  # token ids: no text
    assert extract_prompt("completions", {"prompt": ["a", "b"]}) is None  # batched
    assert extract_prompt("completions", {"prompt": ""}) is None
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]
    assert extract_prompt("chat", {"messages": msgs}) == "second"
    assert extract_prompt("chat", {"messages": [*msgs, {"role": "assistant", "content": "pre"}]}) == "second"
    parts = [{"type": "text", "text": "look"}, {"type": "text", "text": "closely"}]
    assert extract_prompt("chat", {"messages": [{"role": "user", "content": parts}]}) == "look\nclosely"
    image = [*parts, {"type": "image_url", "image_url": {"url": "data:..."}}]
    assert extract_prompt("chat", {"messages": [{"role": "user", "content": image}]}) is None
    assert extract_prompt("chat", {"messages": [{"role": "system", "content": "x"}]}) is None
    assert extract_prompt("chat", {"messages": "hi"}) is None
    assert extract_prompt("other", {"prompt": "x"}) is None and extract_prompt("chat", None) is None


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=20)
_bodies = st.fixed_dictionaries({}, optional={
    "prompt": _json, "messages": st.lists(st.fixed_dictionaries({}, optional={
        "role": st.sampled_from(["user", "assistant", "system"]) | _json, "content": _json}) | _json, max_size=4)})


@given(kind=st.sampled_from(["completions", "chat", "other"]), body=_bodies | _json)
def test_any_json_body_gives_a_string_or_nothing(kind, body):
    got = extract_prompt(kind, json.loads(json.dumps(body)))
    assert got is None or (isinstance(got, str) and got)


def test_the_buffer_drops_the_oldest():
    b = PromptBuffer(2)
    assert [b.add("c", p) for p in ("1", "2", "3")] == [False, False, True]
    assert b.take() == [("c", "2"), ("c", "3")] and len(b) == 0
    with pytest.raises(ValueError):
        PromptBuffer(0)


def _value(metrics: RelayMetrics, name: str, **labels: str) -> float:
    for fam in metrics.registry.collect():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_sampling_draws_by_ratio_and_bounds_what_it_keeps():
    m = RelayMetrics()
    draws = iter([0.1, 0.5, 0.29])
    s = PromptSampler(RelayConfig(routing_feed=FEED, sample_prompts=0.3, sample_max_chars=5, sample_buffer=2), m,
                      rand=lambda: next(draws))
    assert [s.draw(), s.draw(), s.draw()] == [True, False, True]
    never = PromptSampler(RelayConfig(), m, rand=lambda: 0.0)  # ratio 0: never, even at a draw of 0
    assert not never.draw()
    s.offer("completions", {"prompt": "toolong"}, "llm")
    s.offer("completions", {"prompt": [1, 2]}, "llm")
    for p in ("a", "b", "c"):
        s.offer("completions", {"prompt": p}, "llm")
    assert s.buffer.take() == [("llm", "b"), ("llm", "c")]
    assert _value(m, "sentinel_relay_prompts_sampled_total") == 3
    assert _value(m, "sentinel_relay_prompts_dropped_total", reason="too_long") == 1
    assert _value(m, "sentinel_relay_prompts_dropped_total", reason="no_text") == 1
    assert _value(m, "sentinel_relay_prompts_dropped_total", reason="buffer_full") == 1


def test_the_config_and_flag():
    assert RelayConfig().sample_prompts == 0 and Relay(RelayConfig()).sampler is None  # off: nothing built
    assert config_fields(_parser().parse_args(["--sample-prompts"]))["sample_prompts"] == 0.05  # seed 002's 5 %
    assert config_fields(_parser().parse_args(["--sample-prompts", "0.2"]))["sample_prompts"] == 0.2
    assert config_fields(_parser().parse_args([]))["sample_prompts"] is None
    cfg = load_relay_config(routing_feed=FEED[0], sample_prompts=1.0)
    assert (cfg.sample_max_chars, cfg.sample_buffer, cfg.sample_interval_s) == (2000, 32, 5.0)
    with pytest.raises(RelayConfigError, match=r"sample_prompts: .*less than or equal to 1"):
        load_relay_config(routing_feed=FEED[0], sample_prompts=1.5)
    with pytest.raises(RelayConfigError, match=r"sample_prompts needs routing_feed"):
        load_relay_config(sample_prompts=0.05)
    with pytest.raises(RelayConfigError, match=r"sample_buffer"):
        load_relay_config(routing_feed=FEED[0], sample_prompts=0.05, sample_buffer=65)


async def test_the_relay_samples_answered_requests_with_the_feeds_cluster(serve):
    answer = engine_handler(lambda r: {"ok": "10.0.0.1:8000"}.get(r.headers.get("x-case", ""), "10.9.9.9:1"))

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.headers.get("x-case") == "err":
            return web.json_response({"error": {"message": "bad"}}, status=400)
        return await answer(request)
    base = await serve({("POST", "/v1/completions"): handle, ("POST", "/v1/chat/completions"): handle,
                        ("POST", "/v1/embeddings"): handle})
    relay = await Relay(RelayConfig(listen="127.0.0.1:0", upstream=base, routing_feed=FEED, sample_prompts=1.0,
                                    admin_listen=None)).start()
    try:
        assert relay.sampler is not None
        relay.on_node(SimpleNamespace(node_id="a", address="10.0.0.1:8000", state="HEALTHY", cluster="llm",
                                      routable=True, weight=1))
        url = f"http://127.0.0.1:{relay.port}"
        async with aiohttp.ClientSession() as s:
            for path, body, case in (
                    ("/v1/completions", {"prompt": "w1 unary", "max_tokens": 2}, "ok"),
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w2 chat"}],
                                              "max_tokens": 2, "stream": True}, "other"),
                    ("/v1/completions", {"prompt": "w3 refused", "max_tokens": 2}, "err"),  # a 400: not sampled
                    ("/v1/completions", {"prompt": "w4 n2", "n": 2, "max_tokens": 2}, "ok"),  # passthrough too
                    ("/v1/embeddings", {"input": "w5"}, "ok")):  # another path: never
                async with s.post(url + path, json=body, headers={"x-case": case}) as r:
                    await r.read()
        assert relay.sampler.buffer.take() == [("llm", "w1 unary"), ("", "w2 chat"), ("llm", "w4 n2")]
        assert b"w1 unary" not in generate_latest(relay.metrics.registry)
    finally:
        await relay.stop()


class _Accepting(routing_pb2_grpc.RoutingFeedServicer):
    def __init__(self) -> None:
        self.got: list[routing_pb2.PromptSample] = []

    async def SubmitPrompts(self, request, context):
        self.got.append(request)
        return routing_pb2.PromptAck(accepted=len(request.prompts) - 1, refused=1)


class _Older(routing_pb2_grpc.RoutingFeedServicer):
    """A control plane from before SubmitPrompts: the generated base answers UNIMPLEMENTED."""


async def _server(servicer: routing_pb2_grpc.RoutingFeedServicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    routing_pb2_grpc.add_RoutingFeedServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_sampled_prompts_are_sent_in_one_call_and_failures_only_counted(caplog):
    caplog.set_level("DEBUG")
    m = RelayMetrics()
    s = PromptSampler(RelayConfig(routing_feed=FEED, sample_prompts=1.0, sample_interval_s=2.0), m)
    accepting, older = _Accepting(), _Older()
    (srv_a, target_a), (srv_o, target_o) = await _server(accepting), await _server(older)
    try:
        async with grpc.aio.insecure_channel(target_a) as ch:
            await s.flush(ch, "relay-1")  # nothing waiting: no call
            assert accepting.got == []
            s.offer("completions", {"prompt": "secret one"}, "llm")
            s.offer("chat", {"messages": [{"role": "user", "content": "secret two"}]}, "")
            await s.flush(ch, "relay-1")
        [req] = accepting.got
        assert req.subscriber_id == "relay-1"
        assert [(p.cluster, p.prompt) for p in req.prompts] == [("llm", "secret one"), ("", "secret two")]
        assert _value(m, "sentinel_relay_prompts_sent_total", answer="accepted") == 1
        assert _value(m, "sentinel_relay_prompts_sent_total", answer="refused") == 1
        async with grpc.aio.insecure_channel(target_o) as ch:
            s.offer("completions", {"prompt": "secret three"}, "llm")
            await s.flush(ch, "relay-1")
        assert _value(m, "sentinel_relay_prompt_submit_failures_total", code="UNIMPLEMENTED") == 1
        assert _value(m, "sentinel_relay_prompts_dropped_total", reason="submit_failed") == 1
        s.offer("completions", {"prompt": "secret four"}, "llm")
        await s.flush(None, "relay-1")  # the feed is down
        assert _value(m, "sentinel_relay_prompts_dropped_total", reason="no_feed") == 1
        await srv_a.stop(0)
        async with grpc.aio.insecure_channel(target_a) as ch:  # a control plane gone: counted, not raised
            s.offer("completions", {"prompt": "secret five"}, "llm")
            await s.flush(ch, "relay-1")
        assert _value(m, "sentinel_relay_prompt_submit_failures_total", code="UNAVAILABLE") == 1
        assert len(s.buffer) == 0
    finally:
        await srv_a.stop(0)
        await srv_o.stop(0)
    assert "secret" not in caplog.text
