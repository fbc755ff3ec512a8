"""The relay's configuration (errors name the field) and its CLI, worker-per-core mode included
(N processes sharing the port with SO_REUSEPORT)."""
from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp
import pytest
from aiohttp import web
from relay_fake_engine import generate, parse_client

from sentinel_relay.config import RelayConfigError, load_relay_config
from xds_server.testing import ManagedProcess, free_port


def test_config_defaults_yaml_and_flags(tmp_path):
    f = tmp_path / "relay.yaml"
    f.write_text("listen: 127.0.0.1:9000\nmax_rescues: 3\nstall_gap_s: 1.5\n")
    cfg = load_relay_config(f, max_rescues=1, upstream=None)
    assert (cfg.listen, cfg.max_rescues, cfg.stall_gap_s) == ("127.0.0.1:9000", 1, 1.5)
    assert cfg.upstream == "http://127.0.0.1:10000" and cfg.max_resume_tokens == 8192


def test_routing_feed_takes_one_address_or_the_replicas():
    assert load_relay_config(routing_feed="127.0.0.1:18000").routing_feed == ["127.0.0.1:18000"]
    both = ["127.0.0.1:18000", "127.0.0.1:18001"]
    assert load_relay_config(routing_feed="127.0.0.1:18000, 127.0.0.1:18001").routing_feed == both
    assert load_relay_config(routing_feed=["127.0.0.1:18000", "127.0.0.1:18001"]).routing_feed == both  # flags
    with pytest.raises(RelayConfigError, match=r"routing_feed: .*expected HOST:PORT, got 'nowhere'"):
        load_relay_config(routing_feed=["127.0.0.1:18000", "nowhere"])
    with pytest.raises(RelayConfigError, match=r"routing_feed: .*no HOST:PORT"):
        load_relay_config(routing_feed=" , ")
    with pytest.raises(RelayConfigError, match=r"routing_feed 10\.0\.0\.2:18000 is not a loopback address"):
        load_relay_config(routing_feed="127.0.0.1:18000,10.0.0.2:18000")  # each replica is checked


@pytest.mark.parametrize("text,field", [
    ("stall_gap_s: -1\n", "stall_gap_s"),
    ("listen: nowhere\n", "listen"),
    ("upstream: 127.0.0.1:10000\n", "upstream"),
    ("max_rescue: 2\n", "max_rescue"),
    ("- a\n", "mapping"),
    ("a: [\n", "relay.yaml"),
])
def test_config_errors_name_the_field(tmp_path, text, field):
    f = tmp_path / "relay.yaml"
    f.write_text(text)
    with pytest.raises(RelayConfigError, match=field):
        load_relay_config(f)


async def test_cli_workers_share_the_port_and_stop_on_sigterm(serve, tmp_path):
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        sse, _ = generate("completions", body, rid="r")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse)
        return resp
    base = await serve({("POST", "/v1/completions"): handle})
    port = free_port()
    relay = ManagedProcess("relay", [sys.executable, "-m", "sentinel_relay.cli", "--listen",
                                     f"127.0.0.1:{port}", "--upstream", base, "--workers", "2",
                                     "--admin-listen", f"127.0.0.1:{free_port()}"],
                           tmp_path / "relay.log", ready_pattern="ready on").start()
    try:
        assert "(2 worker(s))" in relay.output_tail()
        body = {"prompt": "w1", "max_tokens": 5, "stream": True}

        async def one() -> dict:
            async with aiohttp.ClientSession() as s:  # new connection each: spread by the kernel
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    return parse_client(await r.read())
        got = await asyncio.gather(*(one() for _ in range(8)))
        assert all(g["dones"] == 1 and len(g["text"]) > 0 for g in got)
        relay.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(relay.proc.wait, 10) == 0
    finally:
        relay.stop()
