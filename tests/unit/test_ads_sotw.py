"""SotW ADS over a real grpc.aio server and a scripted client: ACK/NACK per nonce, named EDS."""
from __future__ import annotations

import re

import grpc
import pytest
from envoy.config.endpoint.v3 import endpoint_pb2

from xds_server.config import parse_config
from xds_server.config.duration import Duration
from xds_server.health.model import Routing
from xds_server.testing import ScriptedAdsClient
from xds_server.xds.ads import AdsServicer
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.resources import CLA_TYPE_URL as EDS
from xds_server.xds.resources import CLUSTER_TYPE_URL as CDS
from xds_server.xds.resources import build_cla, build_cluster

CFG = parse_config({"clusters": [
    {"name": "llm", "nodes": [{"id": "a", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:1"}]},
    {"name": "llm2", "nodes": [{"id": "b", "address": "127.0.0.1:8002", "probe_address": "127.0.0.1:2"}]},
]})


@pytest.fixture
async def server():
    cache = SnapshotCache()
    cache.set_resources(CDS, {c.name: build_cluster(c) for c in CFG.clusters})
    cache.set_resource(EDS, "llm", build_cla(CFG.clusters[0], {"a": Routing(100, "HEALTHY")}))
    servicer = AdsServicer(cache)
    srv = grpc.aio.server()
    servicer.add_to_server(srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    clients = []

    async def client():
        c = ScriptedAdsClient(f"127.0.0.1:{port}")
        await c.open()
        clients.append(c)
        return c

    yield cache, servicer, client
    for c in clients:
        await c.close()
    await srv.stop(0)


def cla_of(resp):
    out = []
    for a in resp.resources:
        m = endpoint_pb2.ClusterLoadAssignment()
        a.Unpack(m)
        out.append(m)
    return out


async def handshake(client):
    c = await client()
    await c.send(type_url=CDS, node_id="envoy-1")
    cds = await c.recv()
    await c.send(type_url=EDS, names=["llm"])
    await c.send(type_url=CDS, version=cds.version_info, nonce=cds.nonce)
    eds = await c.recv()
    await c.send(type_url=EDS, names=["llm"], version=eds.version_info, nonce=eds.nonce)
    return c, cds, eds


async def test_first_cds_request_gets_full_state_with_version_and_nonce(server):
    _cache, _servicer, client = server
    c = await client()
    await c.send(type_url=CDS, node_id="envoy-1")
    r = await c.recv()
    assert r.type_url == CDS and re.fullmatch(r"[0-9a-f]{16}", r.version_info) and r.nonce
    assert [a.type_url for a in r.resources] == [CDS, CDS] and len(r.resources) == 2


async def test_ack_gets_no_response_and_eds_answers_only_requested(server):
    _cache, servicer, client = server
    c, cds, eds = await handshake(client)
    assert eds.type_url == EDS and [m.cluster_name for m in cla_of(eds)] == ["llm"]
    assert eds.nonce != cds.nonce
    await c.expect_silence(0.3)
    st = next(iter(servicer.streams.values()))
    assert st.node_id == "envoy-1"
    assert st.types[EDS].acked_version == eds.version_info


async def test_change_pushes_new_version_once(server):
    cache, _servicer, client = server
    c, cds, eds = await handshake(client)
    cache.set_resource(EDS, "llm", build_cla(CFG.clusters[0], {"a": Routing(100, "UNHEALTHY")}))
    r = await c.recv()
    assert r.version_info != eds.version_info and r.nonce not in (eds.nonce, cds.nonce)
    assert cla_of(r)[0].endpoints[0].lb_endpoints[0].health_status == 2  # UNHEALTHY
    # the same content again: no push
    cache.set_resource(EDS, "llm", build_cla(CFG.clusters[0], {"a": Routing(100, "UNHEALTHY")}))
    await c.expect_silence(0.3)


async def test_nack_counted_once_not_resent_then_one_response_after_change(server):
    """Field case fc02."""
    cache, servicer, client = server
    c, _cds, eds = await handshake(client)
    await c.send(type_url=EDS, names=["llm", "llm2"], version=eds.version_info, nonce=eds.nonce)
    # llm2 has no assignment yet: held, no response
    await c.expect_silence(0.2)
    cache.set_resource(EDS, "llm2", build_cla(CFG.clusters[1], {"b": Routing(100, "HEALTHY")}))
    r2 = await c.recv()
    assert [m.cluster_name for m in cla_of(r2)] == ["llm2"]
    await c.send(type_url=EDS, names=["llm", "llm2"], version=eds.version_info, nonce=r2.nonce,
                 error="weight must be >= 1")
    await c.expect_silence(0.5)
    st = next(iter(servicer.streams.values()))
    assert st.types[EDS].nacks == 1 and st.types[EDS].nack_message == "weight must be >= 1"
    assert st.describe()["types"]["ClusterLoadAssignment"]["last_nack"]["nonce"] == r2.nonce
    cache.set_resource(EDS, "llm2", build_cla(CFG.clusters[1], {"b": Routing(50, "HEALTHY")}))
    r3 = await c.recv()
    assert [m.cluster_name for m in cla_of(r3)] == ["llm2"]
    await c.expect_silence(0.3)


async def test_stale_nonce_is_ignored(server):
    cache, servicer, client = server
    c, _cds, eds = await handshake(client)
    cache.set_resource(EDS, "llm", build_cla(CFG.clusters[0], {"a": Routing(7, "HEALTHY")}))
    await c.recv()
    # a request carrying the older nonce and a new name: stale, not answered
    await c.send(type_url=EDS, names=["llm"], version=eds.version_info, nonce=eds.nonce, error="late")
    await c.expect_silence(0.3)
    st = next(iter(servicer.streams.values()))
    assert st.types[EDS].nacks == 0


async def test_resubscribe_resends_unchanged_resource(server):
    _cache, _servicer, client = server
    c, _cds, eds = await handshake(client)
    await c.send(type_url=EDS, names=[], version=eds.version_info, nonce=eds.nonce)
    await c.expect_silence(0.2)
    await c.send(type_url=EDS, names=["llm"], version=eds.version_info, nonce=eds.nonce)
    r = await c.recv()
    assert [m.cluster_name for m in cla_of(r)] == ["llm"]


async def test_cds_change_repushes_subscribed_cla_even_if_unchanged(server):
    cache, _servicer, client = server
    c, _cds, eds = await handshake(client)
    changed = CFG.clusters[0].model_copy(update={"connect_timeout": Duration.parse("2s")})
    cache.set_resources(CDS, {"llm": build_cluster(changed), "llm2": build_cluster(CFG.clusters[1])})
    r1 = await c.recv()
    r2 = await c.recv()
    assert r1.type_url == CDS and r2.type_url == EDS
    assert r2.version_info == eds.version_info and r2.nonce != eds.nonce  # same content, new nonce


async def test_reconnect_with_version_gets_full_state(server):
    _cache, _servicer, client = server
    _c, cds, eds = await handshake(client)
    c2 = await client()
    await c2.send(type_url=CDS, version=cds.version_info, node_id="envoy-1")
    r = await c2.recv()
    assert r.version_info == cds.version_info and len(r.resources) == 2
    await c2.send(type_url=EDS, names=["llm"], version=eds.version_info)
    r = await c2.recv()
    assert r.version_info == eds.version_info and len(r.resources) == 1


async def test_missing_type_url_is_invalid_argument(server):
    _cache, _servicer, client = server
    c = await client()
    await c.send(type_url="", node_id="x")
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await c.recv()
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_unknown_type_gets_empty_response(server):
    _cache, _servicer, client = server
    c = await client()
    lds = "type.googleapis.com/envoy.config.listener.v3.Listener"
    await c.send(type_url=lds, node_id="x")
    r = await c.recv()
    assert r.type_url == lds and len(r.resources) == 0 and r.nonce
    await c.send(type_url=lds, version=r.version_info, nonce=r.nonce)
    await c.expect_silence(0.2)


async def test_closed_streams_leave_no_state(server):
    _cache, servicer, client = server
    for _ in range(5):
        c, _, _ = await handshake(client)
        await c.close()
    import asyncio
    for _ in range(50):
        if not servicer.streams:
            break
        await asyncio.sleep(0.02)
    assert servicer.streams == {}


def test_describe_lists_a_bounded_number_of_subscribed_names_and_their_count():
    from envoy.service.discovery.v3 import discovery_pb2

    from xds_server.xds.protocol import StreamIdentity, StreamLimits
    from xds_server.xds.sotw import SotwStream

    s = SotwStream(StreamIdentity(1, "t.1.", 0.0), StreamLimits(view_max_names=3))
    s.on_request(discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=[f"n{i:03d}" for i in range(500)]))
    view = s.describe()["types"]["ClusterLoadAssignment"]
    assert view["subscribed"] == ["n000", "n001", "n002"] and view["subscribed_count"] == 500
