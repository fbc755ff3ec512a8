"""Request classes with the real Envoy: with ``lrs.shed.classes`` on, the bootstrap routes
``x-sentinel-priority: sheddable`` and ``critical`` to their own class clusters over the same nodes;
under a commanded excess the control plane drops the sheddable class first: its clients get 429 +
Retry-After while every standard and critical request passes. The same with the bootstrap of several
control planes (``--group``), where the class clusters are static EDS clusters of the group's stream."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import aiohttp
import pytest

from xds_server.config import ShedClassesConfig, parse_config
from xds_server.envoy.bootstrap import ControlPlaneGroup, find_envoy, render_bootstrap, write_bootstrap
from xds_server.testing import ManagedProcess, free_port, wait_for

pytestmark = pytest.mark.envoy

FAST = {"probation": {"clean": "1m", "ramp_step_percent": 25, "ramp_step": "250ms"}}
CLASSES = ("sheddable", "standard", "critical")


class ClassLoad:
    """Closed-loop requests per class (``workers``: how many loops per class), counting statuses per
    class and phase; a shed client waits 20 ms (a scaled-down Retry-After) before its next request."""

    def __init__(self, url: str, workers: dict[str, int]) -> None:
        self.url, self.workers = url, workers
        self.counts: dict[str, collections.Counter] = {c: collections.Counter() for c in CLASSES}
        self.retry_after: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self._http: aiohttp.ClientSession | None = None

    async def _loop(self, klass: str) -> None:
        assert self._http is not None
        body = {"model": "sim-model", "prompt": "hi", "max_tokens": 1}
        while True:
            try:
                async with self._http.post(f"{self.url}/v1/completions", json=body,
                                           headers={"x-sentinel-priority": klass}) as r:
                    await r.read()
                    self.counts[klass][r.status] += 1
                    if r.status == 429:
                        self.retry_after.add(r.headers.get("Retry-After", ""))
                        await asyncio.sleep(0.02)
            except aiohttp.ClientError as e:
                self.counts[klass][type(e).__name__] += 1
                await asyncio.sleep(0.05)

    def phase(self) -> dict[str, collections.Counter]:
        """The counts since the last phase (and a fresh start)."""
        out, self.counts = self.counts, {c: collections.Counter() for c in CLASSES}
        return out

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self._tasks = [asyncio.create_task(self._loop(c)) for c in CLASSES for _ in range(self.workers[c])]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._http is not None:
            await self._http.close()


@pytest.fixture(params=["ads", "group"])
def class_envoy(request, tmp_path):
    """Start an Envoy routing request classes of a fleet (a function taking the fleet): over ADS
    (``--classes``), or as one of several control planes (``--group``: static EDS clusters, the
    class clusters and routes from the group's config)."""
    procs: list[ManagedProcess] = []

    def start(fleet) -> str:
        port, admin = free_port(), free_port()
        common = {"listener_port": port, "admin_port": admin, "per_try_timeout_s": 1.0,
                  "per_try_idle_timeout_s": 2.0, "node_id": "envoy-classes"}
        if request.param == "group":
            cfg = parse_config(fleet.config_dict())
            group = ControlPlaneGroup("pool", (f"127.0.0.1:{fleet.xds_port}",), tuple(cfg.clusters),
                                      cfg.lrs.shed.classes)
            doc = render_bootstrap(groups=[group], **common)
            assert "dynamic_resources" not in doc  # no ADS, no CDS: the class clusters are static EDS
        else:
            doc = render_bootstrap(xds_port=fleet.xds_port, classes=ShedClassesConfig(enabled=True), **common)
        boot = write_bootstrap(tmp_path / "envoy-classes.yaml", doc)
        p = ManagedProcess("envoy-classes", [find_envoy(), "-c", str(boot), "--disable-hot-restart",
                                             "--concurrency", "2", "-l", "warning"],
                           tmp_path / "envoy-classes.out")
        procs.append(p)
        p.start()
        return f"http://127.0.0.1:{port}"

    try:
        yield start
    finally:
        for p in procs:
            p.stop()


async def test_sheddable_class_is_shed_first_while_standard_and_critical_pass(make_fleet, http, class_envoy):
    fleet = make_fleet(n_nodes=2, health=FAST, config_options={"lrs": {"shed": {
        "enabled": True, "window_s": 2.0, "headroom_ratio": 0.2, "lift_after_s": 30.0,
        "queue_wait_budget_s": None,  # the seed's thresholds: the sim's fake queue never shortens
        "classes": {"enabled": True}}}})
    await fleet.wait_all_routed(http)
    url = class_envoy(fleet)

    async def every_class_routed() -> bool:
        for klass in CLASSES:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.post(f"{url}/v1/completions", headers={"x-sentinel-priority": klass},
                                     json={"model": "sim-model", "prompt": "hi", "max_tokens": 1}) as r:
                    if r.status != 200:
                        return False
                    continue
            return False
        return True

    await wait_for(every_class_routed, 20, what="Envoy routes every class")
    cp = f"http://127.0.0.1:{fleet.admin_port}"

    async def classes() -> dict:
        async with http.get(f"{cp}/clusters") as r:
            t = (await r.json())["clusters"][0]["traffic"]
        return {"total": t["shed_percent"], **{k: v["shed_percent"] for k, v in t["shed_classes"].items()}}

    # batch traffic is the larger share (3 loops of 5): the 20 % excess is within the sheddable class
    load = ClassLoad(url, {"sheddable": 3, "standard": 1, "critical": 1})
    await load.start()
    try:
        await asyncio.sleep(2.0)  # every class's demand is in the LRS window
        before = load.phase()
        for n in ("gpu-a", "gpu-b"):
            await fleet.set_fault(http, n, "queue", waiting=70)  # > queue_warning: shed the 20 % headroom
        commanded = await wait_for(lambda: _shedding(classes), 10, what="shedding started")
        await asyncio.sleep(1.0)  # Envoy has the class assignments
        load.phase()
        t0, seen = time.monotonic(), [await classes()]
        while time.monotonic() - t0 < 3.0:  # what was commanded through the phase
            await asyncio.sleep(0.5)
            seen.append(await classes())
        shed = load.phase()
        async with http.get(f"{cp}/metrics") as r:
            metrics = await r.text()
        span = time.monotonic() - t0
    finally:
        await load.stop()
    print(f"\nbefore: { {k: dict(v) for k, v in before.items()} }\ncommanded {commanded}, then {seen}\n"
          f"shedding ({span:.1f} s): { {k: dict(v) for k, v in shed.items()} }")
    assert all(set(before[k]) == {200} for k in CLASSES)  # nothing shed before the excess
    assert commanded["total"] >= 20 and commanded["sheddable"] > 0
    assert all(c["standard"] == c["critical"] == 0 for c in [commanded, *seen])
    assert set(shed["standard"]) == {200} and set(shed["critical"]) == {200}  # every one passed
    assert shed["standard"][200] > 20 and shed["critical"][200] > 20
    assert set(shed["sheddable"]) <= {200, 429} and shed["sheddable"][429] > 20
    assert load.retry_after == {"3"}
    line = next(x for x in metrics.splitlines() if x.startswith('sentinel_cluster_shed_ratio{class="sheddable"'))
    assert 0 < float(line.split()[-1]) <= 1
    assert 'sentinel_cluster_shed_ratio{class="critical",cluster="llm"} 0.0' in metrics
    share = 100.0 * shed["sheddable"][429] / sum(shed["sheddable"].values())
    low, high = min(c["sheddable"] for c in seen), max(c["sheddable"] for c in seen)
    assert low - 10 <= share <= high + 10, (share, seen)  # Envoy drops the class's commanded share


async def _shedding(classes) -> dict | None:
    c = await classes()
    return c if c["total"] and c["sheddable"] else None
