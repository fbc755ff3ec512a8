"""Stream-level xDS behaviour on the real control plane and servicer: many concurrent streams, a
client that stops reading, large requests, NACK accounting in admin/metrics (fc02), and stream
churn that must leave nothing behind (fc03)."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
import pytest
from conformance_support import CDS, EDS, cla, rss_bytes
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2
from prometheus_client.parser import text_string_to_metric_families

from xds_server.config import parse_config
from xds_server.health.model import Routing
from xds_server.xds.resources import build_cla

# fc02 asks for 30 s without a change; 1.5 s is 60 keepalive-free event-loop seconds to this
# server (nothing in it is timer-driven: a resend could only come from a bug in the bookkeeping).
FC02_QUIET_S = 1.5


async def metrics(admin_url: str) -> dict[tuple[str, tuple], float]:
    """Prometheus samples as {(sample name, sorted label items): value}."""
    async with aiohttp.ClientSession() as s, s.get(f"{admin_url}/metrics") as r:
        text = await r.text()
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


async def xds_clients(admin_url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"{admin_url}/xds/clients") as r:
        return await r.json()


def sotw_req(type_url, names=(), version="", nonce="", node_id=None, error=None):
    req = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=list(names), version_info=version,
                                         response_nonce=nonce)
    if node_id:
        req.node.id = node_id
    if error:
        req.error_detail.CopyFrom(status_pb2.Status(code=13, message=error))
    return req


def delta_req(type_url, subscribe=(), nonce="", node_id=None, error=None):
    req = discovery_pb2.DeltaDiscoveryRequest(type_url=type_url, resource_names_subscribe=list(subscribe),
                                              response_nonce=nonce)
    if node_id:
        req.node.id = node_id
    if error:
        req.error_detail.CopyFrom(status_pb2.Status(code=13, message=error))
    return req


async def read(s: RawStream, timeout_s: float = 3.0):
    return await s.read(timeout_s)


async def expect_silence(s: RawStream, duration_s: float) -> None:
    try:
        msg = await s.read(duration_s)
    except TimeoutError:
        return
    raise AssertionError(f"expected no response, got {msg}")


class RawStream:
    """One ADS stream on a raw grpc.aio call: SotW or delta, CDS+EDS handshake.

    A read that times out stays pending for the next :meth:`read` (cancelling a grpc.aio read
    would cancel the whole RPC).
    """

    def __init__(self, stub, variant: str, node_id: str) -> None:
        self.variant = variant
        self.node_id = node_id
        self.call = stub.StreamAggregatedResources() if variant == "sotw" else stub.DeltaAggregatedResources()
        self.eds = None
        self._pending: asyncio.Future | None = None

    async def read(self, timeout_s: float = 3.0):
        if self._pending is None:
            self._pending = asyncio.ensure_future(self.call.read())
        done, _ = await asyncio.wait({self._pending}, timeout=timeout_s)
        if not done:
            raise TimeoutError
        fut, self._pending = self._pending, None
        return fut.result()

    def cancel(self) -> None:
        self.call.cancel()

    async def handshake(self, names=("llm",)):
        if self.variant == "sotw":
            await self.call.write(sotw_req(CDS, node_id=self.node_id))
            cds = await read(self)
            await self.call.write(sotw_req(EDS, names))
            await self.call.write(sotw_req(CDS, version=cds.version_info, nonce=cds.nonce))
            self.eds = await read(self)
        else:
            await self.call.write(delta_req(CDS, node_id=self.node_id))
            cds = await read(self)
            await self.call.write(delta_req(EDS, names))
            await self.call.write(delta_req(CDS, nonce=cds.nonce))
            self.eds = await read(self)
        return self.eds

    async def ack(self, resp, names=("llm",)):
        if self.variant == "sotw":
            await self.call.write(sotw_req(EDS, names, version=resp.version_info, nonce=resp.nonce))
        else:
            await self.call.write(delta_req(EDS, nonce=resp.nonce))


def eds_version(resp) -> str:
    """The version a response carries for cluster llm (SotW: version_info; delta: the resource's)."""
    if isinstance(resp, discovery_pb2.DiscoveryResponse):
        return resp.version_info
    return next(r.version for r in resp.resources if r.name == "llm")


@pytest.mark.parametrize("variant", ["sotw", "delta"])
async def test_nack_counted_once_quiet_period_silent_then_exactly_one_response_after_change(
        control_plane, variant):
    """Field case fc02."""
    cp, admin = control_plane
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
        s = RawStream(ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch), variant, "envoy-fc02")
        v1 = await s.handshake(["llm"])                       # request, response v1/n1
        await s.ack(v1, ["llm"])                              # ACK
        if variant == "sotw":                                 # subscribe a second cluster
            await s.call.write(sotw_req(EDS, ["llm", "llm2"], version=v1.version_info, nonce=v1.nonce))
        else:
            await s.call.write(delta_req(EDS, ["llm2"]))
        n2 = await read(s)                               # response n2
        assert n2.nonce != v1.nonce
        if variant == "sotw":                                 # NACK of n2, version still v1
            await s.call.write(sotw_req(EDS, ["llm", "llm2"], version=v1.version_info, nonce=n2.nonce,
                                        error="weight must be >= 1"))
        else:
            await s.call.write(delta_req(EDS, nonce=n2.nonce, error="weight must be >= 1"))
        t0 = time.monotonic()
        await expect_silence(s, FC02_QUIET_S)           # zero responses in the quiet period
        assert time.monotonic() - t0 >= FC02_QUIET_S * 0.95
        view = await xds_clients(admin)
        (client,) = [c for c in view["clients"] if c["node_id"] == "envoy-fc02"]
        eds = client["types"]["ClusterLoadAssignment"]
        assert eds["nacks"] == 1
        assert eds["last_nack"]["nonce"] == n2.nonce and eds["last_nack"]["message"] == "weight must be >= 1"
        if variant == "sotw":
            assert eds["last_nack"]["version"] == v1.version_info
        assert {"node": "envoy-fc02", "variant": variant, "type": "ClusterLoadAssignment",
                "nacks": 1} in view["nacks_by_node"]
        m = await metrics(admin)
        assert m[("sentinel_xds_nacks_total", (("type", "ClusterLoadAssignment"), ("variant", variant)))] == 1
        # one weight change -> exactly one response
        c2 = cp.config.clusters[1]
        cp.cache.set_resource(EDS, "llm2", build_cla(c2, {"c": Routing(37, "HEALTHY")}))
        r = await read(s)
        assert r.nonce not in (v1.nonce, n2.nonce)
        await expect_silence(s, 0.3)
        m = await metrics(admin)
        assert m[("sentinel_xds_nacks_total", (("type", "ClusterLoadAssignment"), ("variant", variant)))] == 1


async def test_nacks_are_counted_per_variant_and_type_and_shown_per_node_only_while_connected(control_plane):
    cp, admin = control_plane
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch)
        for node in ("envoy-x", "envoy-y"):
            s = RawStream(stub, "sotw", node)
            eds = await s.handshake()
            await s.call.write(sotw_req(EDS, ["llm"], version="", nonce=eds.nonce, error="no"))
            await s.call.write(sotw_req(CDS, version="", nonce="bogus-stale", error="ignored: stale"))
        await asyncio.sleep(0.2)
        m = await metrics(admin)
        view = await xds_clients(admin)
        for node in ("envoy-x", "envoy-y"):
            assert {"node": node, "variant": "sotw", "type": "ClusterLoadAssignment",
                    "nacks": 1} in view["nacks_by_node"]
        assert not [n for n in view["nacks_by_node"] if n["type"] == "Cluster"]
    assert m[("sentinel_xds_nacks_total", (("type", "ClusterLoadAssignment"), ("variant", "sotw")))] == 2
    assert ("sentinel_xds_nacks_total", (("type", "Cluster"), ("variant", "sotw"))) not in m
    assert m[("sentinel_xds_requests_total", (("kind", "stale"), ("type", "Cluster"), ("variant", "sotw")))] == 2
    assert not any("node" in dict(labels) for name, labels in m if name.startswith("sentinel_xds"))
    for _ in range(100):  # the streams are closed: their node ids are gone from /xds/clients
        view = await xds_clients(admin)
        if not view["clients"]:
            break
        await asyncio.sleep(0.02)
    assert view["nacks_by_node"] == [] and view["clients"] == []


async def test_large_request_of_150k_names_over_4mib_is_accepted(control_plane):
    cp, _ = control_plane
    names = [f"a-cluster-with-quite-a-long-name-{i:06d}" for i in range(150_000)] + ["llm"]
    req = sotw_req(EDS, names, node_id="big")
    assert req.ByteSize() > 4 * 1024 * 1024  # over gRPC's default 4 MiB receive limit
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch).StreamAggregatedResources()
        await call.write(req)
        r = await asyncio.wait_for(call.read(), 10)
        # what exists, plus empty assignments for the first xds.limits.absent_names_max_per_stream (1,000)
        # names that exist nowhere, never 150,000 of them
        names_sent = [endpoint_pb2.ClusterLoadAssignment.FromString(a.value).cluster_name for a in r.resources]
        assert len(r.resources) == 1 + 1000 and "llm" in names_sent
        assert sum(1 for a in r.resources
                   if not endpoint_pb2.ClusterLoadAssignment.FromString(a.value).endpoints) == 1000


async def test_many_concurrent_streams_sotw_and_delta_all_receive_each_change(ads):
    n_per_variant = 100
    channels = [grpc.aio.insecure_channel(ads.target) for _ in range(4)]
    try:
        streams = [RawStream(ads_pb2_grpc.AggregatedDiscoveryServiceStub(channels[i % 4]),
                             "sotw" if i % 2 else "delta", f"envoy-{i}") for i in range(2 * n_per_variant)]
        firsts = await asyncio.gather(*(s.handshake() for s in streams))
        await asyncio.gather(*(s.ack(r) for s, r in zip(streams, firsts, strict=True)))
        assert len(ads.servicer.streams) == 2 * n_per_variant
        for weight in (11, 12, 13):
            t0 = time.monotonic()
            ads.cache.set_resource(EDS, "llm", cla(weight=weight))
            want = ads.cache.resources(EDS)["llm"].version
            resps = await asyncio.gather(*(read(s, 5) for s in streams))
            elapsed = time.monotonic() - t0
            for s, r in zip(streams, resps, strict=True):
                got = r.version_info if s.variant == "sotw" else r.resources[0].version
                if s.variant == "sotw":
                    assert r.resources[0].value == ads.cache.resources(EDS)["llm"].any.value
                else:
                    assert got == want
            await asyncio.gather(*(s.ack(r) for s, r in zip(streams, resps, strict=True)))
            print(f"\n{len(streams)} streams got weight {weight} in {elapsed * 1000:.0f} ms")
            assert elapsed < 3.0
    finally:
        for ch in channels:
            await ch.close()


async def test_client_that_stops_reading_does_not_block_other_streams(ads):
    big = parse_config({"clusters": [{"name": "llm", "nodes": [
        {"id": f"n{i}", "address": f"10.1.{i // 250}.{i % 250 + 1}:8000", "probe_address": "127.0.0.1:1"}
        for i in range(2000)]}]}).clusters[0]

    prebuilt = [build_cla(big, {f"n{i}": Routing(w + i % 7, "HEALTHY") for i in range(2000)}) for w in (1, 2, 3)]

    def big_cla(w: int):
        return prebuilt[w % 3]  # consecutive changes always differ

    ads.cache.set_resource(EDS, "llm", big_cla(1))
    async with grpc.aio.insecure_channel(ads.target) as ch_slow, grpc.aio.insecure_channel(ads.target) as ch_fast:
        slow = RawStream(ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch_slow), "sotw", "slow")
        fast = RawStream(ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch_fast), "delta", "fast")
        await slow.handshake()
        r = await fast.handshake()
        await fast.ack(r)
        size = ads.cache.resources(EDS)["llm"].any.ByteSize()
        lat = []
        # 150 x ~70 KB = ~10 MB: beyond what gRPC buffers for a stream whose reader stalled
        # (~65 messages, ~4.5 MB here); from then on the stalled stream's writer waits and its
        # updates coalesce, while the other stream is served as usual.
        n_changes = 150
        for w in range(2, 2 + n_changes):
            ads.cache.set_resource(EDS, "llm", big_cla(w))
            want = ads.cache.resources(EDS)["llm"].version
            t0 = time.monotonic()
            r = await read(fast, 2)
            lat.append(time.monotonic() - t0)
            assert r.resources[0].version == want
            await fast.ack(r)
        slow_state = ads.servicer.streams[next(k for k, s in ads.servicer.streams.items() if s.node_id == "slow")]
        sent_to_slow = slow_state.types[EDS].responses
        print(f"\nassignment {size} bytes; fast stream p100 latency {max(lat) * 1000:.1f} ms over "
              f"{n_changes} changes; responses written to the stalled stream: {sent_to_slow}")
        assert max(lat) < 0.5
        assert sent_to_slow < n_changes  # it was not fed a backlog
        # the slow client resumes reading: it ends on the latest version (coalesced, not replayed)
        latest = ads.cache.resources(EDS)["llm"].version
        seen = []
        while True:
            r = await read(slow, 3)
            seen.append(r)
            if r.resources[0].value == ads.cache.resources(EDS)["llm"].any.value:
                break
            await slow.ack(r)
        assert len(seen) < n_changes and latest


@pytest.mark.parametrize("variant", ["sotw", "delta"])
async def test_500_stream_churn_leaves_no_streams_subscriptions_tasks_or_memory(control_plane, variant):
    """Field case fc03."""
    cp, admin = control_plane
    c1 = cp.config.clusters[0]

    async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch)

        async def cycle(i: int) -> None:
            s = RawStream(stub, variant, f"churn-{i}")
            eds = await s.handshake()
            if i % 3 == 0:  # a weight change while the stream is in flight
                cp.cache.set_resource(EDS, "llm", build_cla(c1, {"a": Routing(100 + i, "HEALTHY")}))
            if i % 2 == 0:
                await s.ack(eds)
            s.cancel()

        for i in range(30):  # warm-up: grpc pools, code paths, caches
            await cycle(i)
        await asyncio.sleep(0.3)
        baseline_tasks = len(asyncio.all_tasks())
        baseline_rss = rss_bytes()
        t0 = time.monotonic()
        for i in range(500):
            await cycle(i)
        churn_s = time.monotonic() - t0
        for _ in range(100):  # idle until the server has noticed every cancel (fc03: idle 5 s)
            if not cp.ads.streams:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        tasks = len(asyncio.all_tasks())
        growth = rss_bytes() - baseline_rss
    m = await metrics(admin)
    view = await xds_clients(admin)
    print(f"\n{variant}: 500 cycles in {churn_s:.2f} s; tasks {baseline_tasks} -> {tasks}; "
          f"RSS growth {growth / 1e6:.2f} MB")
    assert view["clients"] == [] and view["streams"] == 0 and view["subscriptions"] == 0
    assert sum(v for (name, _), v in m.items() if name == "sentinel_xds_connected_streams") == 0
    assert m[("sentinel_xds_subscriptions", ())] == 0
    assert m[("sentinel_xds_cache_watchers", ())] == 0
    assert m[("sentinel_xds_streams_opened_total", ())] >= 530
    assert tasks <= baseline_tasks + 5
    assert growth < 10 * 1024 * 1024


async def test_isolated_change_goes_out_at_once_and_a_burst_within_the_window_is_one_push():
    from conformance_support import control_plane_config

    from xds_server.health import model as hm
    from xds_server.server import ControlPlane
    from xds_server.testing import free_port

    cfg = control_plane_config(coalesce_window_ms=150)
    # the nodes' agents do not exist: their first dial fails at start (nodes COLD, no verdict) and
    # the next comes 10 s later, after the test. With 1 s, a re-dial failing inside the measured
    # window turned a node heard by node_up() UNHEALTHY: a fifth publish (seen under load).
    cfg["health"] = {**cfg["health"], "reconnect_backoff_initial_ms": 10000, "reconnect_backoff_max_ms": 10000}
    cfg["clusters"] = [{"name": "llm", "nodes": [
        {"id": nid, "address": f"127.0.0.1:{8001 + i}", "probe_address": f"127.0.0.1:{free_port()}"}
        for i, nid in enumerate("abcd")]}]
    cp = ControlPlane(parse_config(cfg))
    await cp.start()
    try:
        for _ in range(200):
            if cp.cla_version("llm"):
                break
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            s = RawStream(ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch), "delta", "coalesce")
            first = await s.handshake()
            await s.ack(first)
            await expect_silence(s, 0.5)  # well past the windows of the start-up publishes
            encodes = cp.cache.encode_count
            loop = asyncio.get_running_loop()

            def node_up(node: str) -> None:
                cp.observe(node, hm.HeartbeatObserved(engine_state="READY"), loop.time())
                cp.observe(node, hm.ProbeObserved(hm.ProbeResultKind.OK, ttft_ms=20.0), loop.time())

            t0 = loop.time()
            node_up("a")  # isolated: published at once
            r1 = await read(s, 2)
            t1 = loop.time() - t0
            await s.ack(r1)
            for node in "bcd":  # a burst right after a publish: coalesced
                node_up(node)
                await asyncio.sleep(0.01)
            r2 = await read(s, 2)
            t2 = loop.time() - t0
            await s.ack(r2)
            await expect_silence(s, 0.3)
            print(f"\nisolated change pushed after {t1 * 1000:.1f} ms; burst of 3 pushed once after "
                  f"{t2 * 1000:.1f} ms (window 150 ms)")
            assert t1 < 0.075  # not held for the 150 ms window
            assert t2 >= 0.14  # held to the end of the window that started with the first publish
            assert cp.cache.encode_count == encodes + 2  # two builds for four changes
            statuses = {e.endpoint.hostname: e.health_status for lle in endpoint_pb2_cla(r2).endpoints
                        for e in lle.lb_endpoints}
            assert all(statuses[n] != 2 for n in "abcd")  # all four in the second push (2 = UNHEALTHY)
    finally:
        await cp.stop()


def endpoint_pb2_cla(resp):
    from envoy.config.endpoint.v3 import endpoint_pb2

    m = endpoint_pb2.ClusterLoadAssignment()
    resp.resources[0].resource.Unpack(m)
    return m
