"""What a shed client sees, with the real Envoy: a request dropped by the published
``policy.drop_overloads`` gets 429 with Retry-After (the bootstrap's local_reply_config), while
"no healthy upstream" stays a distinct 503 without it."""
from __future__ import annotations

import asyncio
import collections

import pytest

from xds_server.testing import LoadGenerator, wait_for

pytestmark = pytest.mark.envoy

FAST = {"probation": {"clean": "1m", "ramp_step_percent": 25, "ramp_step": "250ms"}}


async def _statuses(http, url: str, n: int) -> tuple[collections.Counter, dict[int, dict]]:
    seen: collections.Counter = collections.Counter()
    sample: dict[int, dict] = {}
    body = {"model": "sim-model", "prompt": "hi", "max_tokens": 1}
    for _ in range(n):
        async with http.post(f"{url}/v1/completions", json=body) as r:
            seen[r.status] += 1
            sample.setdefault(r.status, {"headers": dict(r.headers), "body": await r.text()})
    return seen, sample


async def test_dropped_requests_get_429_with_retry_after_and_no_upstream_stays_503(make_fleet, http):
    fleet = make_fleet(n_nodes=2, health=FAST, cluster_options={
        "drop_overloads": [{"drop_percent": 50, "below_routable_capacity_ratio": 0.6}]})
    await fleet.wait_all_routed(http)
    await fleet.set_fault(http, "gpu-b", "error")  # probes fail: ejected, half the capacity left
    await fleet.wait_ejected(http, "gpu-b", timeout_s=15)
    seen, sample = await _statuses(http, fleet.url, 60)
    print(f"\nhalf the capacity: {dict(seen)}")
    assert seen[429] >= 10 and seen[200] >= 10 and set(seen) <= {200, 429}
    shed = sample[429]
    assert shed["headers"]["Retry-After"] == "3"
    assert shed["headers"]["x-envoy-drop-overload"] == "true" and shed["body"] == "drop overload"
    await fleet.set_fault(http, "gpu-a", "error")  # nothing routable: not shedding, unavailable
    await fleet.wait_ejected(http, "gpu-a", timeout_s=15)
    seen, sample = await _statuses(http, fleet.url, 40)
    print(f"nothing routable: {dict(seen)}")
    assert seen[503] >= 5
    assert "Retry-After" not in sample[503]["headers"] and "no healthy upstream" in sample[503]["body"]


async def test_queues_over_warning_shed_the_excess_and_lift_with_hysteresis(make_fleet, http):
    # both nodes report 70 waiting (> queue_warning 50): shedding starts at the next load report,
    # the headroom kept free (10 %, at least one 5 % step), then held; it is lifted once the queues stay
    # low for lift_after_s. Envoy drops the commanded share (429 + Retry-After). The seed's thresholds
    # alone (queue_wait_budget_s null): the 70 are the sim's fake queue, which no drop shortens.
    # The random drop: admission by slots is off (a fake queue says nothing of the nodes' slots).
    fleet = make_fleet(n_nodes=2, health=FAST, config_options={"lrs": {"shed": {
        "enabled": True, "lift_after_s": 1.0, "window_s": 2.0, "queue_wait_budget_s": None,
        "admission": {"slots": False}}}})
    await fleet.wait_all_routed(http)
    load = LoadGenerator(fleet.url, concurrency=2, max_tokens=1)
    await load.start()
    try:
        await asyncio.sleep(1.0)
        for n in ("gpu-a", "gpu-b"):
            await fleet.set_fault(http, n, "queue", waiting=70)

        async def shedding() -> float | None:
            async with http.get(f"http://127.0.0.1:{fleet.admin_port}/clusters") as r:
                p = (await r.json())["clusters"][0]["traffic"]["shed_percent"]
            return p or None

        percent = await wait_for(shedding, 10, what="shedding started")
        # seed 002's warning level: an event and a metric per node
        async with http.get(f"http://127.0.0.1:{fleet.admin_port}/events") as r:
            kinds = {(e["node"], e["kind"]) for e in (await r.json())["events"]}
        assert {("gpu-a", "queue_warning"), ("gpu-b", "queue_warning")} <= kinds
        async with http.get(f"http://127.0.0.1:{fleet.admin_port}/metrics") as r:
            text = await r.text()
        assert 'sentinel_node_queue_level{cluster="llm",level="warning",node="gpu-a"} 1.0' in text
        assert 'sentinel_node_requests_waiting{cluster="llm",node="gpu-a"} 70.0' in text
        await asyncio.sleep(1.0)  # Envoy has the assignment
        shed = load.phase("shedding")
        await asyncio.sleep(2.0)
        held = await shedding()  # the drop held while the queues stayed (easing starts once they clear)
        load.phase("easing")  # the share is compared over the held drop only, not the easing steps
        for n in ("gpu-a", "gpu-b"):
            await fleet.set_fault(http, n, "none")
        await wait_for(lambda: _not(shedding), 10, what="shedding lifted")
        await asyncio.sleep(1.0)
        after = load.phase("lifted")
        await asyncio.sleep(1.0)
    finally:
        await load.stop()
    total = shed.ok + shed.failed
    share = 100.0 * shed.failures["HTTP 429"] / total
    print(f"\ncommanded {percent:g} % then {held:g} %, shed {share:.1f} % of {total}; after lifting "
          f"{dict(after.failures)}")
    assert set(shed.failures) <= {"HTTP 429"}
    assert held == percent  # held while the queues stayed over the warning level
    assert abs(share - percent) <= 5  # within 5 points of what was commanded
    assert after.failed == 0 and after.ok > 20


async def _not(pred) -> bool:
    return not await pred()
