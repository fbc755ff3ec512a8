"""End to end with the real Envoy: probes -> health -> EDS -> Envoy routing.

Each test prints the numbers it measured (run with -s to see them).
"""
from __future__ import annotations

import asyncio
import json
import time
from itertools import pairwise

import pytest

from xds_server.demo import FaultTimeline, wait_routed, watch_exclusion
from xds_server.testing import LoadGenerator

pytestmark = pytest.mark.envoy

# Shortened half-open durations (defaults: 60 s clean period, 1 %/s ramp) so tests see recovery.
FAST = {"probation": {"clean": "1.5s", "ramp_step_percent": 25, "ramp_step": "250ms"}}


async def test_traffic_reaches_all_three_nodes(make_fleet, http):
    fleet = make_fleet(n_nodes=3, health=FAST)
    await fleet.wait_all_routed(http)
    load = LoadGenerator(fleet.url, concurrency=4)
    await load.start()
    st = load.phase("steady")
    await asyncio.sleep(2.0)
    await load.stop()
    print(f"\nper-node requests: {dict(st.ok_by_node)}, failed: {dict(st.failures)}")
    assert st.failed == 0
    assert set(st.ok_by_node) == {"gpu-a", "gpu-b", "gpu-c"}
    assert min(st.ok_by_node.values()) >= 0.15 * st.ok
    # Envoy's ADS stream is visible in admin with ACKed versions and no NACK.
    async with http.get(f"http://127.0.0.1:{fleet.admin_port}/xds/clients") as r:
        clients = (await r.json())["clients"]
    assert len(clients) == 1 and clients[0]["node_id"] == "envoy-llm-gw-1"
    types = clients[0]["types"]
    assert types["ClusterLoadAssignment"]["acked_version"] == types["ClusterLoadAssignment"]["last_version_sent"]
    assert types["Cluster"]["nacks"] == 0 and types["ClusterLoadAssignment"]["nacks"] == 0


async def test_host_freeze_envoy_stops_routing_within_2s_and_no_request_fails(make_fleet, http):
    per_try_s = 1.0
    fleet = make_fleet(n_nodes=3, per_try_timeout_s=per_try_s, health=FAST)
    await fleet.wait_all_routed(http)
    load = LoadGenerator(fleet.url, concurrency=4)
    await load.start()
    load.phase("before")
    await asyncio.sleep(1.0)
    node = fleet.node("gpu-a")
    tl = FaultTimeline("freeze", "gpu-a")
    during = load.phase("frozen")
    t0 = time.monotonic()
    node.engine.freeze()
    node.agent.freeze()
    try:
        await watch_exclusion(fleet, http, tl, t0, timeout_s=5.0)
        await asyncio.sleep(1.5)  # traffic while frozen: none may reach gpu-a, none may fail
        after_exclusion = load.phase("frozen, excluded")
        await asyncio.sleep(1.5)
    finally:
        node.agent.thaw()
        node.engine.thaw()
    back = load.phase("thawed")
    routed_again = await wait_routed(fleet, http, "gpu-a", timeout_s=15)
    await asyncio.sleep(1.0)
    await load.stop()
    total = load.totals()
    async with http.get(f"http://127.0.0.1:{fleet.envoy_admin_port}/stats?filter=cluster.llm.upstream_rq_retry") as r:
        retry_stats = dict(line.split(": ") for line in (await r.text()).strip().splitlines())
    print(f"\nEnvoy retry stats: {retry_stats}")
    assert retry_stats["cluster.llm.upstream_rq_retry_overflow"] == "0"
    retried = [ms for ms in total.latencies_ms if ms >= per_try_s * 1000]
    print(f"\nhost freeze: control plane ejected after {tl.cp_ejected_s * 1000:.0f} ms ({tl.cp_reason}); "
          f"Envoy excluded after {tl.envoy_excluded_s * 1000:.0f} ms ({tl.envoy_status}); "
          f"routed again {routed_again:.2f} s after thaw")
    print(f"requests in flight on the frozen node retried after the per-try timeout: {len(retried)}, "
          f"added latency {[round(ms - 45) for ms in retried]} ms; per phase: "
          + json.dumps({k: dict(v.ok_by_node) for k, v in load.phases.items()}))
    assert tl.cp_ejected_s is not None and tl.envoy_excluded_s is not None
    assert tl.envoy_excluded_s < 2.0
    assert tl.cp_reason.startswith("heartbeat: ")
    assert total.failed == 0, dict(total.failures)
    assert after_exclusion.ok_by_node.get("gpu-a", 0) == 0 and after_exclusion.ok > 20
    assert routed_again is not None
    assert len(retried) <= 8  # at most the in-flight and pre-detection requests on gpu-a
    await asyncio.sleep(0)
    assert during.ok > 0 and back.ok > 0


async def test_engine_hang_with_agent_alive_is_ejected_and_recovers(make_fleet, http):
    fleet = make_fleet(n_nodes=3, probe_interval_s=0.5, health=FAST)
    await fleet.wait_all_routed(http)
    load = LoadGenerator(fleet.url, concurrency=3)
    await load.start()
    load.phase("before")
    await asyncio.sleep(1.0)
    tl = FaultTimeline("hang", "gpu-b")
    load.phase("hung")
    t0 = time.monotonic()
    await fleet.set_fault(http, "gpu-b", "hang")
    await watch_exclusion(fleet, http, tl, t0, timeout_s=6.0)
    # wait until our control plane has ejected it (Envoy's outlier detection may be first)
    for _ in range(100):
        if (await fleet.cp_nodes(http))["gpu-b"]["state"] == "UNHEALTHY":
            break
        await asyncio.sleep(0.05)
    nodes = await fleet.cp_nodes(http)
    excluded = load.phase("hung, excluded")
    await asyncio.sleep(1.0)
    await fleet.set_fault(http, "gpu-b", "none")
    load.phase("healed")
    routed_again = await wait_routed(fleet, http, "gpu-b", timeout_s=20)
    await load.stop()
    total = load.totals()
    print(f"\nengine hang: control plane ejected after {tl.cp_ejected_s} s ({tl.cp_reason}); Envoy excluded "
          f"after {tl.envoy_excluded_s} s ({tl.envoy_status}); routed again {routed_again} s after heal; "
          f"failed {dict(total.failures)}")
    assert nodes["gpu-b"]["state"] == "UNHEALTHY"
    # under load the agent's stall detection (tokens frozen) usually sees it before a probe does
    assert "inference timeout" in nodes["gpu-b"]["reason"] or "STALLED" in nodes["gpu-b"]["reason"]
    assert nodes["gpu-b"]["engine_state"] in ("READY", "WARMING")  # agent alive: heartbeats flow
    assert tl.envoy_excluded_s is not None and tl.envoy_excluded_s < 5.0
    assert excluded.ok_by_node.get("gpu-b", 0) == 0
    assert total.failed == 0, dict(total.failures)
    assert routed_again is not None


async def test_sse_stream_is_incremental_and_not_cut(make_fleet, http):
    # 30 tokens at 100 ms: the stream lasts ~3 s, longer than the per-try timeout (1 s) and
    # the per-try idle timeout (2 s) would allow for a silent upstream.
    fleet = make_fleet(n_nodes=1, token_interval_ms=100.0, per_try_timeout_s=1.0, per_try_idle_timeout_s=2.0)
    await fleet.wait_all_routed(http)
    body = {"model": "sim-model", "prompt": "tell me a story", "max_tokens": 30, "stream": True}
    t0 = time.monotonic()
    arrivals = []
    chunks = []
    async with http.post(f"{fleet.url}/v1/completions", json=body) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            arrivals.append(time.monotonic() - t0)
            chunks.append(line[6:])
    assert chunks[-1] == b"[DONE]"
    tokens = [json.loads(c)["choices"][0]["text"] for c in chunks[:-1]]
    print(f"\nSSE through Envoy: first chunk at {arrivals[0] * 1000:.0f} ms, last at {arrivals[-1] * 1000:.0f} ms, "
          f"{len(tokens)} tokens")
    assert len(tokens) == 30 and all(tokens)
    assert arrivals[0] < 0.6            # first token long before the last: not buffered
    assert arrivals[-1] > 2.8           # the whole 3 s generation arrived: not cut
    gaps = [b - a for a, b in pairwise(arrivals[:-1])]
    assert max(gaps) < 0.5              # delivered as generated, chunk by chunk
