"""Issue 27 items 1-3, the attacks on each port with the shipped defaults, as figures for
benchmarks/RESULTS.md (tests/integration/test_bounded_ports.py and tests/relay/test_relay_bounds.py
assert the behaviour with short timeouts).

- ``live``: a real ``xds-server`` (``--nodes`` static nodes, agents absent), ``--clients`` GET /live
  connections with 4 KiB receive buffers that never read: RSS before / while / after they are
  disconnected, time until all are, ``/nodes`` p50/p99 alone and beside them.
- ``feed``: ``--clients`` RoutingFeed/Watch streams whose window never opens (their HTTP/2 layer
  answers pings): time until the send deadline drops them all, a good subscriber's drain ->
  DRAINING latency alone, beside them and after.
- ``relay``: a real ``sentinel-relay`` in front of an aiohttp upstream, ``--slowloris``
  connections with an unfinished head: a normal request's latency alone and beside them, time
  until all are closed.

    .venv/bin/python benchmarks/bounded_ports.py [live feed relay] [--clients 500] [--slowloris 2000]
        [--nodes 50]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "relay"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from bounded_support import H2Keeper, closed_by_peer, open_fds, rss_mb, slowloris, stuck_h2_watch, stuck_http_get
from test_bounded_ports import Subscriber, drain_latency_ms, metric, serve
from test_relay_bounds import closed_counts, relay


def p(values: list[float], q: float) -> float:
    return sorted(values)[max(0, round(q * len(values)) - 1)]


def ms(values: list[float]) -> str:
    return f"p50 {statistics.median(values):.1f} / p99 {p(values, 0.99):.1f} ms"


async def nodes_ms(http: aiohttp.ClientSession, port: int, n: int = 200) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with http.get(f"http://127.0.0.1:{port}/nodes") as r:
            await r.read()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def live(a: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bounded-live-"))
    proc, admin, _ = serve(tmp, nodes=a.nodes)
    try:
        async with aiohttp.ClientSession() as http:
            await nodes_ms(http, admin, 20)   # warm-up, not counted
            alone = await nodes_ms(http, admin)
            rss0 = rss_mb(proc.pid)
            t0 = time.monotonic()
            socks = [stuck_http_get(admin) for _ in range(a.clients)]
            beside = await nodes_ms(http, admin)
            peak = rss_mb(proc.pid)
            async def dropped() -> float:
                return sum([await metric(http, admin, "sentinel_admin_live_dropped_total", reason=r)
                            for r in ("slow", "deadline")])
            while (await dropped() + await metric(http, admin, "sentinel_admin_live_refused_total") < a.clients
                   or await metric(http, admin, "sentinel_admin_live_clients") > 0) \
                    and time.monotonic() - t0 < 120:
                peak = max(peak, rss_mb(proc.pid))
                await asyncio.sleep(0.2)
            gone_s = time.monotonic() - t0
            await asyncio.sleep(1.0)
            refused = await metric(http, admin, "sentinel_admin_live_refused_total")
            print(f"live: {a.clients} stuck readers, {a.nodes} nodes: all disconnected by the server {gone_s:.1f} s "
                  f"after the first connect ({await dropped():.0f} dropped, {refused:.0f} refused with 503 past "
                  f"admin.live_max_clients); fds {open_fds(proc.pid)}; RSS {rss0:.1f} -> peak {peak:.1f} -> "
                  f"{rss_mb(proc.pid):.1f} MB; /nodes {ms(alone)} alone, {ms(beside)} beside them", flush=True)
            for s in socks:
                s.close()
    finally:
        proc.stop()


async def feed(a: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bounded-feed-"))
    proc, admin, xds = serve(tmp, nodes=a.nodes, keepalive_s=30.0)
    good = Subscriber(xds)
    keeper = H2Keeper()
    keeper.start()
    try:
        async with aiohttp.ClientSession() as http:
            await good.next()
            for i in range(10):   # warm-up, not counted
                await drain_latency_ms(http, admin, good, f"n{i % a.nodes}")
            alone = [await drain_latency_ms(http, admin, good, f"n{i % a.nodes}") for i in range(30)]
            rss0 = rss_mb(proc.pid)
            t0 = time.monotonic()
            socks = [keeper.add(stuck_h2_watch(xds, f"stuck-{i}")) for i in range(a.clients)]
            beside = [await drain_latency_ms(http, admin, good, f"n{i % a.nodes}") for i in range(30)]
            rss1 = rss_mb(proc.pid)
            while (await metric(http, admin, "sentinel_routing_feed_dropped_total", reason="deadline") < a.clients
                   and time.monotonic() - t0 < 120):
                await asyncio.sleep(0.2)
            dropped_s = time.monotonic() - t0
            after = [await drain_latency_ms(http, admin, good, f"n{i % a.nodes}") for i in range(30)]
            print(f"feed: {a.clients} stuck subscribers: all dropped by the send deadline {dropped_s:.1f} s after "
                  f"the first connect; RSS {rss0:.1f} -> {rss1:.1f} MB with them; good subscriber drain->DRAINING "
                  f"{ms(alone)} alone, {ms(beside)} beside them, {ms(after)} after the drop", flush=True)
            keeper.stop()
            for s in socks:
                s.close()
    finally:
        keeper.stop()
        await good.close()
        proc.stop()


async def relayed(a: argparse.Namespace) -> None:
    async def completion(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "r", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})
    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    tmp = Path(tempfile.mkdtemp(prefix="bounded-relay-"))
    proc, port, admin = relay(tmp, f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        async with aiohttp.ClientSession() as http:
            async def one() -> float:
                t0 = time.perf_counter()
                body = {"model": "m", "prompt": "x"}
                async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    await r.read()
                    assert r.status == 200
                return (time.perf_counter() - t0) * 1000
            alone = [await one() for _ in range(100)]
            t0 = time.monotonic()
            socks = await asyncio.to_thread(lambda: [slowloris(port) for _ in range(a.slowloris)])
            connect_s = time.monotonic() - t0
            beside = [await one() for _ in range(100)]
            closed = sum(await asyncio.gather(*(asyncio.to_thread(closed_by_peer, s, 30.0) for s in socks)))
            print(f"relay: {a.slowloris} slowloris connected in {connect_s:.1f} s, {closed} closed by the relay "
                  f"{time.monotonic() - t0:.1f} s after the first (header_timeout_s 10); {await closed_counts(admin)}; "
                  f"a normal request {ms(alone)} alone, {ms(beside)} beside them", flush=True)
            for s in socks:
                s.close()
    finally:
        proc.stop()
        await runner.cleanup()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("only", nargs="*", default=["live", "feed", "relay"], choices=["live", "feed", "relay"])
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--slowloris", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=50)
    args = ap.parse_args()
    for name in args.only:
        asyncio.run({"live": live, "feed": feed, "relay": relayed}[name](args))
