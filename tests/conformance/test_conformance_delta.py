"""Delta (incremental) ADS conformance (docs/xds_protocol.md 1.9, items 19-26, and the delta
side of 3, 4, 9, 16), one behaviour per test, driven by a scripted gRPC client."""
from __future__ import annotations

import re

import grpc
import pytest
from conformance_support import CDS, EDS, cla, delta_names, empty_cla
from envoy.config.endpoint.v3 import endpoint_pb2

QUIET_S = 0.25


async def delta_handshake(ads, names=("llm",), node_id="envoy-1"):
    """Envoy's delta order (1.5): CDS legacy wildcard, EDS subscribe before the CDS ACK, ACK EDS."""
    c = await ads.delta()
    await c.send(type_url=CDS, node_id=node_id)
    cds = await c.recv()
    await c.send(type_url=EDS, subscribe=list(names))
    await c.send(type_url=CDS, nonce=cds.nonce)
    eds = await c.recv()
    await c.send(type_url=EDS, nonce=eds.nonce)
    await c.expect_silence(0.05)
    return c, cds, eds


def cla_in(resp, name="llm") -> endpoint_pb2.ClusterLoadAssignment:
    r = next(r for r in resp.resources if r.name == name)
    m = endpoint_pb2.ClusterLoadAssignment()
    r.resource.Unpack(m)
    return m


async def test_delta_01_legacy_wildcard_cds_gets_every_cluster_with_name_and_version(ads):
    c = await ads.delta()
    await c.send(type_url=CDS, node_id="envoy-1")
    r = await c.recv()
    assert r.type_url == CDS and r.nonce and re.fullmatch(r"[0-9a-f]{16}", r.system_version_info)
    assert sorted(delta_names(r)) == ["llm", "llm2"]
    for res in r.resources:
        assert re.fullmatch(r"[0-9a-f]{16}", res.version) and res.resource.type_url == CDS
    assert ads.only_stream().types[CDS].wildcard


async def test_delta_02_every_response_has_a_unique_nonce_and_spontaneous_requests_are_handled(ads):
    c, cds, eds = await delta_handshake(ads)
    await c.send(type_url=EDS, subscribe=["llm2"])  # spontaneous: empty nonce
    ads.cache.set_resource(EDS, "llm2", cla("llm2"))
    r1 = await c.recv()
    ads.cache.set_resource(EDS, "llm", cla(weight=3))
    r2 = await c.recv()
    nonces = [cds.nonce, eds.nonce, r1.nonce, r2.nonce]
    assert all(nonces) and len(set(nonces)) == 4
    assert delta_names(r1) == ["llm2"] and delta_names(r2) == ["llm"]


async def test_delta_03_subscription_change_with_a_stale_nonce_is_applied(ads):
    c, _cds, eds = await delta_handshake(ads)
    ads.cache.set_resource(EDS, "llm", cla(weight=3))
    newer = await c.recv()
    ads.cache.set_resource(EDS, "llm2", cla("llm2"))
    await c.send(type_url=EDS, subscribe=["llm2"], nonce=eds.nonce)  # eds.nonce is superseded
    r = await c.recv()
    assert delta_names(r) == ["llm2"]
    assert ads.servicer.stats.requests[("delta", "ClusterLoadAssignment", "stale")] == 1
    assert newer.nonce != eds.nonce


async def test_delta_04_every_subscribed_name_is_answered_even_if_the_client_has_it(ads):
    c, _cds, eds = await delta_handshake(ads)
    await c.send(type_url=EDS, subscribe=["llm"])  # already held at this version
    r = await c.recv()
    assert delta_names(r) == ["llm"] and r.resources[0].version == eds.resources[0].version


async def test_delta_05_nonexistent_name_is_listed_removed_and_sent_once_it_exists(ads):
    c, _cds, _eds = await delta_handshake(ads)
    await c.send(type_url=EDS, subscribe=["no-such-cluster"])
    r = await c.recv()
    assert list(r.removed_resources) == ["no-such-cluster"] and not r.resources
    await c.expect_silence(QUIET_S)  # said once, not repeated
    ads.cache.set_resource(EDS, "no-such-cluster", empty_cla("no-such-cluster"))
    r = await c.recv()
    assert delta_names(r) == ["no-such-cluster"]  # the subscription was kept (go-control-plane #488)


async def test_delta_06_assignment_of_a_known_cluster_is_held_until_published_not_removed(ads):
    ads.cache.remove_resource(EDS, "llm2")
    c, _cds, _eds = await delta_handshake(ads)
    await c.send(type_url=EDS, subscribe=["llm2"])  # cluster exists in CDS, assignment not yet
    await c.expect_silence(QUIET_S)
    ads.cache.set_resource(EDS, "llm2", cla("llm2"))
    r = await c.recv()
    assert delta_names(r) == ["llm2"] and not r.removed_resources


async def test_delta_07_reconnect_with_initial_versions_matching_not_resent_changed_resent_gone_removed(ads):
    c, cds, eds = await delta_handshake(ads, names=("llm",))
    held_cds = {r.name: r.version for r in cds.resources}
    held_eds = {r.name: r.version for r in eds.resources}
    await c.close()
    # while disconnected: llm's assignment changes and cluster llm2 is deleted
    ads.cache.set_resource(EDS, "llm", cla(weight=77))
    ads.publish_clusters("llm")
    c2 = await ads.delta()
    await c2.send(type_url=CDS, initial_versions=held_cds, node_id="envoy-1")
    r = await c2.recv()
    assert not r.resources and list(r.removed_resources) == ["llm2"]  # llm unchanged: not resent
    await c2.send(type_url=EDS, subscribe=["llm"], initial_versions=held_eds)
    r = await c2.recv()
    assert delta_names(r) == ["llm"] and r.resources[0].version != held_eds["llm"]
    await c2.send(type_url=EDS, nonce=r.nonce)
    await c2.expect_silence(QUIET_S)


async def test_delta_08_reconnect_with_all_versions_current_gets_nothing_resent(ads):
    c, cds, eds = await delta_handshake(ads)
    await c.close()
    c2 = await ads.delta()
    await c2.send(type_url=CDS, initial_versions={r.name: r.version for r in cds.resources}, node_id="e")
    await c2.send(type_url=EDS, subscribe=["llm"], initial_versions={r.name: r.version for r in eds.resources})
    await c2.expect_silence(QUIET_S)


async def test_delta_09_cluster_deletion_is_sent_as_removed_resources(ads):
    c, _cds, _eds = await delta_handshake(ads)
    ads.publish_clusters("llm")
    r = await c.recv()
    assert r.type_url == CDS and list(r.removed_resources) == ["llm2"] and not r.resources


async def test_delta_10_wildcard_plus_name_then_unsubscribing_the_name_is_answered(ads):
    c = await ads.delta()
    await c.send(type_url=CDS, subscribe=["*", "llm"], node_id="e")
    r = await c.recv()
    assert sorted(delta_names(r)) == ["llm", "llm2"]
    await c.send(type_url=CDS, nonce=r.nonce)
    await c.send(type_url=CDS, unsubscribe=["llm"])
    r = await c.recv()  # still in the wildcard: resent so the client knows it still exists
    assert delta_names(r) == ["llm"] and not r.removed_resources


async def test_delta_11_unsubscribe_only_request_gets_no_response_and_name_is_untracked(ads):
    c, _cds, _eds = await delta_handshake(ads)
    await c.send(type_url=EDS, unsubscribe=["llm"])
    await c.expect_silence(QUIET_S)
    ts = ads.only_stream().types[EDS]
    assert "llm" not in ts.subscribed and "llm" not in ts.sent
    ads.cache.set_resource(EDS, "llm", cla(weight=9))
    await c.expect_silence(QUIET_S)  # no longer pushed
    await c.send(type_url=EDS, subscribe=["llm"])
    assert delta_names(await c.recv()) == ["llm"]


async def test_delta_12_draining_every_endpoint_is_an_empty_assignment_not_removed_resources(ads):
    c, _cds, _eds = await delta_handshake(ads)
    ads.cache.set_resource(EDS, "llm", empty_cla("llm"))
    r = await c.recv()
    assert delta_names(r) == ["llm"] and not r.removed_resources
    assert len(cla_in(r).endpoints) == 0


async def test_delta_13_ack_gets_no_response_and_a_nack_is_not_resent_until_content_changes(ads):
    c, _cds, _eds = await delta_handshake(ads)
    await c.expect_silence(QUIET_S)  # ACKs above got nothing
    ads.cache.set_resource(EDS, "llm", cla(weight=5))
    bad = await c.recv()
    await c.send(type_url=EDS, nonce=bad.nonce, error="LoadBalancingWeight: value must be >= 1")
    await c.expect_silence(QUIET_S)
    ts = ads.only_stream().types[EDS]
    assert (ts.nacks, ts.nack_nonce) == (1, bad.nonce) and "LoadBalancingWeight" in ts.nack_message
    assert ts.nack_version == bad.system_version_info
    ads.cache.set_resource(EDS, "llm", cla(weight=6))
    r = await c.recv()
    assert r.resources[0].version != bad.resources[0].version
    view = ads.only_stream().describe()["types"]["ClusterLoadAssignment"]
    assert view["last_nack"]["nonce"] == bad.nonce and view["nacks"] == 1


async def test_delta_14_cds_change_repushes_the_unchanged_assignment(ads):
    c, _cds, eds = await delta_handshake(ads)
    ads.publish_clusters("llm", "llm2", connect_timeout="2500ms")
    r1 = await c.recv()
    r2 = await c.recv()
    assert r1.type_url == CDS and sorted(delta_names(r1)) == ["llm", "llm2"]
    assert r2.type_url == EDS and delta_names(r2) == ["llm"]
    assert r2.resources[0].version == eds.resources[0].version and r2.nonce != eds.nonce


async def test_delta_15_cds_change_before_eds_subscribe_is_still_repushed_on_subscribe(ads):
    # reconnect: CDS changed while away, and the EDS subscription arrives after the CDS push
    c, cds, eds = await delta_handshake(ads)
    await c.close()
    ads.publish_clusters("llm", "llm2", connect_timeout="3000ms")
    c2 = await ads.delta()
    await c2.send(type_url=CDS, initial_versions={r.name: r.version for r in cds.resources}, node_id="e")
    r = await c2.recv()
    assert sorted(delta_names(r)) == ["llm", "llm2"]
    await c2.send(type_url=EDS, subscribe=["llm"], initial_versions={r.name: r.version for r in eds.resources})
    r = await c2.recv()  # same version as held, but the cluster is warming: pushed
    assert delta_names(r) == ["llm"] and r.resources[0].version == eds.resources[0].version


async def test_delta_16_only_changed_resources_are_sent_on_update(ads):
    ads.cache.set_resource(EDS, "llm2", cla("llm2"))
    c, _cds, eds = await delta_handshake(ads, names=("llm", "llm2"))
    assert sorted(delta_names(eds)) == ["llm", "llm2"]
    ads.cache.set_resource(EDS, "llm2", cla("llm2", weight=3))
    r = await c.recv()
    assert delta_names(r) == ["llm2"]


async def test_delta_17_unknown_type_gets_an_empty_answer_and_removed_for_named_resources(ads):
    c = await ads.delta()
    lds = "type.googleapis.com/envoy.config.listener.v3.Listener"
    await c.send(type_url=lds, node_id="e")
    r = await c.recv()
    assert r.type_url == lds and not r.resources and not r.removed_resources and r.nonce
    await c.send(type_url=lds, nonce=r.nonce)
    await c.send(type_url=lds, subscribe=["listener-a"])
    r = await c.recv()
    assert list(r.removed_resources) == ["listener-a"]
    await c.send(type_url=CDS)
    assert (await c.recv()).type_url == CDS  # the stream stays up


async def test_delta_18_missing_type_url_is_invalid_argument(ads):
    c = await ads.delta()
    await c.send(type_url="", node_id="x")
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await c.recv()
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_delta_19_unsubscribing_wildcard_stops_pushes_of_unnamed_resources(ads):
    c = await ads.delta()
    await c.send(type_url=CDS, subscribe=["*"], node_id="e")
    r = await c.recv()
    await c.send(type_url=CDS, nonce=r.nonce, unsubscribe=["*"])
    await c.expect_silence(QUIET_S)
    ads.publish_clusters("llm", "llm2", connect_timeout="1500ms")
    await c.expect_silence(QUIET_S)
    assert ads.only_stream().subscription_count() == 0
