"""Gated shifts with the real Envoy: the share Envoy routes, counted per node from the
answers' ``x-served-by``, follows the commanded share at each step (locality weights in one
priority); an injected error rate on the target rolls one step back after the configured
consecutive failed windows; no traffic holds and says so; a restart resumes at the same step;
cancel restores; a hard switch moves everything at once.

Gates are loosened for seconds-long windows (the defaults, seed 002's 0.5 % with a 95 % Wilson
bound, need ~800 clean requests per window): max_error_ratio 5 %, z 1, 20 requests, and the
injected error rate is 40 % (the 2 % case and the consecutive-failure rule over generated windows
are tests/property/test_shift_properties.py)."""
from __future__ import annotations

import asyncio
import time

import pytest

from xds_server.testing import LoadGenerator, restart_control_plane, wait_for

pytestmark = pytest.mark.envoy

TOKEN = "shift-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GATES = {"min_requests": 20, "wilson_z": 1.0, "max_error_ratio": 0.05, "fail_windows": 2,
         "max_latency_increase": 3.0}
TARGET = ("gpu-c", "gpu-d")


def _fleet(make_fleet, tmp_path, **gates):
    return make_fleet(
        n_nodes=4, node_options=[{"priority": 0}, {"priority": 0}, {"priority": 1}, {"priority": 1}],
        health={"ramp_start_percent": 100.0},
        cluster_options={"outlier_detection": {"enabled": False}, "lb_policy": "ROUND_ROBIN"},
        admin_options={"token": TOKEN},
        config_options={"shift": {**GATES, **gates, "state_path": str(tmp_path / "shifts.json")},
                        "lrs": {"interval_s": 0.5, "traffic_ejection": {"enabled": False}}})


async def _shift(fleet, http, path: str = "", body: dict | None = None, status: int = 200) -> dict:
    url = f"http://127.0.0.1:{fleet.admin_port}/clusters/llm/shift{path}"
    async with http.post(url, json=body or {}, headers=AUTH) as r:
        got = await r.json()
        assert r.status == status, got
        return got


async def _view(fleet, http) -> dict:
    async with http.get(f"http://127.0.0.1:{fleet.admin_port}/clusters/llm/shift") as r:
        return await r.json()


async def _share(load: LoadGenerator, name: str, s: float) -> tuple[float, int]:
    """(share % of the answers from the target nodes, answers) over ``s`` seconds of load."""
    ph = load.phase(name)
    await asyncio.sleep(s)
    load.phase(f"{name}-after")
    total = sum(ph.ok_by_node.values())
    return 100.0 * sum(ph.ok_by_node[n] for n in TARGET) / max(1, total), total


async def test_gated_shift_steps_on_time_rolls_back_and_cancels(make_fleet, http, tmp_path):
    fleet = _fleet(make_fleet, tmp_path)
    await fleet.wait_all_routed(http)
    load = LoadGenerator(fleet.url, concurrency=6, max_tokens=1)
    await load.start()
    try:
        share, n = await _share(load, "before", 1.0)
        assert share == 0.0 and n > 50, (share, n)  # priority 0 takes everything
        every = 2.0
        v = await _shift(fleet, http, body={"to": 1, "step_percent": 25, "every": f"{every}s"})
        assert v["phase"] == "stepping" and v["share_percent"] == 25
        t_start = time.monotonic()
        await asyncio.sleep(0.4)  # Envoy applies the Cluster + assignment
        measured = {}
        measured[25], n25 = await _share(load, "s25", 1.2)
        adv = await wait_for(lambda: _advanced(fleet, http, 50), every + 2, what="the shift advances to 50 %")
        took = time.monotonic() - t_start
        await asyncio.sleep(0.4)
        measured[50], n50 = await _share(load, "s50", 1.2)
        print(f"\nrouted share per step {measured} ({n25}, {n50} answers); 25 -> 50 after {took:.2f} s "
              f"(every {every} s); gate {adv['last_gate']}")
        for cmd, got in measured.items():
            assert abs(got - cmd) <= 3.0, f"commanded {cmd} %, Envoy routed {got:.1f} % to the target"
        assert every - 0.3 <= took <= every + 1.0 and adv["last_gate"]["verdict"] == "pass"
        # 40 % errors on the target: the first failed window does not roll back, the second does
        for nid in TARGET:
            await fleet.set_fault(http, nid, "user_error", rate=0.4)
        v = await wait_for(lambda: _phase(fleet, http, "rolled_back"), 3 * every + 2, what="rolled back")
        assert v["rollbacks"] == 1 and v["last_gate"]["error_gate"] == "fail"
        async with http.get(f"http://127.0.0.1:{fleet.admin_port}/events") as r:
            kinds = [e["kind"] for e in (await r.json())["events"] if e["kind"].startswith("shift_")]
        # the window the fault began in may still pass (few errors in it): one step back from the peak
        assert kinds[-2:] == ["shift_failed", "shift_rolled_back"], kinds
        peak = 25 * (1 + kinds.count("shift_advanced"))
        assert v["share_percent"] == peak - 25, (v["share_percent"], kinds)
        for nid in TARGET:
            await fleet.set_fault(http, nid, "none")
        await asyncio.sleep(0.4)
        back, _ = await _share(load, "rolled", 1.2)
        assert abs(back - v["share_percent"]) <= 3.0, back
        # cancel: the previous weights (priority 0 takes everything again), locality weighting off
        v = await _shift(fleet, http, "/cancel")
        assert v["phase"] == "cancelled" and v["share_percent"] == 0
        await asyncio.sleep(0.4)
        after, _ = await _share(load, "cancelled", 1.0)
        assert after == 0.0
        async with http.get(f"http://127.0.0.1:{fleet.admin_port}/metrics") as r:
            text = await r.text()
        assert 'sentinel_shift_phase{cluster="llm",phase="cancelled"} 1.0' in text
        assert load.totals().failed == 0 or set(load.totals().failures) <= {"HTTP 500"}, load.totals().failures
    finally:
        await load.stop()


async def test_no_traffic_holds_restart_resumes_and_hard_switch(make_fleet, http, tmp_path):
    # the gate never has data enough here, so the share measured after the restart is the resumed
    # step's (with 20 requests a window, a loaded machine let it advance to 60 % mid-measurement)
    fleet = _fleet(make_fleet, tmp_path, min_requests=1_000_000)
    await fleet.wait_all_routed(http)
    # bad input: each refused naming its field, nothing started
    for body, status, field in [({"to": "mars"}, 400, "to"), ({"to": 1, "step_percent": 0}, 400, "step_percent"),
                                ({"to": 1, "step_percent": 120}, 400, "step_percent"), ({"to": 9}, 400, "to"),
                                ({"to": 1, "every_s": 0.5}, 400, "every_s")]:  # < 2 report intervals
        got = await _shift(fleet, http, body=body, status=status)
        assert got["field"] == field, got
    async with http.post(f"http://127.0.0.1:{fleet.admin_port}/clusters/nope/shift", json={"to": 1},
                         headers=AUTH) as r:
        assert r.status == 404 and (await r.json())["field"] == "cluster"
    async with http.post(f"http://127.0.0.1:{fleet.admin_port}/clusters/llm/shift", json={"to": 1}) as r:
        assert r.status == 401
    assert (await _view(fleet, http))["phase"] == "none"  # no shift: a normal answer
    await _shift(fleet, http, body={"to": 1, "step_percent": 30, "every_s": 1})
    v = await wait_for(lambda: _phase(fleet, http, "holding"), 4, what="no traffic holds")
    assert v["share_percent"] == 30 and "too little data" in v["reason"] and v["rollbacks"] == 0
    got = await _shift(fleet, http, body={"to": 1}, status=409)  # a second shift: the first one unchanged
    assert got["field"] == "cluster" and (await _view(fleet, http))["share_percent"] == 30
    # restart mid-shift: the same step is published and Envoy keeps routing 30 %
    await restart_control_plane(fleet)
    v = await _view(fleet, http)
    assert v["share_percent"] == 30 and v["phase"] in ("stepping", "holding"), v
    load = LoadGenerator(fleet.url, concurrency=6, max_tokens=1)
    await load.start()
    try:
        await asyncio.sleep(0.5)
        share, n = await _share(load, "resumed", 1.5)
        assert abs(share - 30) <= 3.0, (share, n)
        v = await _view(fleet, http)
        assert v["share_percent"] == 30 and v["phase"] == "holding" and "too little data" in v["reason"], v
        await _shift(fleet, http, "/cancel")
        await asyncio.sleep(0.5)
        # hard switch while a long generation runs on the source: it is not cut, and its response
        # closes the client's connection; new requests go to the target at once
        body = {"model": "sim-model", "prompt": "long", "max_tokens": 50, "temperature": 0, "stream": False}
        slow = asyncio.create_task(http.post(f"{fleet.url}/v1/completions", json=body))
        await asyncio.sleep(0.15)  # the generation (~0.5 s; the fleet's per-try timeout is 1 s) runs on the source
        v = await _shift(fleet, http, body={"to": 1, "hard": True})
        assert v["phase"] == "done" and v["share_percent"] == 100
        async with await slow as r:
            await r.read()
            assert r.status == 200 and r.headers["x-served-by"] in ("gpu-a", "gpu-b"), r.headers
            assert r.headers.get("x-sentinel-connection") == "close" and r.headers.get("connection") == "close"
        await asyncio.sleep(0.5)
        share, n = await _share(load, "hard", 1.0)
        assert share == 100.0, (share, n)
        async with http.post(f"{fleet.url}/v1/completions", json={**body, "max_tokens": 1}) as r:
            assert r.headers["x-served-by"] in TARGET and "x-sentinel-connection" not in r.headers
            assert r.headers.get("connection", "").lower() != "close"
        assert load.totals().failed == 0, load.totals().failures
    finally:
        await load.stop()


async def _advanced(fleet, http, share: float) -> dict | None:
    v = await _view(fleet, http)
    return v if v["share_percent"] >= share else None


async def _phase(fleet, http, phase: str) -> dict | None:
    v = await _view(fleet, http)
    return v if v["phase"] == phase else None
