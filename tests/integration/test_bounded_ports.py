"""The admin's ``/live`` feed and the routing feed are bounded.

Against a real ``xds-server serve`` process (its RSS and fds read from /proc): 500 ``/live``
clients that connect and never read (4 KiB receive buffers) are disconnected within the write
timeout, memory and fds come back, ``/nodes`` answers meanwhile; 500 routing-feed subscribers
that never read (a 0-byte HTTP/2 stream window, so not one byte of an update can go) are dropped
by the send deadline while a good subscriber keeps being served. In-process: the caps (503,
RESOURCE_EXHAUSTED), the plaintext rule off loopback and the mTLS allow-list of subscribers.
Latency figures are printed (-s) and kept in benchmarks/RESULTS.md (benchmarks/bounded_ports.py).
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml
from admin_stack import healthy_admin_stack, three_node_admin_config
from bounded_support import H2Keeper, closed_by_peer, open_fds, prometheus_value, rss_mb, stuck_h2_watch, stuck_http_get

from xds_server.config import ConfigError, parse_config
from xds_server.probing.memory import InMemoryProbes
from xds_server.process.tls import ClientTls, dial
from xds_server.proto import routing_pb2, routing_pb2_grpc
from xds_server.server import ControlPlane
from xds_server.testing import ManagedProcess, TestCA, free_port, wait_for

TOKEN = "bounded-ports-token"
STUCK = 500


def serve(tmp_path: Path, admin: dict | None = None, feed: dict | None = None, nodes: int = 3,
          keepalive_s: float = 10.0) -> tuple[
        ManagedProcess, int, int]:
    """A started ``xds-server serve`` (agents never there: probe addresses are closed ports);
    (process, admin port, xds port). The caller stops it."""
    xds_port, admin_port = free_port(), free_port()
    cfg = {
        # keepalive: a client that reads nothing acks no ping; its connection ends 1 s after one
        "xds": {"listen": f"127.0.0.1:{xds_port}", "warmup_timeout_ms": 0,
                "keepalive_time_ms": round(keepalive_s * 1000), "keepalive_timeout_ms": 1000},
        "admin": {"listen": f"127.0.0.1:{admin_port}", "token": TOKEN, **(admin or {})},
        "feed": feed or {},
        "health": {"reconnect_backoff_initial_ms": 1000, "reconnect_backoff_max_ms": 5000},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.1:{8001 + i}", "probe_address": f"127.0.0.1:{free_port()}"}
            for i in range(nodes)]}],
    }
    (tmp_path / "xds.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    proc = ManagedProcess("xds-server", [sys.executable, "-m", "xds_server.cli", "serve", "--config",
                                         str(tmp_path / "xds.yaml")], tmp_path / "server.log",
                          ready_pattern="admin listening")
    return proc.start(), admin_port, xds_port


async def metric(http: aiohttp.ClientSession, admin_port: int, name: str, **labels: str) -> float:
    async with http.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
        return prometheus_value(await r.text(), name, **labels)


async def nodes_latencies_ms(http: aiohttp.ClientSession, admin_port: int, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with http.get(f"http://127.0.0.1:{admin_port}/nodes") as r:
            assert r.status == 200
            assert len((await r.json())["nodes"]) == 3
        out.append((time.perf_counter() - t0) * 1000)
    return out


def p99(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.99 * len(values)) - 1)]


async def test_500_stuck_live_readers_are_disconnected_and_memory_comes_back(tmp_path):
    proc, admin_port, _ = serve(tmp_path, admin={"live_write_timeout_s": 2.0, "live_interval_ms": 100,
                                                 "live_max_clients": 1000})
    socks = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            # warm: one reader that reads, and the JSON views
            async with http.get(f"http://127.0.0.1:{admin_port}/live") as r:
                for _ in range(6):
                    await r.content.readline()
            alone = await nodes_latencies_ms(http, admin_port, 50)
            await wait_for(lambda: _zero(http, admin_port), timeout_s=10, what="the warm-up reader gone")
            rss0, fds0 = rss_mb(proc.pid), open_fds(proc.pid)
            for wave in (1, 2):   # a second wave: what stays after the first is reused, not added to
                socks = [stuck_http_get(admin_port) for _ in range(STUCK)]
                await wait_for(lambda: _at_least(http, admin_port, "sentinel_admin_live_clients", 1), timeout_s=10,
                               what="stuck readers connected")
                beside = await nodes_latencies_ms(http, admin_port, 50)   # while they are connected
                peak = rss_mb(proc.pid)

                async def all_dropped(n: int = wave * STUCK) -> bool:
                    d = sum([await metric(http, admin_port, "sentinel_admin_live_dropped_total", reason=r)
                             for r in ("slow", "deadline")])
                    return d >= n and await metric(http, admin_port, "sentinel_admin_live_clients") == 0
                await wait_for(all_dropped, timeout_s=60, what=f"{STUCK} stuck /live readers disconnected")
                assert all(await asyncio.gather(*(asyncio.to_thread(closed_by_peer, s) for s in socks)))
                for s in socks:
                    s.close()
                await asyncio.sleep(1.0)
                rss1, fds1 = rss_mb(proc.pid), open_fds(proc.pid)
                print(f"\n/live x{STUCK} stuck, wave {wave}: RSS {rss0:.1f} -> peak {peak:.1f} -> {rss1:.1f} MB, "
                      f"fds {fds0} -> {fds1}; /nodes p50/p99 alone {statistics.median(alone):.1f}/{p99(alone):.1f} "
                      f"ms, beside {statistics.median(beside):.1f}/{p99(beside):.1f} ms")
                assert rss1 <= rss0 + 20.0
                assert fds1 <= fds0 + 5
            assert await metric(http, admin_port, "sentinel_admin_live_dropped_total", reason="deadline") > 0
    finally:
        for s in socks:
            s.close()
        proc.stop()


async def _zero(http: aiohttp.ClientSession, admin_port: int) -> bool:
    return await metric(http, admin_port, "sentinel_admin_live_clients") == 0


async def _at_least(http: aiohttp.ClientSession, admin_port: int, name: str, n: float) -> bool:
    return await metric(http, admin_port, name) >= n


class Subscriber:
    """A good feed subscriber: reads every update, notes when each node change arrived."""

    def __init__(self, port: int, tls: ClientTls | None = None) -> None:
        self.channel = dial(f"127.0.0.1:{port}", tls=tls)
        self.call = routing_pb2_grpc.RoutingFeedStub(self.channel).Watch(
            routing_pb2.WatchRequest(subscriber_id="good"))

    async def next(self, timeout_s: float = 10.0) -> routing_pb2.RoutingUpdate:
        upd = await asyncio.wait_for(self.call.read(), timeout_s)
        assert upd is not grpc.aio.EOF
        return upd

    async def until(self, node: str, pred, timeout_s: float = 10.0) -> None:
        """Read updates until one carries ``node`` in a state ``pred`` accepts."""
        async with asyncio.timeout(timeout_s):
            while True:
                upd = await self.next(timeout_s)
                if any(n.node_id == node and pred(n.state) for n in upd.nodes):
                    return

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


async def drain_latency_ms(http: aiohttp.ClientSession, admin_port: int, sub: Subscriber, node: str) -> float:
    """Drain then undrain ``node`` through the admin; ms until the subscriber saw DRAINING."""
    hdr = {"Authorization": f"Bearer {TOKEN}"}
    t0 = time.perf_counter()
    async with http.post(f"http://127.0.0.1:{admin_port}/nodes/{node}/drain", headers=hdr) as r:
        assert r.status == 200
    await sub.until(node, lambda s: s == "DRAINING")
    ms = (time.perf_counter() - t0) * 1000
    async with http.post(f"http://127.0.0.1:{admin_port}/nodes/{node}/undrain", headers=hdr) as r:
        assert r.status == 200
    await sub.until(node, lambda s: s != "DRAINING")
    return ms


async def test_500_stuck_feed_subscribers_are_dropped_by_the_deadline_and_a_good_one_is_served(tmp_path):
    proc, admin_port, xds_port = serve(tmp_path, feed={"send_timeout_s": 2.0, "max_subscribers": 1000})
    socks = []
    good = Subscriber(xds_port)
    keeper = H2Keeper()
    keeper.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            assert (await good.next()).snapshot
            alone = [await drain_latency_ms(http, admin_port, good, f"n{i % 3}") for i in range(10)]
            socks = [keeper.add(stuck_h2_watch(xds_port, f"stuck-{i}")) for i in range(STUCK)]
            await wait_for(lambda: _at_least(http, admin_port, "sentinel_routing_feed_subscriptions_total", STUCK + 1),
                           timeout_s=20, what="stuck subscribers joined")
            beside = [await drain_latency_ms(http, admin_port, good, f"n{i % 3}") for i in range(10)]

            async def all_dropped() -> bool:
                return await metric(http, admin_port, "sentinel_routing_feed_dropped_total", reason="deadline") >= STUCK
            await wait_for(all_dropped, timeout_s=30, what=f"{STUCK} stuck subscribers dropped by the deadline")
            assert await metric(http, admin_port, "sentinel_routing_feed_subscribers") == 1   # the good one
            after = [await drain_latency_ms(http, admin_port, good, f"n{i % 3}") for i in range(10)]
            # gRPC cannot take back a write its transport holds: each keeps its place under the cap
            # until its connection ends (these answer pings, so keepalive keeps them)
            assert await metric(http, admin_port, "sentinel_routing_feed_closing") == STUCK
            rss = rss_mb(proc.pid)
            keeper.stop()
            for s in socks:
                s.close()
            await wait_for(lambda: _closing_zero(http, admin_port), timeout_s=30, what="places under the cap back")
            print(f"\nfeed x{STUCK} stuck: good subscriber's drain->DRAINING p50 alone "
                  f"{statistics.median(alone):.1f} ms, beside {statistics.median(beside):.1f} ms, after the "
                  f"drop {statistics.median(after):.1f} ms; RSS {rss:.1f} MB with them, "
                  f"{rss_mb(proc.pid):.1f} MB after")
    finally:
        keeper.stop()
        await good.close()
        for s in socks:
            s.close()
        proc.stop()


async def _closing_zero(http: aiohttp.ClientSession, admin_port: int) -> bool:
    return await metric(http, admin_port, "sentinel_routing_feed_closing") == 0


# ------------------------------------------------------------------------------ in-process


async def test_live_clients_past_the_cap_get_a_clear_503_and_are_counted():
    async with healthy_admin_stack(three_node_admin_config(TOKEN, live_max_clients=2)) as (_cp, _, base):
        async with aiohttp.ClientSession() as s:
            a, b = await s.get(f"{base}/live"), await s.get(f"{base}/live")
            try:
                assert a.status == b.status == 200
                async with s.get(f"{base}/live") as c:
                    assert c.status == 503 and c.headers["Retry-After"] == "5"
                    assert "admin.live_max_clients" in (await c.json())["error"]
                async with s.get(f"{base}/metrics") as m:
                    text = await m.text()
                assert prometheus_value(text, "sentinel_admin_live_clients") == 2
                assert prometheus_value(text, "sentinel_admin_live_refused_total") == 1
                # the refused connection is closed too (a client that never reads holds no fd)
                port = int(base.rpartition(":")[2])
                refused = stuck_http_get(port)
                try:
                    assert await asyncio.to_thread(closed_by_peer, refused)
                finally:
                    refused.close()
            finally:
                a.close()
                b.close()


def _cp_config(**over) -> dict:
    cfg = three_node_admin_config(TOKEN)
    cfg.update(over)
    return cfg


async def _watch_code(port: int, tls: ClientTls | None = None) -> grpc.StatusCode | routing_pb2.RoutingUpdate:
    async with dial(f"127.0.0.1:{port}", tls=tls) as ch:
        call = routing_pb2_grpc.RoutingFeedStub(ch).Watch(routing_pb2.WatchRequest(subscriber_id="t"))
        try:
            return await asyncio.wait_for(call.read(), 10)
        except grpc.aio.AioRpcError as e:
            return e.code()


async def test_feed_subscribers_past_the_cap_are_resource_exhausted():
    async with healthy_admin_stack(_cp_config(feed={"max_subscribers": 1})) as (cp, _, _base):
        first = Subscriber(cp.xds_port)
        try:
            assert (await first.next()).snapshot
            assert await _watch_code(cp.xds_port) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert cp.routing_feed.book.refused_total == 1
        finally:
            await first.close()


async def test_plaintext_feed_off_loopback_must_be_said():
    port = free_port()
    base = {"xds": {"listen": f"0.0.0.0:{port}", "warmup_timeout_ms": 0}, "tls": {"mode": "plaintext"}}
    async with healthy_admin_stack(_cp_config(**base)) as (cp, _, _b):
        assert await _watch_code(cp.xds_port) == grpc.StatusCode.PERMISSION_DENIED
        assert cp.routing_feed.permission_denied_total == 1
    base["xds"]["listen"] = f"0.0.0.0:{free_port()}"
    async with healthy_admin_stack(_cp_config(**base, feed={"plaintext": True})) as (cp, _, _b):
        assert (await _watch_code(cp.xds_port)).snapshot
    with pytest.raises(ConfigError, match=r"feed.plaintext is used with tls.mode plaintext only"):
        parse_config(_cp_config(feed={"plaintext": True}))
    with pytest.raises(ConfigError, match=r"feed.allow_identities is used with tls.mode mtls only"):
        parse_config(_cp_config(feed={"allow_identities": ["spiffe://*"]}))


async def test_mtls_feed_serves_only_allowed_identities(tmp_path):
    ca = TestCA(tmp_path / "pki", "ca")
    server = ca.issue("xds", dns=["xds.test"], ips=["127.0.0.1"])
    relay = ca.issue("relay", uris=["spiffe://cluster.local/ns/llm/sa/relay"], client=True)
    envoy = ca.issue("envoy", uris=["spiffe://cluster.local/ns/llm/sa/envoy"], client=True)
    cfg = _cp_config(tls={"mode": "mtls", "cert_file": server.cert, "key_file": server.key,
                          "client_ca_file": ca.cert},
                     feed={"allow_identities": ["spiffe://cluster.local/ns/llm/sa/relay"]})
    cp = ControlPlane(parse_config(cfg), probe_sources=InMemoryProbes())
    await cp.start()
    try:
        ok = await _watch_code(cp.xds_port, ClientTls(ca.cert, relay.cert, relay.key, "xds.test"))
        assert isinstance(ok, routing_pb2.RoutingUpdate) and ok.snapshot
        denied = await _watch_code(cp.xds_port, ClientTls(ca.cert, envoy.cert, envoy.key, "xds.test"))
        assert denied == grpc.StatusCode.PERMISSION_DENIED
        assert cp.routing_feed.permission_denied_total == 1
    finally:
        await cp.stop()
