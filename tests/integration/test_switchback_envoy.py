"""Switch-back validation before the first request, with the real Envoy and load through it.

Three simulated engines with agents; ``health.validation`` on. gpu-c's engine goes away and comes
back serving another model (``--model-seed 7``): its probes pass, so after each clean period it
enters PROBATION, unrouted, and its replay against two healthy peers diverges: back to
UNHEALTHY. Across three such episodes the engine serves 0 of the users' requests (counted by the
engine itself: replays and probes carry the probe header). Then it comes back with the right
model: validated, ramped, and the time from its return to its first user request is printed.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from xds_server.testing import LoadGenerator, ManagedProcess, wait_for

pytestmark = pytest.mark.envoy

HEALTH = {"validation": {"enabled": True, "max_tokens": 16, "check_interval": "100ms", "retry": "500ms",
                         "timeout": "5s"},
          "probation": {"clean": "1s", "clean_max": "4s", "min_probes": 2, "ramp_step_percent": 25,
                        "ramp_step": "250ms"},
          "probes": {"ttft_healthy": "1s", "ttft_timeout": "3s"}}


async def _restart_engine(fleet, node_id: str, seed: int, http) -> None:
    """Stop ``node_id``'s engine and, once Envoy no longer routes to it (a real engine takes
    seconds to minutes to load a model; a forked one listens ~0.1 s after the old one stopped,
    within one agent scrape, 100 ms, so nobody could see it go), start it again on its port
    serving model ``seed``."""
    n = fleet.node(node_id)
    old = n.engine
    assert old is not None and fleet.workdir is not None
    await asyncio.to_thread(old.stop)

    async def gone() -> bool:  # Envoy's own view: a PROBATION ramp is routed too
        return (await fleet.envoy_hosts(http)).get(node_id) != "HEALTHY"

    await wait_for(gone, 20, what=f"{node_id} no longer routed by Envoy once its engine stopped")
    new = ManagedProcess(f"engine-{node_id}-{seed}", [*fleet._py(
        "-m", "node_probe.cli", "sim-engine", "--port", str(n.engine_port), "--replica-id", node_id,
        "--token-interval-ms", str(fleet.token_interval_ms), "--model-seed", str(seed))],
        fleet.workdir / f"engine-{node_id}-{seed}.log", ready_pattern="listening")
    fleet.procs[fleet.procs.index(old)] = new
    n.engine = new
    await asyncio.to_thread(new.start, 20)


async def _user_requests(http, node) -> int:
    async with http.get(f"{node.engine_url}/sim/stats") as r:
        return (await r.json())["requests_by_kind"]["user"]


async def _story(http, fleet, node_id: str) -> str:
    """``node_id``'s events, one per line (what a failing assertion shows)."""
    events = await fleet.cp_events(http)
    return "\n".join(f"{e['time']:.3f} {e['kind']} {e.get('from', '')}->{e.get('to', '')}: {e['reason']}"
                     for e in events if e["node"] == node_id)


async def _failed_validations(http, fleet, node_id: str) -> int:
    events = await fleet.cp_events(http)
    return sum(1 for e in events if e["node"] == node_id and e.get("to") == "UNHEALTHY"
               and "switch-back" in e["reason"])


async def test_a_node_back_with_another_model_never_serves_a_user_and_the_right_model_is_ramped(make_fleet, http):
    fleet = make_fleet(n_nodes=3, probe_interval_s=0.3, health=HEALTH)
    await fleet.wait_all_routed(http)
    load = LoadGenerator(fleet.url, concurrency=3, max_tokens=2, pause_s=0.02)
    await load.start()
    try:
        bad = fleet.node("gpu-c")
        await _restart_engine(fleet, "gpu-c", seed=7, http=http)
        await wait_for(lambda: _episodes(http, fleet, 3), 90, step_s=0.2, what="three failed episodes")
        # not one user request across three episodes
        assert await _user_requests(http, bad) == 0, await _story(http, fleet, "gpu-c")
        assert load.totals().ok > 0
        # back with the right model: validated, then ramped; the first user request comes after
        t0 = time.monotonic()
        await _restart_engine(fleet, "gpu-c", seed=0, http=http)
        await wait_for(lambda: _served(http, bad), 60, step_s=0.05, what="gpu-c serves users again")
        print(f"\nright model: first user request {time.monotonic() - t0:.2f} s after the engine came back")
        assert await _validated(http, fleet, "gpu-c")  # its ramp began on a passing verdict
    finally:
        await load.stop()
    assert load.totals().failed == 0


async def _episodes(http, fleet, n: int) -> bool:
    return await _failed_validations(http, fleet, "gpu-c") >= n


async def _validated(http, fleet, node_id: str) -> bool:
    async with http.get(f"http://127.0.0.1:{fleet.admin_port}/nodes") as r:
        node = next(v for v in (await r.json())["nodes"] if v["id"] == node_id)
    return node["state"] in ("PROBATION", "HEALTHY") and node["validation"]["verdict"] == "passed"


async def _served(http, node) -> bool:
    return await _user_requests(http, node) > 0


async def test_a_shift_back_to_a_region_whose_node_serves_another_model_never_moves_traffic_there(make_fleet, http):
    token = "shift-token"
    fleet = make_fleet(n_nodes=3, probe_interval_s=0.3, health={**HEALTH, "ramp_start_percent": 100.0},
                       node_options=[{"priority": 0, "locality": {"region": "us"}},
                                     {"priority": 0, "locality": {"region": "us"}},
                                     {"priority": 1, "locality": {"region": "eu"}}],
                       admin_options={"token": token},
                       config_options={"shift": {"min_requests": 5, "wilson_z": 1.0, "max_error_ratio": 0.5},
                                       "lrs": {"interval_s": 0.5}})
    await fleet.wait_all_routed(http)
    load = LoadGenerator(fleet.url, concurrency=3, max_tokens=2, pause_s=0.02)
    await load.start()
    try:
        eu = fleet.node("gpu-c")
        await _restart_engine(fleet, "gpu-c", seed=7, http=http)  # the region comes back serving another model
        await wait_for(lambda: _episodes(http, fleet, 1), 60, step_s=0.2, what="its first failed validation")
        served_before = await _user_requests(http, eu)
        async with http.post(f"http://127.0.0.1:{fleet.admin_port}/clusters/llm/shift",
                             json={"to": "eu", "step_percent": 50, "every_s": 1},
                             headers={"Authorization": f"Bearer {token}"}) as r:
            assert r.status == 200, await r.text()
        phases = set()
        for _ in range(40):  # 8 s: windows of 1 s while it fails validation again and again
            async with http.get(f"http://127.0.0.1:{fleet.admin_port}/clusters/llm/shift") as r:
                v = await r.json()
            phases.add(v["phase"])
            await asyncio.sleep(0.2)
        assert await _user_requests(http, eu) == served_before == 0  # not one user request moved there
        assert "done" not in phases and load.totals().ok > 0
    finally:
        await load.stop()
    assert load.totals().failed == 0
