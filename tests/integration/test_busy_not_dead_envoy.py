"""Busy is never dead, with the real Envoy: a long chunked prefill on a healthy engine
is DEGRADED "busy", never ejected, and back at full weight in Envoy within a few seconds after it
ends; a true hang on the same node afterwards is still ejected (the 1.5 s target is measured in
benchmarks/detection.py: median 1,465 ms; this test bounds it at 2 s so a loaded CI machine does
not turn a benchmark number into a flaky assertion).

Each test prints what it measured (run with -s).
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from xds_server.demo import FaultTimeline, wait_state, watch_exclusion
from xds_server.testing import LoadGenerator

pytestmark = pytest.mark.envoy

HEALTH = {"probation": {"clean": "1.5s", "ramp_step_percent": 25, "ramp_step": "250ms"},
          "score": {"rtt_weight": 0.0, "gpu_weight": 0.0}}


async def events_of(fleet, http: aiohttp.ClientSession, node_id: str) -> list[dict]:
    async with http.get(f"http://127.0.0.1:{fleet.admin_port}/events") as r:
        body = await r.json()
    evs = body["events"] if isinstance(body, dict) else body
    return [e for e in evs if e.get("node_id", e.get("node")) == node_id]


async def test_long_prefill_5500ms_not_ejected_full_weight_within_3s_then_hang_ejected_within_2s(make_fleet, http):
    fleet = make_fleet(n_nodes=3, probe_interval_s=0.5, health=HEALTH,
                       cluster_options={"outlier_detection": {"enabled": False}})
    await fleet.wait_all_routed(http)
    for n in ("gpu-a", "gpu-b", "gpu-c"):  # routed is not enough: a start-up ramp may still run (PROBATION)
        assert await wait_state(fleet, http, n, "HEALTHY", timeout_s=10) is not None
    load = LoadGenerator(fleet.url, concurrency=3)
    await load.start()
    try:
        load.phase("before")
        await asyncio.sleep(1.0)
        seen_before = len(await events_of(fleet, http, "gpu-b"))
        load.phase("gpu-b prefilling")
        t0 = time.monotonic()
        await fleet.set_fault(http, "gpu-b", "prefill", prefill_ms=5500)
        states, reasons = set(), set()
        while time.monotonic() - t0 < 5.5:
            v = (await fleet.cp_nodes(http))["gpu-b"]
            states.add(v["state"])
            if v["state"] == "DEGRADED":
                reasons.add(v["reason"])
            await asyncio.sleep(0.05)
        load.phase("after the prefill")
        back_s = None
        while time.monotonic() - t0 < 5.5 + 6.0:
            weights = await fleet.envoy_weights(http)
            hosts = await fleet.envoy_hosts(http)
            if weights.get("gpu-b") == 100 and hosts.get("gpu-b") == "HEALTHY":
                back_s = time.monotonic() - t0 - 5.5
                break
            await asyncio.sleep(0.05)
        prefill_events = (await events_of(fleet, http, "gpu-b"))[seen_before:]

        await asyncio.sleep(1.0)
        tl = FaultTimeline("hang", "gpu-b")
        load.phase("gpu-b hung")
        t1 = time.monotonic()
        await fleet.set_fault(http, "gpu-b", "hang")
        await watch_exclusion(fleet, http, tl, t1, timeout_s=6.0)
        for _ in range(100):
            if (await fleet.cp_nodes(http))["gpu-b"]["state"] == "UNHEALTHY":
                break
            await asyncio.sleep(0.05)
        hung = (await fleet.cp_nodes(http))["gpu-b"]
        await fleet.set_fault(http, "gpu-b", "none")
    finally:
        await load.stop()
    print(f"\nlong prefill 5.5 s: states {sorted(states)}, reasons {sorted(reasons)[:2]}; full weight in Envoy "
          f"{back_s} s after it ended; hang: control plane ejected after {tl.cp_ejected_s} s "
          f"({tl.cp_reason}), Envoy excluded after {tl.envoy_excluded_s} s; failed {dict(load.totals().failures)}")
    assert "UNHEALTHY" not in states and "PROBATION" not in states
    assert not any(e.get("to_state", e.get("to")) in ("UNHEALTHY", "PROBATION") for e in prefill_events), prefill_events
    assert "DEGRADED" in states and all(r.startswith("busy: ") for r in reasons), reasons
    assert any("vllm:kv_cache_usage_perc" in r for r in reasons), reasons
    assert back_s is not None and back_s < 3.0
    assert hung["state"] == "UNHEALTHY" and "busy" not in hung["reason"] and "saturated" not in hung["reason"]
    assert tl.cp_ejected_s is not None and tl.cp_ejected_s < 2.0
    assert load.totals().failed == 0, dict(load.totals().failures)
