"""The fault matrix's xDS faults against a :class:`~xds_server.testing._fault_rig.FaultRig`'s real
xds-server process, under traffic through its Envoy: a slow ADS reader beside fast ones
(:func:`slow_ads_reader`) and streams opened and abruptly closed (:func:`ads_stream_churn`).
Memory is the server's VmRSS (``/proc``), tasks its ``sentinel_event_loop_tasks`` metric."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from xds_server.process.cancellation import cancel_and_wait
from xds_server.testing._fault_rig import TOKEN, FaultRig, FaultRow, _loads, _warm, prometheus_value
from xds_server.testing._wait import wait_for

__all__ = ["ads_stream_churn", "slow_ads_reader"]

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def rss_bytes(pid: int) -> int:
    """VmRSS of process ``pid`` in bytes (0 if unreadable)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def pct(xs: list[float], p: float) -> float:
    """The ``p`` (0..1) quantile of ``xs`` (nearest rank; NaN when empty)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


class _FastClient:
    """A delta ADS client subscribed to the cluster that reads and ACKs every response at once,
    noting when each EDS response arrived (``time.monotonic``). One raw call, no request
    iterator: :meth:`close` cancels it and closes the channel, bounded at 5 s."""

    def __init__(self, target: str, node_id: str, cluster: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.node_id, self.cluster = node_id, cluster
        self.eds_at: list[float] = []
        self.call: Any = None
        self.task: asyncio.Task | None = None

    async def open(self) -> None:
        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel).DeltaAggregatedResources()
        first = discovery_pb2.DeltaDiscoveryRequest(type_url=CDS)
        first.node.id = self.node_id
        await self.call.write(first)
        await self.call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=EDS,
                                                                  resource_names_subscribe=[self.cluster]))
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            r = await self.call.read()
            if r is grpc.aio.EOF:  # type: ignore[attr-defined]  # grpc-stubs 1.53 lacks grpc.aio.EOF
                return
            if r.type_url == EDS and r.resources:
                self.eds_at.append(time.monotonic())
            await self.call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=r.type_url, response_nonce=r.nonce))

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        if self.task is not None:
            with contextlib.suppress(Exception):  # its own failure or a task that will not end in 5 s
                await asyncio.wait_for(cancel_and_wait(self.task), 5.0)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.channel.close(grace=None), 5.0)


async def _slow_stream(target: str, cluster: str) -> tuple[grpc.aio.Channel, Any]:
    """A SotW stream that asks for CDS and EDS and never reads a response."""
    ch = grpc.aio.insecure_channel(target)
    call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch).StreamAggregatedResources()
    first = discovery_pb2.DiscoveryRequest(type_url=CDS)
    first.node.id = "slow-reader"
    await call.write(first)
    await call.write(discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=[cluster]))
    return ch, call


async def _push_round(rig: FaultRig, http: aiohttp.ClientSession, fast: list[_FastClient],
                      drain: bool) -> tuple[list[float], float]:
    """Drain (or undrain) the last node through the admin API; return each fast client's delay
    (s) from the request to its next EDS response, and the admin API's answer time (s; the
    drain is published before the answer is written). Raises AssertionError after 10 s."""
    fleet = rig.fleet
    assert fleet is not None
    counts = [len(f.eds_at) for f in fast]
    t0 = time.monotonic()
    node = fleet.nodes[-1].node_id
    async with http.post(f"http://127.0.0.1:{fleet.admin_port}/nodes/{node}/{'drain' if drain else 'undrain'}",
                         headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        r.raise_for_status()
    answered_s = time.monotonic() - t0
    await wait_for(lambda: all(len(f.eds_at) > n for f, n in zip(fast, counts, strict=True)), timeout_s=10.0,
                   step_s=0.005, what="every fast client got the change")
    return [f.eds_at[n] - t0 for f, n in zip(fast, counts, strict=True)], answered_s


async def slow_ads_reader(rig: FaultRig, http: aiohttp.ClientSession, fast: int = 100, changes: int = 20,
                          **load_kw: Any) -> tuple[list[FaultRow], dict]:
    """``fast`` delta clients ACKing every response; ``changes`` EDS changes (drain/undrain of a
    node) without, then as many with, a SotW stream that never reads beside them. Returns the
    row and ``{"p50_ms"/"p99_ms"/"max_ms"/"admin_answer_max_ms": {"alone", "with_slow"},
    "rss_growth_mb", "slow_open"}`` (``admin_answer_max_ms``: the slowest drain request's answer;
    the drain is published before the answer is written, so a round where the answer and every
    client's push are both late was delayed before the fan-out)."""
    fleet = rig.fleet
    assert fleet is not None and fleet.control_plane is not None
    target = f"127.0.0.1:{fleet.xds_port}"
    clients = [_FastClient(target, f"fast-{i}", fleet.cluster) for i in range(fast)]
    slow = None
    lat: dict[str, list[float]] = {"alone": [], "with_slow": []}
    answers: dict[str, list[float]] = {"alone": [], "with_slow": []}

    async def push(phase: str, drain: bool) -> None:
        delays, answered_s = await _push_round(rig, http, clients, drain)
        lat[phase] += delays
        answers[phase].append(answered_s)

    async with _loads(rig, **load_kw) as loads:
        await _warm(loads)
        try:
            await asyncio.gather(*(c.open() for c in clients))
            await wait_for(lambda: all(c.eds_at for c in clients), timeout_s=20.0, what="fast clients subscribed")
            for i in range(changes):
                await push("alone", drain=i % 2 == 0)
            rss0 = rss_bytes(fleet.control_plane.pid)
            slow = await _slow_stream(target, fleet.cluster)
            for i in range(changes):
                await push("with_slow", drain=i % 2 == 0)
            rss1 = rss_bytes(fleet.control_plane.pid)
            async with http.get(f"http://127.0.0.1:{fleet.admin_port}/xds/clients") as r:
                slow_open = any(c["node_id"] == "slow-reader" for c in (await r.json())["clients"])
        finally:
            if slow is not None:
                slow[1].cancel()
                await slow[0].close(None)
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
            if changes % 2:
                async with http.post(f"http://127.0.0.1:{fleet.admin_port}/nodes/{fleet.nodes[-1].node_id}/undrain",
                                     headers={"Authorization": f"Bearer {TOKEN}"}):
                    pass
    p50 = {k: round(pct(v, 0.5) * 1e3, 1) for k, v in lat.items()}
    p99 = {k: round(pct(v, 0.99) * 1e3, 1) for k, v in lat.items()}
    answer_max = {k: round(max(v) * 1e3, 1) for k, v in answers.items()}
    growth_mb = round((rss1 - rss0) / 1e6, 2)
    info = {"p50_ms": p50, "p99_ms": p99, "max_ms": {k: round(max(v) * 1e3, 1) for k, v in lat.items()},
            "admin_answer_max_ms": answer_max, "rss_growth_mb": growth_mb, "slow_open": slow_open}
    rows = [FaultRow(f"slow ADS reader beside {fast} fast", "Envoy", changes, loads[0].totals(),
                     notes=f"fast push p50/p99 {p50['alone']}/{p99['alone']} ms alone, "
                           f"{p50['with_slow']}/{p99['with_slow']} ms beside the slow "
                           f"reader (slowest admin answer {answer_max['alone']}/"
                           f"{answer_max['with_slow']} ms); server RSS {growth_mb:+.1f} MB")]
    return rows, info


async def _server_view(rig: FaultRig, http: aiohttp.ClientSession) -> tuple[int, float]:
    """(ADS streams open, event-loop tasks) of the rig's control plane."""
    fleet = rig.fleet
    assert fleet is not None
    base = f"http://127.0.0.1:{fleet.admin_port}"
    async with http.get(f"{base}/xds/clients") as r:
        streams = (await r.json())["streams"]
    async with http.get(f"{base}/metrics") as r:
        tasks = prometheus_value(await r.text(), "sentinel_event_loop_tasks")
    return streams, tasks


async def ads_stream_churn(rig: FaultRig, http: aiohttp.ClientSession, streams: int = 5000, parallel: int = 20,
                           **load_kw: Any) -> tuple[list[FaultRow], dict]:
    """Open ``streams`` ADS streams (SotW and delta alternately, ``parallel`` at a time), read
    the first response and close each abruptly: the call cancelled (RST_STREAM), every 10th
    stream's whole channel closed (TCP close). Then wait until the server is back to the
    streams it had; report RSS and task counts before and after. Returns the row and
    ``{"tasks": (before, after), "rss_mb": (before, after), "growth_mb", "seconds"}``."""
    fleet = rig.fleet
    assert fleet is not None and fleet.control_plane is not None
    target = f"127.0.0.1:{fleet.xds_port}"
    shared = grpc.aio.insecure_channel(target)
    stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(shared)

    async def one(i: int) -> None:
        own = grpc.aio.insecure_channel(target) if i % 10 == 0 else None
        s = ads_pb2_grpc.AggregatedDiscoveryServiceStub(own) if own is not None else stub
        if i % 2:
            call = s.StreamAggregatedResources()
            req = discovery_pb2.DiscoveryRequest(type_url=CDS)
        else:
            call = s.DeltaAggregatedResources()
            req = discovery_pb2.DeltaDiscoveryRequest(type_url=CDS)
        req.node.id = f"churn-{i}"
        await call.write(req)
        await asyncio.wait_for(call.read(), 10.0)
        call.cancel()
        if own is not None:
            await own.close(grace=None)

    async def run(lo: int, hi: int) -> None:
        sem = asyncio.Semaphore(parallel)

        async def guarded(i: int) -> None:
            async with sem:
                await one(i)
        await asyncio.gather(*(guarded(i) for i in range(lo, hi)))

    async with _loads(rig, **load_kw) as loads:
        await _warm(loads)
        try:
            base_streams, _ = await _server_view(rig, http)
            await run(0, 50)  # warm-up: grpc pools, code paths
            await wait_for(lambda: _settled(rig, http, base_streams), timeout_s=20.0, what="warm-up streams closed")
            _, tasks0 = await _server_view(rig, http)
            rss0 = rss_bytes(fleet.control_plane.pid)
            t0 = time.monotonic()
            await run(50, 50 + streams)
            took = time.monotonic() - t0
            await wait_for(lambda: _settled(rig, http, base_streams), timeout_s=30.0, what="churned streams closed")
            # tasks of streams whose cancel is still being processed end within moments
            await wait_for(lambda: _tasks_at_most(rig, http, tasks0 + 5), timeout_s=10.0, what="tasks back to baseline")
            _, tasks1 = await _server_view(rig, http)
            rss1 = rss_bytes(fleet.control_plane.pid)
        finally:
            await shared.close(grace=None)
    tasks = (int(tasks0), int(tasks1))
    rss_mb = (round(rss0 / 1e6, 1), round(rss1 / 1e6, 1))
    seconds = round(took, 2)
    info = {"tasks": tasks, "rss_mb": rss_mb, "growth_mb": round((rss1 - rss0) / 1e6, 2), "seconds": seconds}
    rows = [FaultRow(f"{streams:,} ADS streams opened and abruptly closed", "Envoy", 1, loads[0].totals(),
                     notes=f"in {seconds} s; server tasks {tasks[0]} -> {tasks[1]}, "
                           f"RSS {rss_mb[0]} -> {rss_mb[1]} MB")]
    return rows, info


async def _settled(rig: FaultRig, http: aiohttp.ClientSession, streams: int) -> bool:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
        return (await _server_view(rig, http))[0] <= streams
    return False


async def _tasks_at_most(rig: FaultRig, http: aiohttp.ClientSession, n: float) -> bool:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
        return (await _server_view(rig, http))[1] <= n
    return False
