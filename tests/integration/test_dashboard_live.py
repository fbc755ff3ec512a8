"""The dashboard's server side: ``/`` and its static files (no external
resources), the ``/live`` Server-Sent Events feed (snapshot, events, a fault seen live), a slow
client dropped by its bounded queue, and a stop that ends open streams. Real aiohttp server over
a ControlPlane with in-memory probe sources."""
from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest
from admin_stack import healthy_admin_stack, three_node_admin_config

from xds_server.admin.app import json_dumps
from xds_server.admin.live import LiveFeed
from xds_server.config import parse_config
from xds_server.health import model as hm
from xds_server.probing.memory import InMemoryProbes
from xds_server.server import ControlPlane

TOKEN = "dash-s3cret-token"


def config() -> dict:
    return three_node_admin_config(TOKEN, live_interval_ms=100)


@pytest.fixture
async def admin():
    """(control plane, in-memory probes, base URL); every node HEALTHY."""
    async with healthy_admin_stack(config()) as stack:
        yield stack


async def sse_messages(resp: aiohttp.ClientResponse):
    """Yield (event, data) pairs from an SSE response."""
    kind, data = None, []
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and kind is not None:
            yield kind, json.loads("\n".join(data))
            kind, data = None, []


async def test_dashboard_page_and_static_files_are_served_with_nothing_from_outside(admin):
    _, _, base = admin
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/") as r:
            assert r.status == 200 and r.content_type == "text/html"
            html = await r.text()
        assert '<script src="/static/dashboard.js">' in html and "/static/dashboard.css" in html
        bodies = [html]
        for name, ctype in (("dashboard.js", "javascript"), ("dashboard.css", "text/css")):
            async with s.get(f"{base}/static/{name}") as r:
                assert r.status == 200 and ctype in r.content_type
                bodies.append(await r.text())
        async with s.get(f"{base}/static/../app.py") as r:
            assert r.status in (403, 404)
    urls = {u for b in bodies for u in re.findall(r"https?://[^\s\"'`)]+", b)}
    assert urls == {"http://www.w3.org/2000/svg"}  # an XML namespace, never fetched
    assert TOKEN not in "".join(bodies)


async def test_live_feed_sends_a_snapshot_then_a_node_turning_unhealthy(admin):
    cp, probes, base = admin
    async with aiohttp.ClientSession() as s, s.get(f"{base}/live") as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        msgs = sse_messages(r)
        backlog = []
        first = None
        async with asyncio.timeout(10):
            async for kind, data in msgs:
                if kind == "event":
                    backlog.append(data)
                elif first is None:
                    first = data  # the snapshot sent on connect
                if kind == "state" and data["clusters"][0]["routable"] == 3:
                    routed = data  # published (the coalescing window may hold the first publish)
                    break
        assert [n["id"] for n in first["nodes"]] == ["n0", "n1", "n2"]
        first = routed
        assert [n["id"] for n in first["nodes"]] == ["n0", "n1", "n2"]
        assert {n["state"] for n in first["nodes"]} <= {"PROBATION", "HEALTHY"}  # ramp starts at 100 %
        assert first["fail_static"] is False and first["clusters"][0]["routable"] == 3
        assert any(e["to"] == "PROBATION" and e["node"] == "n1" for e in backlog)
        before = cp.health["n1"].state.value
        for _ in range(2):  # 2 consecutive probe failures eject (seed 001)
            probes["n1"].probe(kind=hm.ProbeResultKind.TIMEOUT)
        assert cp.health["n1"].state is hm.NodeState.UNHEALTHY
        seen_event = None
        async with asyncio.timeout(5):
            async for kind, data in msgs:
                if kind == "event" and data["node"] == "n1" and data["to"] == "UNHEALTHY":
                    seen_event = data
                if kind == "state" and seen_event is not None:
                    n1 = next(n for n in data["nodes"] if n["id"] == "n1")
                    break
        assert seen_event["from"] == before and "probe" in seen_event["reason"].lower()
        assert n1["state"] == "UNHEALTHY" and n1["eds_health_status"] == "UNHEALTHY"
        # a failure in PROBATION doubles the clean period (60 s default, docs/DESIGN.md section 4)
        assert n1["probation"]["required_clean_s"] == (120.0 if before == "PROBATION" else 60.0)
        # and what it waits for before PROBATION, in words (the half-open rule's own checks)
        assert n1["probation"]["waiting_for"][0] == (
            f"no good probe since the last failure ({n1['probation']['required_clean_s']:g} s of them needed)")
    body = json.dumps([first, data, backlog])
    assert TOKEN not in body


async def test_a_client_that_does_not_read_is_dropped_when_its_queue_is_full(admin):
    cp, _, _ = admin
    feed = LiveFeed(cp.view, json_dumps)
    aborted: list[str] = []
    slow, fast = feed.subscribe(lambda: aborted.append("slow")), feed.subscribe(lambda: aborted.append("fast"))
    qmax = cp.config.admin.live_queue_max
    for _ in range(qmax):
        feed.tick()
        feed.book.take(fast, time.monotonic())  # the fast client keeps up
        feed.book.sent(fast)
    assert len(slow.queue) == qmax and slow.closed is None
    feed.tick()
    assert slow.closed == "slow" and slow.sid not in feed.book.subs and feed.dropped_total == 1
    assert aborted == ["slow"] and not slow.queue  # its socket closed; the browser reconnects
    assert fast.sid in feed.book.subs and len(fast.queue) == 1


async def test_stop_ends_open_live_streams_promptly():
    probes = InMemoryProbes()
    cp = ControlPlane(parse_config(config()), probe_sources=probes)
    await cp.start()
    stopped = False
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{cp.admin_port}/live") as r:
            await r.content.readline()
            t0 = time.monotonic()
            await cp.stop()
            stopped = True
            assert time.monotonic() - t0 < 5.0
            async with asyncio.timeout(5):
                rest = await r.content.read()
            assert isinstance(rest, bytes)
    finally:
        if not stopped:
            await cp.stop()


async def test_a_client_joining_does_not_hide_an_event_from_those_already_listening(admin):
    cp, probes, _ = admin
    feed = LiveFeed(cp.view, json_dumps)
    first = feed.subscribe(lambda: None)
    feed.tick()
    feed.book.take(first, time.monotonic())
    for _ in range(2):  # n2 ejected between two ticks
        probes["n2"].probe(kind=hm.ProbeResultKind.TIMEOUT)
    second = feed.subscribe(lambda: None)  # joins before the next tick
    feed.tick()
    for client in (first, second):
        got = [frame.decode().split("\n")[:2] for frame in feed.book.take(client, time.monotonic())]
        events = [json.loads(d.removeprefix("data: ")) for k, d in got if k == "event: event"]
        assert any(e["node"] == "n2" and e["to"] == "UNHEALTHY" for e in events)
        assert got[-1][0] == "event: state"
