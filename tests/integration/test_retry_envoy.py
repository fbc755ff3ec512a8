"""Retries that can succeed, through the real Envoy: the bootstrap's retry policy
leaves a failing priority (``previous_priorities``) and honours ``Retry-After``, bounded
(``rate_limited_retry_back_off``). Upstreams are real aiohttp servers on 127.0.0.1; the
assignment comes from an in-process ADS server over a real gRPC stream."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import aiohttp
import grpc
import pytest
from aiohttp import web

from xds_server.config import parse_config
from xds_server.health.model import Routing
from xds_server.testing import StandaloneEnvoy, free_port, wait_for
from xds_server.xds.ads import AdsServicer
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.resources import CLA_TYPE_URL as EDS
from xds_server.xds.resources import CLUSTER_TYPE_URL as CDS
from xds_server.xds.resources import build_cla, build_cluster

pytestmark = pytest.mark.envoy


@dataclass
class Upstream:
    """One engine stand-in: answers ``status`` (with ``headers``) to the first ``fail_first``
    requests (every request when None), then 200; records each request's monotonic time."""

    name: str
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    fail_first: int | None = None
    seen: list[float] = field(default_factory=list)
    port: int = 0
    runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.seen.append(time.monotonic())
        failing = self.status != 200 and (self.fail_first is None or len(self.seen) <= self.fail_first)
        if failing:
            return web.Response(status=self.status, headers=self.headers, text=f"{self.name} busy")
        return web.json_response({"served_by": self.name})

    async def start(self) -> Upstream:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def rig():
    """``start(p0, p1)``: a cluster ``llm`` with upstream ``p0`` alone in priority 0 and ``p1`` in
    priority 1, both published HEALTHY, served to a real Envoy; returns the Envoy."""
    started: list = []

    async def start(p0: Upstream, p1: Upstream, retry_after_max_s: float | None = None) -> StandaloneEnvoy:
        for u in (p0, p1):
            await u.start()
            started.append(u)
        cfg = parse_config({"clusters": [{"name": "llm", "nodes": [
            {"id": p0.name, "address": f"127.0.0.1:{p0.port}", "probe_address": "127.0.0.1:1", "priority": 0},
            {"id": p1.name, "address": f"127.0.0.1:{p1.port}", "probe_address": "127.0.0.1:2", "priority": 1},
        ]}]}).clusters[0]
        cache = SnapshotCache()
        cache.set_resource(CDS, "llm", build_cluster(cfg))
        cache.set_resource(EDS, "llm", build_cla(cfg, {p0.name: Routing(100, "HEALTHY"),
                                                         p1.name: Routing(100, "HEALTHY")}))
        srv = grpc.aio.server()
        AdsServicer(cache).add_to_server(srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        started.append(srv)
        envoy = StandaloneEnvoy(port, retry_after_max_s=retry_after_max_s)
        started.append(envoy)
        await envoy.start()

        async def two_priorities() -> bool:
            hosts = await envoy.hosts()
            return sorted(h["priority"] for h in hosts.values()) == [0, 1]

        await wait_for(two_priorities, timeout_s=10.0, step_s=0.05)
        return envoy

    try:
        yield start
    finally:
        for x in reversed(started):
            if isinstance(x, StandaloneEnvoy):
                x.stop()
            elif isinstance(x, Upstream):
                await x.stop()
            else:
                await x.stop(0)


async def post(envoy: StandaloneEnvoy, n: int) -> list[tuple[int, str, float]]:
    """``n`` sequential completions through Envoy: (status, body, seconds) each."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        for _ in range(n):
            t0 = time.monotonic()
            async with s.post(f"{envoy.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
                out.append((r.status, await r.text(), time.monotonic() - t0))
    return out


@pytest.mark.parametrize("status", [503, 429])
async def test_retry_01_status_on_the_last_priority0_host_is_answered_from_priority1_20_of_20(rig, status):
    p0, p1 = Upstream("p0", status=status), Upstream("p1")
    envoy = await rig(p0, p1)
    results = await post(envoy, 20)
    assert [r[0] for r in results] == [200] * 20, results
    assert all('"p1"' in r[1] for r in results)
    # Priority 0 carries all the load, so requests went there first (until Envoy's own outlier
    # detection ejects p0 after 5 consecutive 5xx; 429 is not a 5xx and never ejects it) ...
    assert len(p0.seen) >= (20 if status == 429 else 5)
    # ... and each attempt on p0 was retried exactly once, on priority 1: never back on p0.
    stats = await envoy.stats(r"^cluster\.llm\.upstream_rq_retry$")
    assert stats["cluster.llm.upstream_rq_retry"] == len(p0.seen)
    assert len(p1.seen) == 20


async def test_retry_02_retry_after_1s_on_429_is_honoured_retry_1_to_2_5s_later(rig):
    p0, p1 = Upstream("p0", status=429, headers={"Retry-After": "1"}, fail_first=1), Upstream("p1")
    envoy = await rig(p0, p1)
    [(status, body, _)] = await post(envoy, 1)
    assert status == 200 and '"p1"' in body
    gap = p1.seen[0] - p0.seen[0]
    print(f"\nRetry-After 1 s: retried after {gap * 1000:.0f} ms")
    assert 0.95 <= gap <= 2.5   # Envoy waits 1x-1.5x of the header (plus scheduling)


async def test_retry_03_retry_after_3600s_on_503_is_bounded_by_max_interval_retry_within_1s(rig):
    p0, p1 = Upstream("p0", status=503, headers={"Retry-After": "3600"}, fail_first=1), Upstream("p1")
    envoy = await rig(p0, p1, retry_after_max_s=2.0)
    [(status, body, elapsed)] = await post(envoy, 1)
    assert status == 200 and '"p1"' in body
    gap = p1.seen[0] - p0.seen[0]
    print(f"\nRetry-After 3600 s (bound 2 s): retried after {gap * 1000:.0f} ms")
    assert gap < 1.0 and elapsed < 1.5   # above the bound the header is ignored: normal back-off
