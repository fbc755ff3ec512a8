"""The dashboard's history sampler takes a large fleet in slices and lets the event loop run
between them (a sample of 2,000 nodes in one go stopped it for ~50 ms every interval, delaying a
frozen host's detection behind it), and every node is still in the sample. Real control plane and
admin server; the view's history_rows is wrapped to see each slice's size and what ran between."""
from __future__ import annotations

import asyncio

import aiohttp

from xds_server.admin.app import _HISTORY_SLICE
from xds_server.config import parse_config
from xds_server.server import ControlPlane
from xds_server.testing import wait_for

NODES = 2 * _HISTORY_SLICE + 50


async def test_a_history_sample_runs_in_slices_with_the_loop_free_between_and_holds_every_node():
    cp = ControlPlane(parse_config({
        "xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0", "history_interval": "100ms"},
        "clusters": [{"name": "llm", "nodes": [{"id": f"n{i}", "address": f"10.1.{i // 200}.{1 + i % 200}:8000"}
                                               for i in range(NODES)]}]}))
    turns = [0]  # a task's loop iterations: it advances only while the sampler yields
    calls: list[tuple[int, int]] = []  # (slice size, turns when it was taken)
    rows = cp.view.history_rows

    def spied(node_ids):
        calls.append((len(node_ids), turns[0]))
        return rows(node_ids)

    cp.view.history_rows = spied  # type: ignore[method-assign]  # the spy of this test, on its own instance

    async def spin() -> None:
        while True:
            turns[0] += 1
            await asyncio.sleep(0)

    await cp.start()
    spinner = asyncio.create_task(spin())
    try:
        await wait_for(lambda: len(calls) >= 6, timeout_s=10, what="two samples")
        second = calls[3:6]  # the first sample may run before the spinner starts
        assert [n for n, _ in second] == [_HISTORY_SLICE, _HISTORY_SLICE, 50]
        assert second[0][1] < second[1][1] < second[2][1], "the loop ran between the slices"
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{cp.admin_port}/history") as r:
            assert r.status == 200
            body = await r.json()
        assert len(body["nodes"]) == NODES
    finally:
        spinner.cancel()
        await cp.stop()
