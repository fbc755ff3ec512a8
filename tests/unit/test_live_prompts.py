"""Live prompts for switch-back validation, the control plane's side: the config, the bounded pool
(xds_server/probing/live_prompts.py), which prompts a validation draws, and the
``RoutingFeed/SubmitPrompts`` handler (off refuses, bounds, unknown clusters, the feed's access
rule, counted in metrics, no prompt text logged)."""
from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from xds_server.config import ConfigError, parse_config
from xds_server.config.validation import LivePromptsConfig
from xds_server.feed.service import RoutingFeed
from xds_server.probing.live_prompts import MAX_PROMPTS_PER_CALL, SHARED, LivePromptPool, draw_prompts
from xds_server.proto import routing_pb2

KNOWN = {"llm", "small"}


def _config(live: dict | None = None, listen: str = "127.0.0.1:0", validation: bool = True) -> dict:
    node = {"id": "a", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:9001"}
    v: dict = {"enabled": validation}
    if live is not None:
        v["live_prompts"] = live
    return {"xds": {"listen": listen}, "tls": {"mode": "plaintext"}, "health": {"validation": v},
            "clusters": [{"name": "llm", "nodes": [node]}]}


def test_live_prompts_are_off_by_default_and_the_config_names_what_it_refuses():
    lp = parse_config(_config()).health.validation.live_prompts
    assert (lp.enabled, lp.max_prompts, lp.max_chars, lp.share) == (False, 64, 2000, 0.5)
    for field in ("enabled", "max_prompts", "max_chars", "share"):
        d = LivePromptsConfig.model_fields[field].description or ""
        assert "ours" in d or "seed 002" in d, field
    with pytest.raises(ConfigError, match=r"live_prompts\.enabled needs health\.validation\.enabled"):
        parse_config(_config({"enabled": True}, validation=False))
    with pytest.raises(ConfigError, match=r"health\.validation\.live_prompts\.share"):
        parse_config(_config({"share": 1.5}))
    with pytest.raises(ConfigError, match=r"health\.validation\.live_prompts\.max_chars"):
        parse_config(_config({"max_chars": 5000}))  # over the agent's replay bound


def test_the_pool_validates_bounds_and_keeps_each_prompt_once():
    cfg = LivePromptsConfig(enabled=True, max_prompts=3, max_chars=10)
    pool = LivePromptPool()
    assert pool.offer("llm", "", cfg, KNOWN) == "empty"
    assert pool.offer("llm", "  \n", cfg, KNOWN) == "empty"
    assert pool.offer("llm", "x" * 11, cfg, KNOWN) == "too_long"
    assert pool.offer("llm", "bad \ud800", cfg, KNOWN) == "invalid_utf8"
    assert pool.offer("gone", "hello", cfg, KNOWN) == "unknown_cluster"
    for p in ("p1", "p2", "p3", "p4"):
        assert pool.offer("llm", p, cfg, KNOWN) is None
    assert pool.prompts("llm") == ["p2", "p3", "p4"]  # the oldest replaced
    assert pool.offer("llm", "p2", cfg, KNOWN) is None  # held already: the newest now, not twice
    assert pool.prompts("llm") == ["p3", "p4", "p2"]
    assert pool.offer(SHARED, "s1", cfg, KNOWN) is None and pool.offer(SHARED, "p3", cfg, KNOWN) is None
    assert pool.prompts("llm") == ["p3", "p4", "p2", "s1"]  # its own, then the shared pool's, each once
    assert pool.prompts("small") == ["s1", "p3"]
    assert pool.counts() == {"": 2, "llm": 3}
    smaller = LivePromptsConfig(enabled=True, max_prompts=2, max_chars=10)  # a reload lowers the bound
    assert pool.offer("llm", "p5", smaller, KNOWN) is None and pool.prompts("llm")[:2] == ["p2", "p5"]
    pool.forget({"small"})
    assert pool.counts() == {"": 2}


def test_a_validation_draws_its_share_live_only_when_the_pool_has_enough():
    pool = tuple(f"file{i}" for i in range(8))
    live = [f"live{i}" for i in range(10)]
    # share 0 or no live prompts: exactly the draw it made before live prompts existed
    for share, lv in ((0.0, live), (0.5, [])):
        got, n = draw_prompts(pool, lv, 8, share, random.Random(3))
        assert (got, n) == (random.Random(3).sample(pool, 8), 0)
    got, n = draw_prompts(pool, live, 8, 0.5, random.Random(1))
    assert n == 4 and len(got) == 8 and len(set(got)) == 8
    assert sum(p.startswith("live") for p in got) == 4
    got, n = draw_prompts(pool, live[:3], 8, 0.5, random.Random(1))  # 3 < round(0.5 x 8): none live
    assert n == 0 and all(p.startswith("file") for p in got)
    got, n = draw_prompts(pool, live, 3, 0.5, random.Random(1))  # 1.5 rounds half up: 2
    assert n == 2 and len(got) == 3
    got, n = draw_prompts(pool, live, 8, 1.0, random.Random(1))
    assert n == 8 and all(p.startswith("live") for p in got)
    got, n = draw_prompts(("same", "other"), ["same", "x"], 4, 0.5, random.Random(2))  # never twice
    assert n == 2 and sorted(got) == ["other", "same", "x"]


@given(pool=st.lists(st.text(min_size=1), min_size=1, max_size=20, unique=True),
       live=st.lists(st.text(min_size=1), max_size=20, unique=True),
       sample=st.integers(1, 64), share=st.floats(0, 1), seed=st.integers(0, 2**32))
def test_a_draw_never_repeats_a_prompt_nor_exceeds_the_sample(pool, live, sample, share, seed):
    got, n = draw_prompts(tuple(pool), live, sample, share, random.Random(seed))
    assert len(got) == len(set(got)) <= sample
    assert n <= len(live) and sum(p in live for p in got) >= n
    assert set(got) <= set(pool) | set(live)


class _Aborted(Exception):
    pass


class _Context:
    """What the handler reads of a grpc.aio.ServicerContext."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    def auth_context(self) -> dict:
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise _Aborted(details)


def _feed(cfg: dict) -> tuple[RoutingFeed, LivePromptPool]:
    pool = LivePromptPool()
    cp = SimpleNamespace(routing_listeners=[], config=parse_config(cfg))
    return RoutingFeed(cp, live_prompts=pool), pool


def _sample(*prompts: tuple[str, str]) -> routing_pb2.PromptSample:
    return routing_pb2.PromptSample(subscriber_id="relay-1", prompts=[
        routing_pb2.SampledPrompt(cluster=c, prompt=p) for c, p in prompts])


def _counts(feed: RoutingFeed) -> dict[str, float]:
    fam = next(f for f in feed.metrics() if f.name == "sentinel_live_prompts_submitted")
    return {s.labels["outcome"]: s.value for s in fam.samples if s.value}


async def test_submit_prompts_is_refused_while_live_prompts_are_off():
    feed, pool = _feed(_config())
    ack = await feed.SubmitPrompts(_sample(("llm", "secret one"), ("", "secret two")), _Context())
    assert (ack.accepted, ack.refused) == (0, 2) and pool.counts() == {}
    assert _counts(feed) == {"off": 2}


async def test_submit_prompts_keeps_valid_ones_and_bounds_the_call(caplog):
    caplog.set_level(logging.DEBUG)
    feed, pool = _feed(_config({"enabled": True, "max_chars": 20}))
    ack = await feed.SubmitPrompts(_sample(("llm", "secret alpha"), ("", "secret beta"), ("nope", "secret gamma"),
                                           ("llm", "x" * 21), ("llm", "")), _Context())
    assert (ack.accepted, ack.refused) == (2, 3)
    assert pool.prompts("llm") == ["secret alpha", "secret beta"]
    assert _counts(feed) == {"accepted": 2, "unknown_cluster": 1, "too_long": 1, "empty": 1}
    many = _sample(*((("llm", f"p{i}")) for i in range(MAX_PROMPTS_PER_CALL + 6)))
    ack = await feed.SubmitPrompts(many, _Context())
    assert (ack.accepted, ack.refused) == (MAX_PROMPTS_PER_CALL, 6)
    assert _counts(feed)["over_call_limit"] == 6 and pool.counts()["llm"] == 64
    gauge = next(f for f in feed.metrics() if f.name == "sentinel_live_prompts")
    assert {s.labels["cluster"]: s.value for s in gauge.samples} == {"": 1, "llm": 64}
    assert "secret" not in caplog.text


async def test_submit_prompts_follows_the_feeds_access_rule():
    feed, pool = _feed(_config({"enabled": True}, listen="0.0.0.0:18000"))  # plaintext off loopback, not said
    ctx = _Context()
    with pytest.raises(_Aborted, match=r"feed\.plaintext"):
        await feed.SubmitPrompts(_sample(("llm", "secret")), ctx)
    assert ctx.code is grpc.StatusCode.PERMISSION_DENIED and pool.counts() == {}
    assert feed.permission_denied_total == 1 and _counts(feed) == {"denied": 1}
