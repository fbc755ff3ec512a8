"""Envoy alone (no relay), through the real Envoy: what a client sees of its engine.

- Every response names the engine that served it (``x-sentinel-upstream-host``).
- A stream on a frozen engine ends within the bootstrap's per-try idle timeout (+ Envoy's timer
  slack) instead of hanging to stream_idle_timeout (300 s); with a per_try_timeout shorter than
  the stream's age (the old bootstrap) it does not (why: ``xds_server/envoy/envoy.yaml``).

Run with -s to see the measured numbers.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

pytestmark = pytest.mark.envoy

IDLE_S = 2.0
#: Envoy's idle timers fired up to ~1 s late in our measurements; the documented bound.
SLACK_S = 1.5
HEADER = "x-sentinel-upstream-host"


async def test_upstream_host_header_on_every_response(make_fleet, http):
    fleet = make_fleet(n_nodes=2, token_interval_ms=1.0)
    await fleet.wait_all_routed(http)
    by_id = {n.node_id: n.address for n in fleet.nodes}
    seen = set()
    bodies = [("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
              ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 2, "stream": True}),
              ("/v1/completions", {"prompt": ""})]  # the engine's own 400
    for i in range(12):
        path, body = bodies[i % len(bodies)]
        async with http.post(fleet.url + path, json=body) as r:
            await r.read()
            assert r.status == (400 if body.get("prompt") == "" else 200)
            assert r.headers[HEADER] == by_id[r.headers["x-served-by"]]
            seen.add(r.headers[HEADER])
    assert seen == set(by_id.values())  # both engines, each named by its EDS address


async def _stream_then_freeze(fleet, http, freeze_after_s: float, watch_s: float):
    """Start a long stream, SIGSTOP its engine after ``freeze_after_s``; watch ``watch_s``.

    Returns (chunks before the freeze, seconds from the last chunk to the end of the stream or
    None if still open, whether [DONE] came).
    """
    node = fleet.nodes[0]
    body = {"prompt": "a long story", "max_tokens": 4000, "stream": True}
    t0 = time.monotonic()
    chunks, last, done, frozen = 0, t0, False, False
    try:
        async with http.post(fleet.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            while True:
                try:
                    line = await asyncio.wait_for(r.content.readline(), watch_s)
                except TimeoutError:
                    return chunks, None, done
                if not line:
                    break
                if line.startswith(b"data: "):
                    done |= line.strip() == b"data: [DONE]"
                    chunks += 1
                    last = time.monotonic()
                    if not frozen and last - t0 >= freeze_after_s:
                        node.engine.freeze()
                        frozen = True
    except aiohttp.ClientPayloadError:
        pass
    finally:
        if frozen:
            node.engine.thaw()
    return chunks, time.monotonic() - last, done


async def test_stream_on_frozen_engine_ends_within_bound(make_fleet, http):
    # The shipped bootstrap shape: no per_try_timeout, per_try_idle_timeout IDLE_S.
    fleet = make_fleet(n_nodes=1, token_interval_ms=10.0, per_try_timeout_s=None,
                       per_try_idle_timeout_s=IDLE_S)
    await fleet.wait_all_routed(http)
    chunks, ended_after, done = await _stream_then_freeze(fleet, http, freeze_after_s=1.5,
                                                          watch_s=IDLE_S + SLACK_S + 2.0)
    async with http.get(f"http://127.0.0.1:{fleet.envoy_admin_port}/stats"
                        "?filter=cluster.llm.upstream_rq_per_try_idle_timeout") as r:
        stats = await r.text()
    print(f"\nfrozen engine: stream cut {ended_after and round(ended_after, 2)} s after its last "
          f"chunk ({chunks} chunks); bound {IDLE_S} + {SLACK_S} s; {stats.strip()}")
    assert chunks > 50 and not done
    assert ended_after is not None and IDLE_S - 0.2 <= ended_after <= IDLE_S + SLACK_S
    assert stats.strip().endswith(": 1")


async def test_old_bootstrap_per_try_timeout_disables_the_idle_cut(make_fleet, http):
    """Control (why the bootstrap has no per_try_timeout): with per_try_timeout 1 s, a stream
    older than 1 s on a frozen engine is still open well past the idle bound."""
    fleet = make_fleet(n_nodes=1, token_interval_ms=10.0, per_try_timeout_s=1.0,
                       per_try_idle_timeout_s=IDLE_S)
    await fleet.wait_all_routed(http)
    chunks, ended_after, done = await _stream_then_freeze(fleet, http, freeze_after_s=1.5,
                                                          watch_s=IDLE_S + SLACK_S + 1.0)
    print(f"\nper_try_timeout 1 s: stream still open {IDLE_S + SLACK_S + 1.0} s after the "
          f"freeze: {ended_after is None}")
    assert chunks > 50 and not done
    assert ended_after is None
