"""State-of-the-world ADS conformance (docs/xds_protocol.md 1.9, items 1-18), one behaviour per
test, driven by a scripted gRPC client against the real servicer."""
from __future__ import annotations

import re

import grpc
import pytest
from conformance_support import CDS, EDS, cla, clas_of, clusters_of, start_ads_server, stop_ads_server
from envoy.config.endpoint.v3 import endpoint_pb2

from xds_server.xds.cache import InvalidResource

QUIET_S = 0.25


async def handshake(ads, names=("llm",), node_id="envoy-1"):
    """Envoy's order (1.7): CDS, EDS subscribe before the CDS ACK, then ACK EDS."""
    c = await ads.sotw()
    await c.send(type_url=CDS, node_id=node_id)
    cds = await c.recv()
    await c.send(type_url=EDS, names=list(names))
    await c.send(type_url=CDS, version=cds.version_info, nonce=cds.nonce)
    eds = await c.recv()
    await c.send(type_url=EDS, names=list(names), version=eds.version_info, nonce=eds.nonce)
    return c, cds, eds


async def test_sotw_01_first_cds_request_gets_version_fresh_nonce_type_url_and_matching_any(ads):
    c = await ads.sotw()
    await c.send(type_url=CDS, node_id="envoy-1")
    r = await c.recv()
    assert r.version_info and r.nonce and r.type_url == CDS
    assert sorted(clusters_of(r)) == ["llm", "llm2"]
    assert all(a.type_url == r.type_url for a in r.resources)


async def test_sotw_02_nonces_unique_per_stream_and_never_reused_after_reconnect(ads):
    c, cds, eds = await handshake(ads)
    ads.cache.set_resource(EDS, "llm", cla(weight=7))
    r = await c.recv()
    first = {cds.nonce, eds.nonce, r.nonce}
    assert len(first) == 3
    await c.close()
    _c2, cds2, eds2 = await handshake(ads)
    assert not {cds2.nonce, eds2.nonce} & first


async def test_sotw_03_ack_with_unchanged_state_gets_no_response(ads):
    c, cds, eds = await handshake(ads)
    await c.expect_silence(QUIET_S)
    st = ads.only_stream()
    assert st.types[EDS].acked_version == eds.version_info and st.types[CDS].acked_version == cds.version_info


async def test_sotw_04_nack_is_recorded_and_the_same_version_is_never_resent(ads):
    c, _cds, eds = await handshake(ads)
    ads.cache.set_resource(EDS, "llm", cla(weight=5))
    bad = await c.recv()
    await c.send(type_url=EDS, names=["llm"], version=eds.version_info, nonce=bad.nonce, error="rejected")
    await c.expect_silence(QUIET_S)
    ts = ads.only_stream().types[EDS]
    assert (ts.nacks, ts.nack_nonce, ts.nack_message, ts.acked_version) == (1, bad.nonce, "rejected", eds.version_info)
    ads.cache.set_resource(EDS, "llm", cla(weight=5))  # same content again: still nothing
    await c.expect_silence(QUIET_S)
    ads.cache.set_resource(EDS, "llm", cla(weight=6))  # newer content: answered
    r = await c.recv()
    assert r.version_info not in (bad.version_info, eds.version_info)


async def test_sotw_05_nack_detected_by_error_detail_not_by_version_mismatch(ads):
    c, _cds, eds = await handshake(ads)
    ads.cache.set_resource(EDS, "llm", cla(weight=5))
    r = await c.recv()
    # version differs from what was sent, no error_detail: an ACK (e.g. after a subscription change)
    await c.send(type_url=EDS, names=["llm"], version=eds.version_info, nonce=r.nonce)
    await c.expect_silence(QUIET_S)
    assert ads.only_stream().types[EDS].nacks == 0
    ads.cache.set_resource(EDS, "llm", cla(weight=4))
    r2 = await c.recv()
    # version equal to what was sent, error_detail present: a NACK
    await c.send(type_url=EDS, names=["llm"], version=r2.version_info, nonce=r2.nonce, error="bad")
    await c.expect_silence(QUIET_S)
    assert ads.only_stream().types[EDS].nacks == 1


async def test_sotw_06_request_with_stale_nonce_gets_no_response(ads):
    c, _cds, eds = await handshake(ads)
    ads.cache.set_resource(EDS, "llm", cla(weight=7))
    await c.recv()
    await c.send(type_url=EDS, names=["llm", "llm2"], version=eds.version_info, nonce=eds.nonce)
    ads.cache.set_resource(EDS, "llm2", cla("llm2"))
    await c.expect_silence(QUIET_S)  # the stale request's new name was not taken


async def test_sotw_07_new_eds_name_at_same_version_gets_that_assignment(ads):
    ads.cache.set_resource(EDS, "llm2", cla("llm2"))
    c, _cds, eds = await handshake(ads)
    await c.send(type_url=EDS, names=["llm", "llm2"], version=eds.version_info, nonce=eds.nonce)
    r = await c.recv()
    assert [m.cluster_name for m in clas_of(r)] == ["llm2"]


async def test_sotw_08_assignment_created_after_request_is_pushed_without_new_request(ads):
    c, _cds, eds = await handshake(ads, names=("llm", "llm2"))
    assert [m.cluster_name for m in clas_of(eds)] == ["llm"]  # llm2 held: not published yet
    await c.expect_silence(QUIET_S)
    ads.cache.set_resource(EDS, "llm2", cla("llm2"))
    r = await c.recv()
    assert [m.cluster_name for m in clas_of(r)] == ["llm2"]


async def test_sotw_09_cds_change_repushes_the_unchanged_assignment_with_a_new_nonce(ads):
    c, _cds, eds = await handshake(ads)
    ads.publish_clusters("llm", "llm2", connect_timeout="2500ms")
    r1 = await c.recv()
    r2 = await c.recv()
    assert r1.type_url == CDS and r2.type_url == EDS  # CDS first, then the assignment
    assert r2.version_info == eds.version_info and r2.nonce != eds.nonce
    await c.expect_silence(QUIET_S)


async def test_sotw_10_cds_is_full_state_and_a_left_out_cluster_is_deleted(ads):
    c, _cds, _eds = await handshake(ads)
    ads.cache.set_resource(EDS, "llm", cla(weight=3))
    await c.recv()  # EDS change: CDS not resent
    ads.publish_clusters("llm")
    r = await c.recv()
    assert r.type_url == CDS and clusters_of(r) == ["llm"]
    ads.publish_clusters("llm", "llm2")
    r = await c.recv()
    assert sorted(clusters_of(r)) == ["llm", "llm2"]  # every cluster, not just the new one


async def test_sotw_11_eds_holds_only_requested_names_no_duplicates_and_matching_cluster_name(ads):
    ads.cache.set_resource(EDS, "llm2", cla("llm2"))
    c, _cds, eds = await handshake(ads, names=("llm",))
    names = [m.cluster_name for m in clas_of(eds)]
    assert names == ["llm"]
    ads.cache.set_resource(EDS, "llm2", cla("llm2", weight=9))  # not requested: not sent
    await c.expect_silence(QUIET_S)
    with pytest.raises(InvalidResource):  # a CLA under another name is refused by the cache
        ads.cache.set_resource(EDS, "llm", cla("llm2"))


async def test_sotw_12_name_removed_stops_pushes_and_readded_is_resent_unchanged(ads):
    c, _cds, eds = await handshake(ads)
    await c.send(type_url=EDS, names=[], version=eds.version_info, nonce=eds.nonce)
    await c.expect_silence(QUIET_S)  # unsubscribe-only: no answer (and now applied)
    ads.cache.set_resource(EDS, "llm", cla(weight=11))
    await c.expect_silence(QUIET_S)
    ads.cache.set_resource(EDS, "llm", cla())  # back to what the client held
    await c.expect_silence(QUIET_S)
    await c.send(type_url=EDS, names=["llm"], version=eds.version_info, nonce=eds.nonce)
    r = await c.recv()
    assert [m.cluster_name for m in clas_of(r)] == ["llm"] and r.version_info == eds.version_info


async def test_sotw_13_versions_from_content_only_same_on_every_replica_and_across_restart(ads):
    c, cds, eds = await handshake(ads)
    assert re.fullmatch(r"[0-9a-f]{16}", cds.version_info) and re.fullmatch(r"[0-9a-f]{16}", eds.version_info)
    ads.cache.set_resource(EDS, "llm", cla(weight=42))
    r = await c.recv()
    assert r.version_info != eds.version_info
    # a restarted server or another replica with the same state produces the same versions (an
    # Envoy failing over sees no change); one holding other content does not share them
    same = await start_ads_server()
    other = await start_ads_server()
    other.cache.set_resource(EDS, "llm", cla(weight=7))
    try:
        for srv, expect_same in ((same, True), (other, False)):
            _c2, cds2, eds2 = await handshake(srv)
            assert cds2.version_info == cds.version_info
            assert (eds2.version_info == eds.version_info) is expect_same
    finally:
        await stop_ads_server(same)
        await stop_ads_server(other)


async def test_sotw_14_new_stream_gets_full_state_even_with_a_known_version_info(ads):
    _c, cds, eds = await handshake(ads)
    c2 = await ads.sotw()
    await c2.send(type_url=CDS, version=cds.version_info, node_id="envoy-1")
    r = await c2.recv()
    assert r.version_info == cds.version_info and sorted(clusters_of(r)) == ["llm", "llm2"]
    await c2.send(type_url=EDS, names=["llm"], version=eds.version_info)
    r = await c2.recv()
    assert r.version_info == eds.version_info and len(r.resources) == 1


async def test_sotw_15_node_from_first_message_later_messages_without_node_accepted(ads):
    c, _cds, _eds = await handshake(ads, node_id="envoy-first")
    st = ads.only_stream()
    assert st.node_id == "envoy-first"
    ads.cache.set_resource(EDS, "llm", cla(weight=8))
    r = await c.recv()  # later requests carried no node; the stream works
    await c.send(type_url=EDS, names=["llm"], version=r.version_info, nonce=r.nonce)
    await c.expect_silence(QUIET_S)
    assert st.types[EDS].acked_version == r.version_info and st.node_id == "envoy-first"


async def test_sotw_16_missing_type_url_is_invalid_argument_and_others_keep_working(ads):
    c = await ads.sotw()
    await c.send(type_url="", node_id="x")
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await c.recv()
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _c2, _cds, eds = await handshake(ads)
    assert eds.resources


async def test_sotw_17_invalid_assignment_is_held_back_and_never_sent(ads):
    c, _cds, _eds = await handshake(ads)
    zero = cla(weight=5)
    zero.endpoints[0].lb_endpoints[0].load_balancing_weight.value = 0
    two_drops = cla(weight=5)
    for cat in ("a", "b"):
        two_drops.policy.drop_overloads.add(category=cat).drop_percentage.numerator = 1
    gap = cla(weight=5)
    gap.endpoints[0].priority = 2
    overflow = cla(weight=5)
    for e in overflow.endpoints[0].lb_endpoints:
        e.load_balancing_weight.value = 2**31
    stale0 = cla(weight=5)
    stale0.policy.endpoint_stale_after.SetInParent()  # set, and 0
    for bad, why in ((zero, "weight 0 < 1"), (two_drops, "drop_overloads"), (gap, "contiguous"),
                     (overflow, "weight sum"), (stale0, "endpoint_stale_after")):
        with pytest.raises(InvalidResource, match=why):
            ads.cache.set_resource(EDS, "llm", bad)
    await c.expect_silence(QUIET_S)
    m = endpoint_pb2.ClusterLoadAssignment()
    ads.cache.resources(EDS)["llm"].any.Unpack(m)
    assert m == cla()  # the last good assignment is what stays published


async def test_sotw_18_only_requested_types_are_sent(ads):
    c = await ads.sotw()
    await c.send(type_url=CDS, node_id="cds-only")
    cds = await c.recv()
    await c.send(type_url=CDS, version=cds.version_info, nonce=cds.nonce)
    ads.cache.set_resource(EDS, "llm", cla(weight=3))
    await c.expect_silence(QUIET_S)


async def test_sotw_19_unknown_type_gets_one_empty_response_and_the_stream_stays_up(ads):
    c = await ads.sotw()
    lds = "type.googleapis.com/envoy.config.listener.v3.Listener"
    await c.send(type_url=lds, node_id="x")
    r = await c.recv()
    assert r.type_url == lds and len(r.resources) == 0 and r.nonce
    await c.send(type_url=lds, version=r.version_info, nonce=r.nonce)
    await c.expect_silence(QUIET_S)
    await c.send(type_url=CDS)
    assert (await c.recv()).type_url == CDS


async def test_sotw_20_cds_pushed_before_eds_of_a_new_cluster_on_one_stream(ads):
    ads.publish_clusters("llm")
    c, _cds, eds = await handshake(ads)
    ads.cache.set_resource(EDS, "llm2", cla("llm2"))
    ads.publish_clusters("llm", "llm2")
    r = await c.recv()
    assert r.type_url == CDS and sorted(clusters_of(r)) == ["llm", "llm2"]
    # the client learns llm2 from CDS and only then asks for its assignment
    await c.send(type_url=EDS, names=["llm", "llm2"], version=eds.version_info, nonce=eds.nonce)
    r = await c.recv()
    assert r.type_url == EDS and "llm2" in [m.cluster_name for m in clas_of(r)]
