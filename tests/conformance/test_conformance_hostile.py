"""Hostile xDS clients: random and hand-made DiscoveryRequest / DeltaDiscoveryRequest
sequences, undecodable bytes, floods and huge subscriptions against the real servicer on real
gRPC streams. The server must stay up, keep serving a clean client and other streams, never
turn client text into metric labels or raw log lines, and give memory back when hostile streams
close. Each hand-made regression test is named after the hostile case it covers."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import grpc
import pytest
from conformance_support import CDS, EDS, cla, rss_bytes, start_ads_server, stop_ads_server
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xds_server.config import XdsConfig
from xds_server.testing import wait_for
from xds_server.xds.delta import DeltaStream
from xds_server.xds.protocol import StreamIdentity, Verdict

_SERVICE = "/envoy.service.discovery.v3.AggregatedDiscoveryService/"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
DEADLINE_S = 5.0  # liveness bound for a clean client's update (not a speed goal: see benchmarks/)


def raw_call(channel: grpc.aio.Channel, variant: str):
    """An ADS call that sends and receives bytes as they are (so undecodable bytes can be sent)."""
    method = "StreamAggregatedResources" if variant == "sotw" else "DeltaAggregatedResources"
    return channel.stream_stream(_SERVICE + method, request_serializer=None, response_deserializer=None)()


async def drain_call(call, timeout_s: float = 0.5) -> grpc.StatusCode | None:
    """Read what the server sends until the call ends or ``timeout_s`` of silence; the status if
    it ended, else None. A read that times out is left pending, not cancelled (cancelling a
    grpc.aio read cancels the RPC)."""
    try:
        while True:
            pending = asyncio.ensure_future(call.read())
            done, _ = await asyncio.wait({pending}, timeout=timeout_s)
            if not done:
                return None
            if pending.result() is grpc.aio.EOF:
                return await call.code()
    except grpc.aio.AioRpcError as e:
        return e.code()


# ---- random hostile request sequences ---------------------------------------------------------

texts = st.one_of(st.sampled_from(["", "llm", "llm2", "*", "x" * 5_000, "a\nFORGED b\x1b[2J"]), st.text(max_size=40))
type_urls = st.one_of(st.sampled_from([CDS, EDS, LDS, "", "t" * 600]), st.text(max_size=60))
nodes = st.one_of(st.none(), texts, st.just("n" * 70_000))
errors = st.one_of(st.none(), st.text(max_size=50), st.just("e" * 50_000))


@st.composite
def sotw_request(draw) -> bytes:
    req = discovery_pb2.DiscoveryRequest(
        type_url=draw(type_urls), resource_names=draw(st.lists(texts, max_size=8)),
        version_info=draw(texts), response_nonce=draw(texts))
    node = draw(nodes)
    if node is not None:
        req.node.id = node
        req.node.cluster = draw(texts)
    err = draw(errors)
    if err is not None:
        req.error_detail.CopyFrom(status_pb2.Status(code=draw(st.integers(-5, 20)), message=err))
    return req.SerializeToString()


@st.composite
def delta_request(draw) -> bytes:
    req = discovery_pb2.DeltaDiscoveryRequest(
        type_url=draw(type_urls), resource_names_subscribe=draw(st.lists(texts, max_size=8)),
        resource_names_unsubscribe=draw(st.lists(texts, max_size=4)), response_nonce=draw(texts),
        initial_resource_versions=draw(st.dictionaries(texts, texts, max_size=4)))
    node = draw(nodes)
    if node is not None:
        req.node.id = node
    err = draw(errors)
    if err is not None:
        req.error_detail.CopyFrom(status_pb2.Status(code=13, message=err))
    return req.SerializeToString()


junk = st.one_of(st.binary(min_size=1, max_size=64), st.just(b"\xff" * 10), st.just(b"\x0a\xff\xff\xff\xff\x0f"))


@pytest.fixture
async def hostile_env():
    """An ADS server with default limits and one clean delta client subscribed to llm."""
    s = await start_ads_server(**{"grpc.max_receive_message_length": XdsConfig().limits.max_receive_message_bytes})
    clean = await s.delta()
    await clean.send(type_url=CDS, node_id="clean")
    cds = await clean.recv()
    await clean.send(type_url=CDS, nonce=cds.nonce)
    await clean.send(type_url=EDS, subscribe=["llm"])
    eds = await clean.recv()
    await clean.send(type_url=EDS, nonce=eds.nonce)
    channel = grpc.aio.insecure_channel(s.target)
    yield s, clean, channel, {"weight": 200}
    await channel.close()
    await stop_ads_server(s)


async def clean_client_gets_the_next_update(s, clean, state) -> None:
    state["weight"] += 1
    s.cache.set_resource(EDS, "llm", cla(weight=state["weight"]))
    want = s.cache.resources(EDS)["llm"]
    r = await clean.recv(DEADLINE_S)
    assert [x.version for x in r.resources] == [want.version]
    assert r.resources[0].resource.value == want.any.value
    await clean.send(type_url=EDS, nonce=r.nonce)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(variant=st.sampled_from(["sotw", "delta"]), data=st.data())
async def test_hostile_xds_client_random_sequences_never_stop_the_server_or_a_clean_client(hostile_env, variant, data):
    s, clean, channel, state = hostile_env
    msgs = data.draw(st.lists(st.one_of(sotw_request() if variant == "sotw" else delta_request(), junk),
                              min_size=1, max_size=10))
    rejected_before = sum(s.servicer.stats.rejected.values())
    call = raw_call(channel, variant)
    try:
        write_failed = False
        for m in msgs:
            try:
                await call.write(m)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                write_failed = True  # the server ended the stream; the client sees its own error
                break
        code = await drain_call(call, 0.2)
        ended_by_server = sum(s.servicer.stats.rejected.values()) > rejected_before
        if write_failed or code == grpc.StatusCode.INVALID_ARGUMENT:
            assert ended_by_server  # ended on purpose (INVALID_ARGUMENT), not by a crash
        else:
            assert code is None and not ended_by_server  # still open, served
        await clean_client_gets_the_next_update(s, clean, state)
    finally:
        call.cancel()
    await wait_for(lambda: len(s.servicer.streams) == 1, timeout_s=5.0, step_s=0.02)  # only the clean client is left
    for key in s.servicer.stats.requests:  # labels come from bounded sets only
        assert key[0] in ("sotw", "delta") and key[1] in ("Cluster", "ClusterLoadAssignment", "unknown")
        assert key[2] in {v.value for v in Verdict}


# ---- hand-made cases, one regression test per hostile case ------------------------------------


async def test_undecodable_request_ends_the_stream_with_invalid_argument(hostile_env):
    s, clean, channel, state = hostile_env
    for variant in ("sotw", "delta"):
        call = raw_call(channel, variant)
        await call.write(b"\x0a\xff\xff\xff\xff\x0f")  # a length-delimited field longer than the message
        assert await drain_call(call, 3.0) == grpc.StatusCode.INVALID_ARGUMENT
        details = await call.details()
        assert "undecodable" in details
        assert s.servicer.stats.rejected[(variant, "undecodable")] == 1
    await clean_client_gets_the_next_update(s, clean, state)


@pytest.mark.parametrize("variant", ["sotw", "delta"])
async def test_closed_ads_streams_of_20k_names_leave_no_memory_behind(variant):
    s = await start_ads_server(**{"grpc.max_receive_message_length": XdsConfig().limits.max_receive_message_bytes})
    try:
        async def one(i: int) -> None:
            names = [f"stream-{i:03d}-cluster-name-{j:05d}" for j in range(20_000)] + ["llm"]
            async with grpc.aio.insecure_channel(s.target) as ch:
                call = raw_call(ch, variant)
                if variant == "sotw":
                    req = discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=names)
                else:
                    req = discovery_pb2.DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=names)
                req.node.id = f"big-{i}"
                await call.write(req.SerializeToString())
                await asyncio.wait_for(call.read(), 10)  # answered: llm (+ removed names in delta)
                s.cache.set_resource(EDS, "llm", cla(weight=1000 + i))  # a change while it is open
                await asyncio.wait_for(call.read(), 10)
                call.cancel()

        for i in range(5):  # warm-up: grpc pools, code paths
            await one(i)
        await wait_for(lambda: not s.servicer.streams, timeout_s=5.0, step_s=0.02)
        base = rss_bytes()
        for i in range(5, 45):
            await one(i)
        await wait_for(lambda: not s.servicer.streams, timeout_s=5.0, step_s=0.02)
        growth = rss_bytes() - base
        print(f"\n{variant}: 40 closed streams of 20k names: RSS growth {growth / 1e6:.1f} MB, "
              f"memo {s.cache.memo_bytes() / 1e6:.2f} MB")
        assert s.cache.memo_bytes() <= 4 * XdsConfig().limits.memo_max_bytes
        assert growth < 20 * 1024 * 1024  # goal: within 20 MB of the start
    finally:
        await stop_ads_server(s)


async def test_client_chosen_node_ids_never_become_metric_labels(control_plane):
    cp, admin = control_plane
    calls = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
        for i in range(30):
            call = raw_call(ch, "sotw")
            req = discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=["llm"])
            req.node.id = f"{i:02d}" + "n" * 65_536
            await call.write(req.SerializeToString())
            r = discovery_pb2.DiscoveryResponse.FromString(await asyncio.wait_for(call.read(), 5))
            nack = discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=["llm"], response_nonce=r.nonce,
                                                  version_info="v" * 100_000)
            nack.error_detail.message = "m" * 100_000
            await call.write(nack.SerializeToString())
            calls.append(call)
        await wait_for(lambda: cp.ads.stats.nacks[("sotw", "ClusterLoadAssignment")] == 30, timeout_s=5.0, step_s=0.02)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{admin}/metrics") as resp:
                metrics_text = await resp.text()
            async with http.get(f"{admin}/xds/clients") as resp:
                clients_text = await resp.text()
        assert "nnnnnnnn" not in metrics_text
        assert len(metrics_text) < 200_000
        assert 'sentinel_xds_nacks_total{type="ClusterLoadAssignment",variant="sotw"} 30.0' in metrics_text
        # /xds/clients shows them while connected, clipped (unclipped, 300 ids of 64 KB made 19.7 MB)
        assert len(clients_text) < 30 * 4_000
        for c in calls:
            c.cancel()
    await wait_for(lambda: not cp.ads.streams, timeout_s=5.0, step_s=0.02)
    assert cp.ads.clients_view()["nacks_by_node"] == []


async def test_node_ids_and_nonces_are_escaped_in_every_log_line(hostile_env, caplog):
    s, _clean, channel, _state = hostile_env
    call = raw_call(channel, "sotw")
    forged = "envoy\nINFO xds_server.server: node gpu-a: HEALTHY -> UNHEALTHY (forged)"
    req = discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=["llm"])
    req.node.id = forged
    with caplog.at_level(logging.INFO, logger="xds_server.xds.ads"):
        await call.write(req.SerializeToString())
        r = discovery_pb2.DiscoveryResponse.FromString(await asyncio.wait_for(call.read(), 5))
        nack = discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=["llm"], response_nonce=r.nonce)
        nack.error_detail.message = "bad\nINFO forged line"
        await call.write(nack.SerializeToString())
        await wait_for(lambda: s.servicer.stats.nacks[("sotw", "ClusterLoadAssignment")] == 1,
                       timeout_s=5.0, step_s=0.02)
        bad = raw_call(channel, "delta")
        breq = discovery_pb2.DeltaDiscoveryRequest(type_url="")
        breq.node.id = forged
        await bad.write(breq.SerializeToString())
        assert await drain_call(bad, 3.0) == grpc.StatusCode.INVALID_ARGUMENT
    call.cancel()
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "xds_server.xds.ads"]
    assert any("NACK from" in line for line in lines) and any("INVALID_ARGUMENT" in line for line in lines)
    for line in lines:
        assert "\n" not in line and "\x1b" not in line, line


def test_delta_nack_is_counted_only_after_its_nonce_is_checked():
    stream = DeltaStream(StreamIdentity(1, "t.1.", 0.0))
    v = stream.on_request(discovery_pb2.DeltaDiscoveryRequest(
        type_url=EDS, response_nonce="never-sent", error_detail=status_pb2.Status(code=13, message="x")))
    assert v.kind is Verdict.STALE and stream.types[EDS].nacks == 0 and stream.types[EDS].nack_nonce == ""


async def test_one_flooding_stream_is_held_to_its_request_budget_and_others_are_served(hostile_env):
    s, clean, channel, state = hostile_env
    cfg = s.servicer.config
    call = raw_call(channel, "sotw")
    names = [f"flood-cluster-with-a-long-name-{j:06d}" for j in range(40_000)]
    size = discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=names).ByteSize()
    assert size > 1_500_000  # requests of about 1.7 MB each

    async def flood() -> None:
        for k in range(400):
            await call.write(
                discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=names[k % 2:]).SerializeToString())

    flooder = asyncio.create_task(flood())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        for _ in range(10):  # every update reaches the clean client while the flood goes on
            await clean_client_gets_the_next_update(s, clean, state)
            await asyncio.sleep(0.05)
        elapsed = loop.time() - t0
        processed = sum(v for (variant, _, _), v in s.servicer.stats.requests.items() if variant == "sotw")
        allowed = (cfg.limits.request_burst_bytes + cfg.limits.request_bytes_per_s * elapsed) / size + 1
        print(f"\nflood: {processed} requests of {size / 1e6:.1f} MB processed in {elapsed:.1f} s "
              f"(budget allows {allowed:.1f}); throttled {s.servicer.stats.throttled_s:.1f} s")
        assert processed <= allowed
        assert s.servicer.stats.throttled_s > 0
    finally:
        flooder.cancel()
        call.cancel()


async def test_requests_over_the_max_receive_size_are_refused(hostile_env):
    s, clean, channel, state = hostile_env
    call = raw_call(channel, "delta")
    req = discovery_pb2.DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=["n" * 1024] * 17_000)
    assert req.ByteSize() > XdsConfig().limits.max_receive_message_bytes
    await call.write(req.SerializeToString())
    assert await drain_call(call, 5.0) == grpc.StatusCode.RESOURCE_EXHAUSTED
    await clean_client_gets_the_next_update(s, clean, state)


async def test_too_many_names_or_types_on_one_stream_is_invalid_argument(hostile_env):
    s, clean, channel, state = hostile_env
    limit = XdsConfig().limits.max_names_per_stream
    call = raw_call(channel, "delta")
    for part in range(3):
        names = [f"p{part}-{j:06d}" for j in range(limit // 2)]
        try:
            await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=names)
                             .SerializeToString())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            break
    assert await drain_call(call, 10.0) == grpc.StatusCode.INVALID_ARGUMENT
    call = raw_call(channel, "sotw")
    for i in range(XdsConfig().limits.max_types_per_stream + 1):
        await call.write(discovery_pb2.DiscoveryRequest(type_url=f"type.example/t{i}").SerializeToString())
    assert await drain_call(call, 5.0) == grpc.StatusCode.INVALID_ARGUMENT
    assert s.servicer.stats.rejected[("delta", "invalid")] == 1
    assert s.servicer.stats.rejected[("sotw", "invalid")] == 1
    await clean_client_gets_the_next_update(s, clean, state)
