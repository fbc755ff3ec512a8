"""The dashboard in a real headless Chromium when the control plane refuses its live feed: with
``admin.live_max_clients`` open (here 2, held by raw TCP clients that read their stream), ``GET
/live`` answers 503, and the page says so in a visible notice with its retry countdown instead of
going quiet (EventSource gave up for good on a 503). Once the raw clients leave, the page
connects again by itself, re-reads /history and renders live snapshots again."""
from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from admin_stack import healthy_admin_stack, three_node_admin_config
from bounded_support import prometheus_value
from headless import HeadlessChromium, find_chromium

from xds_server.testing import wait_for

TOKEN = "paused-s3cret-token"
NOTICE_JS = ("(n => n ? JSON.stringify({hidden: n.hidden, text: n.textContent, reason: n.dataset.reason, "
             "conn: document.getElementById('conn').textContent}) : '{}')(document.getElementById('live-notice'))")
ROWS_JS = "document.querySelectorAll('tr[data-node]').length"
SPARK_JS = "JSON.stringify([...document.querySelectorAll('svg.spark polyline')].map(p => p.points.numberOfItems))"


class Reader:
    """A raw TCP ``GET /live`` that reads (and discards) everything, so the feed keeps it."""

    async def open(self, port: int) -> Reader:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.writer.write(f"GET /live HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: text/event-stream\r\n\r\n"
                          .encode())
        await self.writer.drain()
        self.head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        self.task = asyncio.create_task(self._drain())
        return self

    async def _drain(self) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while await self.reader.read(65536):
                pass

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


async def test_dashboard_shows_a_refused_live_feed_and_resumes_by_itself(tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium binary (/usr/bin/chromium): .ci/run installs Debian's chromium package")
    cfg = three_node_admin_config(TOKEN, live_max_clients=2, live_interval_ms=250, history_interval_ms=250)
    async with healthy_admin_stack(cfg) as (cp, _probes, base):
        readers: list[Reader] = []
        try:
            for _ in range(2):  # the cap, filled
                readers.append(await Reader().open(cp.admin_port))
            assert all(b" 200 " in r.head.split(b"\r\n")[0] for r in readers)
            async with HeadlessChromium(chromium) as browser:
                await browser.navigate(f"{base}/")

                async def shown() -> dict | None:
                    n = json.loads(await browser.evaluate(NOTICE_JS) or "{}")
                    return n if n and not n["hidden"] else None  # {}: the page not loaded yet

                paused = await wait_for(shown, timeout_s=15, step_s=0.1,
                                        what=lambda: f"the paused notice; console: {browser.console[-5:]}")
                assert paused["reason"] == "refused" and paused["conn"] == "paused", paused
                assert paused["text"].startswith(
                    "live updates paused: the control plane refused (503, too many dashboards?) - retrying in "), paused
                assert paused["text"].endswith(" s")
                assert 1 <= int(paused["text"].rsplit(" ", 2)[1]) <= 30, paused
                assert await browser.evaluate(ROWS_JS) == 0  # nothing rendered from a refused feed
                await asyncio.sleep(7)  # past its first retry (Retry-After 5 s): refused again, still said
                assert (await shown() or {}).get("reason") == "refused"

                for r in readers:   # the cap frees up: the page connects again by itself
                    await r.close()
                readers.clear()

                async def resumed() -> dict | None:
                    n = json.loads(await browser.evaluate(NOTICE_JS) or "{}")
                    rows = await browser.evaluate(ROWS_JS)
                    return n if n.get("hidden") and n.get("conn") == "live" and rows == 3 else None

                # Retry-After 5 s and 1 s doubling, +-25 %: back within ~10 s; 45 s for 2 slow cores
                await wait_for(resumed, timeout_s=45, step_s=0.2,
                               what=lambda: f"live again; console: {browser.console[-5:]}")
                # /history read again on resuming: the sparklines hold the seconds of the pause
                points = json.loads(await browser.evaluate(SPARK_JS))
                assert len(points) >= 3 and min(points) >= 12, points
                first = await browser.evaluate("document.getElementById('updated').textContent")

                async def updated_again() -> bool:  # live snapshots keep coming
                    return await browser.evaluate("document.getElementById('updated').textContent") != first
                await wait_for(updated_again, timeout_s=10, step_s=0.2, what="another live snapshot")
                async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as r:
                    assert prometheus_value(await r.text(), "sentinel_admin_live_refused_total") >= 2
        finally:
            for r in readers:
                await r.close()
