"""The health model with the real Envoy: degrade, eject, half-open ramp (shortened durations)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from xds_server.demo import wait_state
from xds_server.testing import EnvoyHost, Fleet, LoadGenerator, fetch_envoy_hosts

pytestmark = pytest.mark.envoy

HEALTH = {"probation": {"clean": "1.5s", "ramp_step_percent": 20, "ramp_step": "400ms"}}


async def _envoy_host(fleet: Fleet, http, node_id: str) -> EnvoyHost | None:
    """One node's host in Envoy's /clusters: status and weight from the same snapshot."""
    port = fleet.node(node_id).engine_port
    hosts = await fetch_envoy_hosts(http, f"http://127.0.0.1:{fleet.envoy_admin_port}", fleet.cluster)
    return next((h for h in hosts if h.port == port), None)


async def test_slow_engine_gets_less_traffic_hung_engine_is_ejected_and_comes_back_gradually(make_fleet, http):
    # TTFT outliers off (400 ms vs ~20 ms would be one) to see the DEGRADED rule alone; Envoy's own
    # passive outlier detection off so its 10 s ejection does not hide our ramp.
    fleet = make_fleet(n_nodes=3, probe_interval_s=0.3, per_try_timeout_s=1.0,
                       health={**HEALTH, "outlier_min_gap_ttft_ms": 5000,
                               # the seed score would also move weights with RTT noise on this busy box
                               "score_rtt_weight": 0.0, "score_gpu_weight": 0.0},
                       cluster_options={"outlier_detection": {"enabled": False}})
    await fleet.wait_all_routed(http)
    for n in ("gpu-a", "gpu-b", "gpu-c"):
        assert await wait_state(fleet, http, n, "HEALTHY", timeout_s=10) is not None
    load = LoadGenerator(fleet.url, concurrency=4)
    await load.start()
    try:
        base = load.phase("baseline")
        await asyncio.sleep(2.0)

        await fleet.set_fault(http, "gpu-a", "slow", ttft_ms=400)
        assert await wait_state(fleet, http, "gpu-a", "DEGRADED", timeout_s=5) is not None
        for _ in range(40):  # the EDS push reaches Envoy a moment after the state change
            weights = await fleet.envoy_weights(http)
            if weights["gpu-a"] == 30:
                break
            await asyncio.sleep(0.05)
        slow = load.phase("gpu-a slow (DEGRADED)")
        await asyncio.sleep(3.0)
        await fleet.set_fault(http, "gpu-a", "none")
        assert await wait_state(fleet, http, "gpu-a", "HEALTHY", timeout_s=5) is not None

        await fleet.set_fault(http, "gpu-b", "hang")
        assert await wait_state(fleet, http, "gpu-b", "UNHEALTHY", timeout_s=5) is not None
        hung = load.phase("gpu-b hung (UNHEALTHY)")
        await asyncio.sleep(2.0)
        await fleet.set_fault(http, "gpu-b", "none")
        load.phase("gpu-b healed (PROBATION ramp)")
        seen: list[int] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15:
            # weight and health from one /clusters snapshot: read from two, an EDS
            # push landing between them paired the ejected node's full weight (an UNHEALTHY host
            # keeps weight 100) with its first HEALTHY status, and the ramp read [100, 1, 21, ...]
            host = await _envoy_host(fleet, http, "gpu-b")
            w = host.weight if host is not None else None
            if host is not None and host.status == "HEALTHY" and (not seen or w != seen[-1]):
                seen.append(w)
            if w == 100 and host is not None and host.status == "HEALTHY":
                break
            await asyncio.sleep(0.05)
        after = load.phase("after")
        b = (await fleet.cp_nodes(http))["gpu-b"]  # what held it, if the ramp was not seen
        await asyncio.sleep(1.5)
    finally:
        await load.stop()
    print("\nper-node requests per phase:\n" + "\n".join(
        f"  {name:<32} {json.dumps(dict(sorted(st.ok_by_node.items())))} failed={st.failed}"
        for name, st in load.phases.items() if st.ok or st.failed))
    print(f"gpu-b when its ramp's wait ended: {b['state']}, {b['reason']}; {b.get('probation')}")
    print(f"Envoy weights while gpu-a was DEGRADED: {weights}; gpu-b ramp seen by Envoy: {seen}; "
          f"failures: {dict(load.totals().failures)}")
    share = lambda st, n: st.ok_by_node.get(n, 0) / max(1, st.ok)  # noqa: E731 - a one-line helper
    evs = [e for e in await fleet.cp_events(http) if e.get("node") == "gpu-b"]
    print("gpu-b's transitions (a failure below shows the path its ramp took):\n" + "\n".join(
        f"  {e['time'] % 1000:.2f} {e['from']} -> {e['to']}: {e['reason'][:100]}"
        for e in evs if e["kind"] == "transition"))
    assert weights == {"gpu-a": 30, "gpu-b": 100, "gpu-c": 100}
    # weight 30 of 230: ~13 % expected (33 % at baseline)
    assert share(slow, "gpu-a") < 0.25, (share(slow, "gpu-a"), share(base, "gpu-a"))
    assert hung.ok_by_node.get("gpu-b", 0) == 0 and hung.ok > 20
    assert seen[0] <= 21 and seen[-1] == 100 and seen == sorted(seen) and len(seen) >= 3  # gradual
    assert share(after, "gpu-b") > 0.15
    assert load.totals().failed == 0, dict(load.totals().failures)


async def test_fail_static_keeps_last_good_assignment_when_all_agents_go_silent_together(make_fleet, http):
    """The control plane loses every agent at once (agents frozen, engines fine): suspect our own
    network, keep routing on the last good assignment, and forgive the losses when they return."""
    fleet = make_fleet(n_nodes=3, health=HEALTH)
    await fleet.wait_all_routed(http)
    for n in ("gpu-a", "gpu-b", "gpu-c"):
        assert await wait_state(fleet, http, n, "HEALTHY", timeout_s=10) is not None
    load = LoadGenerator(fleet.url, concurrency=3)
    await load.start()
    try:
        load.phase("before")
        await asyncio.sleep(1.0)
        during = load.phase("agents silent")
        for n in fleet.nodes:
            n.agent.freeze()
        try:
            await asyncio.sleep(1.5)
            hosts = await fleet.envoy_hosts(http)
            async with http.get(f"http://127.0.0.1:{fleet.admin_port}/metrics") as r:
                metrics = await r.text()
        finally:
            for n in fleet.nodes:
                n.agent.thaw()
        load.phase("after")
        states = {}
        for _ in range(60):
            states = {k: v["state"] for k, v in (await fleet.cp_nodes(http)).items()}
            if all(s == "HEALTHY" for s in states.values()):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
    finally:
        await load.stop()
    kinds = [e["kind"] for e in await fleet.cp_events(http)]
    print(f"\nEnvoy during the silence: {hosts}; events: {kinds[-8:]}; per phase: "
          + json.dumps({k: dict(v.ok_by_node) for k, v in load.phases.items()}))
    assert hosts == {"gpu-a": "HEALTHY", "gpu-b": "HEALTHY", "gpu-c": "HEALTHY"}
    assert "sentinel_fail_static 1.0" in metrics
    assert "fail_static_on" in kinds and "fail_static_off" in kinds
    assert states == {"gpu-a": "HEALTHY", "gpu-b": "HEALTHY", "gpu-c": "HEALTHY"}  # forgiven, no probation
    assert len(during.ok_by_node) == 3 and load.totals().failed == 0


async def test_silent_survivors_whose_engines_serve_stay_routed_when_the_rest_is_out(make_fleet, http):
    """Two of four engines hang and are ejected; then the two survivors' agents freeze (2 of 4
    silent: not the fleet-wide fail-static's "more than half") while their engines keep serving.
    Ejecting them for silence would leave Envoy nothing ("no healthy upstream" for every
    request); their real traffic succeeding keeps them routed (fail_static_kept)."""
    fleet = make_fleet(n_nodes=4, health=HEALTH)
    await fleet.wait_all_routed(http)
    load = LoadGenerator(fleet.url, concurrency=3)
    await load.start()
    try:
        for n in ("gpu-a", "gpu-b"):
            await fleet.set_fault(http, n, "hang")
        for n in ("gpu-a", "gpu-b"):
            assert await wait_state(fleet, http, n, "UNHEALTHY", timeout_s=10) is not None
        await asyncio.sleep(2.5)  # load reports of the survivors' traffic (lrs.interval 1 s)
        silent = load.phase("survivors' agents silent")
        survivors = [fleet.node("gpu-c"), fleet.node("gpu-d")]
        for n in survivors:
            n.agent.freeze()
        hosts_seen = []
        try:
            for _ in range(10):  # 5 s
                await asyncio.sleep(0.5)
                hosts_seen.append(await fleet.envoy_hosts(http))
            nodes = await fleet.cp_nodes(http)
        finally:
            for n in survivors:
                n.agent.thaw()
        load.phase("after")
    finally:
        await load.stop()
    kept = [e["node"] for e in await fleet.cp_events(http) if e["kind"] == "fail_static_kept"]
    print(f"\nduring the silence: {silent.ok} ok, {silent.failed} failed; kept {kept}; states "
          f"{ {k: v['state'] for k, v in nodes.items()} }")
    assert nodes["gpu-c"]["state"] == nodes["gpu-d"]["state"] == "UNHEALTHY"  # out for silence, in the model
    assert sorted(kept) == ["gpu-c", "gpu-d"]
    assert all(h.get("gpu-c") == "HEALTHY" and h.get("gpu-d") == "HEALTHY" for h in hosts_seen), hosts_seen
    assert silent.ok > 0 and silent.failed <= 0.05 * (silent.ok + silent.failed)
