"""The relay's connections are bounded (sentinel_relay/connections.py), against
a real ``sentinel-relay`` process in front of a real aiohttp upstream.

- 2,000 slowloris connections (an unfinished request head, then nothing) are closed by
  ``header_timeout_s`` while a normal request is served through the relay meanwhile (fewer when
  this process's open-file limit is lower: it holds the client ends);
- a body dripping one byte a second gets 408 at ``body_timeout_s``;
- a client gone mid-body is one log line, no traceback;
- at ``max_connections`` a new connection evicts the one idle longest (a normal request still
  gets in), and an idle kept-alive connection is closed after ``keepalive_timeout_s``.
"""
from __future__ import annotations

import asyncio
import resource
import socket
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from bounded_support import closed_by_peer, prometheus_value, slowloris

from xds_server.testing import ManagedProcess, free_port, wait_for

SLOWLORIS = 2000


def relay(tmp_path: Path, upstream: str, **cfg: object) -> tuple[ManagedProcess, int, int]:
    """A started relay (config fields in ``cfg``); (process, port, admin port)."""
    port, admin = free_port(), free_port()
    (tmp_path / "relay.yaml").write_text(yaml.safe_dump(
        {"listen": f"127.0.0.1:{port}", "upstream": upstream, "admin_listen": f"127.0.0.1:{admin}", **cfg}))
    proc = ManagedProcess("relay", [sys.executable, "-m", "sentinel_relay.cli", "--config",
                                    str(tmp_path / "relay.yaml")], tmp_path / "relay.log", ready_pattern="ready")
    return proc.start(), port, admin


@pytest.fixture
async def upstream(serve):
    async def completion(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"id": "r1", "object": "text_completion", "model": body.get("model"),
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]},
                                 headers={"x-sentinel-upstream-host": "127.0.0.1:1"})
    return await serve({("POST", "/v1/completions"): completion})


async def complete(base: str) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        async with s.post(f"{base}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
            await r.read()
            return r.status


async def closed_counts(admin: int) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{admin}/metrics") as r:
        text = await r.text()
    return {reason: prometheus_value(text, "sentinel_relay_connections_closed_total", reason=reason)
            for reason in ("header_timeout", "body_timeout", "evicted", "refused", "client_gone")} | {
        "open": prometheus_value(text, "sentinel_relay_connections")}


async def test_slowloris_connections_are_closed_by_the_header_timeout_and_a_request_is_served(tmp_path, upstream):
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = min(SLOWLORIS, soft - 200)   # this process holds the client ends: fewer under a low fd limit
    proc, port, admin = relay(tmp_path, upstream, header_timeout_s=5.0)
    socks: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        for _ in range(n):
            socks.append(slowloris(port))
        connected_s = time.monotonic() - t0
        assert (await closed_counts(admin))["open"] >= n / 2
        assert await complete(f"http://127.0.0.1:{port}") == 200   # served meanwhile
        await wait_for(lambda: _seen_at_least(admin, n), timeout_s=20, what=f"{n} slowloris connections accepted")
        closed = await asyncio.gather(*(asyncio.to_thread(closed_by_peer, s, 15.0) for s in socks))
        print(f"\n{n} slowloris: connected in {connected_s:.1f} s, all closed {time.monotonic() - t0:.1f} s after "
              f"the first connect (header_timeout_s 5)")
        assert all(closed)
        counts = await closed_counts(admin)
        assert counts["header_timeout"] == n and counts["evicted"] == counts["refused"] == 0, counts
        assert (await closed_counts(admin))["open"] == 0
    finally:
        for s in socks:
            s.close()
        proc.stop()


async def _seen_at_least(admin: int, n: int) -> bool:
    c = await closed_counts(admin)
    return c["open"] + c["header_timeout"] >= n



async def test_a_dripping_body_gets_408_and_a_client_gone_mid_body_one_log_line(tmp_path, upstream):
    proc, port, admin = relay(tmp_path, upstream, body_timeout_s=2.0)
    try:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{")
        drip = socket.create_connection(("127.0.0.1", port))
        drip.sendall(head)
        t0 = time.monotonic()
        answer = b""
        drip.settimeout(0.5)
        while time.monotonic() - t0 < 10 and b"\r\n\r\n" not in answer:
            try:
                drip.sendall(b" ")   # one byte a second
                answer += drip.recv(4096)
            except TimeoutError:
                await asyncio.sleep(0.5)
            except OSError:
                break
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert closed_by_peer(drip)
        drip.close()
        for _ in range(5):   # five clients leave mid-body
            gone = socket.create_connection(("127.0.0.1", port))
            gone.sendall(head)
            await asyncio.sleep(0.1)
            gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            gone.close()   # reset
        await wait_for(lambda: _counted(admin, "client_gone", 5), timeout_s=10, what="5 clients gone counted")
        assert await complete(f"http://127.0.0.1:{port}") == 200
        log = proc.log_path.read_text()
        assert "Traceback" not in log and "ConnectionResetError" not in log.replace("(ConnectionResetError)", "")
        assert log.count("client went away mid-body") == 1, log   # rate-limited: one line
        assert log.count("request body not whole within 2.0 s") == 1
    finally:
        proc.stop()


async def _counted(admin: int, reason: str, n: int) -> bool:
    return (await closed_counts(admin))[reason] >= n


async def test_at_the_cap_the_oldest_idle_connection_makes_room_and_idle_keepalive_is_closed(tmp_path, upstream):
    proc, port, admin = relay(tmp_path, upstream, max_connections=20, keepalive_timeout_s=2.0,
                              header_timeout_s=30.0)
    socks: list[socket.socket] = []
    try:
        socks = [slowloris(port) for _ in range(30)]   # 10 more than the cap: the 10 oldest go
        await wait_for(lambda: _counted(admin, "evicted", 10), timeout_s=10, what="10 evicted")
        assert all(await asyncio.gather(*(asyncio.to_thread(closed_by_peer, s, 5.0) for s in socks[:10])))
        assert await complete(f"http://127.0.0.1:{port}") == 200   # evicts one more, served
        counts = await closed_counts(admin)
        assert counts["evicted"] == 11 and counts["open"] <= 20, counts
        # a kept-alive connection idle past keepalive_timeout_s is closed (the upstream runs on
        # this event loop: the blocking socket calls go to a thread)
        answer, idle_s = await asyncio.to_thread(_one_request_then_idle, port)
        assert answer.startswith(b"HTTP/1.1 200") and idle_s is not None and 1.0 < idle_s < 8.0, (answer, idle_s)
    finally:
        for s in socks:
            s.close()
        proc.stop()


def _one_request_then_idle(port: int) -> tuple[bytes, float | None]:
    """One request on a kept-alive connection: (the answer's start, s until the relay closed it idle)."""
    kept = socket.create_connection(("127.0.0.1", port))
    try:
        body = b'{"model":"m","prompt":"hi","max_tokens":2}'
        kept.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        kept.settimeout(5)
        answer = kept.recv(65536)
        t0 = time.monotonic()
        return answer, (time.monotonic() - t0 if closed_by_peer(kept, 10.0) else None)
    finally:
        kept.close()
