"""Live prompt sampling end to end, with real processes: a ``sentinel-relay --sample-prompts 1.0``
whose routing feed is a real ``xds-server serve`` (``health.validation.live_prompts`` on) relays
completion and chat requests to an upstream that names a node of the control plane's cluster; the
control plane's live pool then holds those prompts under that cluster (its metrics say so), and no
prompt text appears in either process's log, at DEBUG."""
from __future__ import annotations

import sys
from pathlib import Path

import aiohttp
import yaml
from relay_fake_engine import engine_handler

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from bounded_support import prometheus_value

from xds_server.testing import ManagedProcess, free_port, wait_for

NODE = "127.0.0.1:8001"  # node a of cluster llm, as Envoy would name it in x-sentinel-upstream-host
SECRETS = ["w1 zebra-secret-one", "w2 zebra-secret-two", "w3 zebra-secret-three"]


async def _metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    try:
        async with http.get(url + "/metrics") as r:
            return prometheus_value(await r.text(), name, **labels)
    except aiohttp.ClientError:
        return -1.0


async def test_relay_samples_prompts_into_the_control_planes_live_pool(serve, tmp_path):
    engine = engine_handler(lambda _request: NODE)
    upstream = await serve({("POST", "/v1/completions"): engine, ("POST", "/v1/chat/completions"): engine})

    xds_port, admin_port, relay_port, relay_admin = free_port(), free_port(), free_port(), free_port()
    (tmp_path / "xds.yaml").write_text(yaml.safe_dump({
        "xds": {"listen": f"127.0.0.1:{xds_port}", "warmup_timeout_ms": 0},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "health": {"validation": {"enabled": True, "live_prompts": {"enabled": True}}},
        "clusters": [{"name": "llm", "nodes": [{"id": "a", "address": NODE,
                                                 "probe_address": f"127.0.0.1:{free_port()}"}]}]}))
    (tmp_path / "relay.yaml").write_text(yaml.safe_dump({"sample_interval_s": 0.3}))
    cp = ManagedProcess("xds-server", [sys.executable, "-m", "xds_server.cli", "--log-level", "DEBUG", "serve",
                                       str(tmp_path / "xds.yaml")],
                        tmp_path / "xds.log", ready_pattern="admin listening")
    relay = ManagedProcess("relay", [
        sys.executable, "-m", "sentinel_relay.cli", "--config", str(tmp_path / "relay.yaml"),
        "--listen", f"127.0.0.1:{relay_port}", "--upstream", upstream, "--routing-feed", f"127.0.0.1:{xds_port}",
        "--admin-listen", f"127.0.0.1:{relay_admin}", "--sample-prompts", "1.0", "--log-level", "DEBUG"],
        tmp_path / "relay.log", ready_pattern="sentinel-relay ready")
    cp_url, relay_url = f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{relay_admin}"
    try:
        cp.start()
        relay.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            await wait_for(lambda: _metric(http, relay_url, "sentinel_relay_feed_connected"), timeout_s=15.0,
                           what="the relay's routing feed")
            base = f"http://127.0.0.1:{relay_port}"
            for body in ({"prompt": SECRETS[0], "max_tokens": 3},
                         {"prompt": SECRETS[1], "max_tokens": 3, "stream": True}):
                async with http.post(base + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
            chat = {"messages": [{"role": "user", "content": SECRETS[2]}], "max_tokens": 3, "stream": True}
            async with http.post(base + "/v1/chat/completions", json=chat) as r:
                assert r.status == 200
                await r.read()

            async def pooled() -> bool:
                return await _metric(http, cp_url, "sentinel_live_prompts", cluster="llm") == len(SECRETS)
            await wait_for(pooled, timeout_s=15.0, what="the prompts in the control plane's live pool")
            assert await _metric(http, cp_url, "sentinel_live_prompts_submitted_total",
                                 outcome="accepted") == len(SECRETS)
            assert await _metric(http, relay_url, "sentinel_relay_prompts_sampled_total") == len(SECRETS)
            assert await _metric(http, relay_url, "sentinel_relay_prompts_sent_total",
                                 answer="accepted") == len(SECRETS)
            for url in (cp_url + "/nodes", cp_url + "/events"):
                async with http.get(url) as r:
                    assert "zebra-secret" not in await r.text(), url
    finally:
        relay.stop()
        cp.stop()
    for proc in (cp, relay):
        log = proc.log_path.read_text(encoding="utf-8", errors="replace")
        assert "DEBUG" in log, proc.name  # it did log at DEBUG meanwhile
        assert "zebra-secret" not in log, f"prompt text in the {proc.name} log"
