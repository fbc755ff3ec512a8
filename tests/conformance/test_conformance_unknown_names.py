"""Every requested EDS name is answered: in SotW a name that exists nowhere gets an
empty ClusterLoadAssignment (SotW has no "does not exist" answer, xds_protocol.md 1.4, so
Envoy would otherwise wait out initial_fetch_timeout); in delta it is listed in
``removed_resources`` (xds_protocol.md 1.5, checklist 21). A cluster configured with no nodes
(a pool scaled to zero) is published and served as an assignment with no endpoints."""
from __future__ import annotations

import asyncio

import aiohttp
from conformance_support import CDS, EDS, cla, clas_of, clusters_of, control_plane_config, delta_names

from xds_server.config import parse_config
from xds_server.server import ControlPlane
from xds_server.testing import ScriptedAdsClient, ScriptedDeltaAdsClient

QUIET_S = 0.25


async def sotw_eds(ads, names):
    c = await ads.sotw()
    await c.send(type_url=CDS, node_id="envoy-1")
    cds = await c.recv()
    await c.send(type_url=EDS, names=list(names))
    await c.send(type_url=CDS, version=cds.version_info, nonce=cds.nonce)
    return c, await c.recv()


async def test_unknown_01_sotw_1_known_plus_2_unknown_names_get_3_assignments_2_empty(ads):
    c, eds = await sotw_eds(ads, ("llm", "ghost-a", "ghost-b"))
    got = {m.cluster_name: m for m in clas_of(eds)}
    assert sorted(got) == ["ghost-a", "ghost-b", "llm"]
    assert len(got["llm"].endpoints[0].lb_endpoints) == 2
    assert not got["ghost-a"].endpoints and not got["ghost-b"].endpoints
    await c.send(type_url=EDS, names=["llm", "ghost-a", "ghost-b"], version=eds.version_info, nonce=eds.nonce)
    await c.expect_silence(QUIET_S)  # ACKed: the empty assignments are not sent again


async def test_unknown_02_sotw_unknown_name_added_later_is_answered_then_its_real_assignment_1_push(ads):
    c, eds = await sotw_eds(ads, ("llm",))
    await c.send(type_url=EDS, names=["llm", "ghost"], version=eds.version_info, nonce=eds.nonce)
    r = await c.recv()
    assert [(m.cluster_name, len(m.endpoints)) for m in clas_of(r)] == [("ghost", 0)]
    await c.send(type_url=EDS, names=["llm", "ghost"], version=r.version_info, nonce=r.nonce)
    await c.expect_silence(QUIET_S)
    real = cla("llm2")
    real.cluster_name = "ghost"
    ads.cache.set_resource(EDS, "ghost", real)
    r2 = await c.recv()
    assert [(m.cluster_name, len(m.endpoints)) for m in clas_of(r2)] == [("ghost", 1)]


async def test_unknown_03_sotw_name_of_a_known_cluster_without_assignment_is_held_0_answers(ads):
    ads.cache.remove_resource(EDS, "llm2")  # llm2 is in CDS: its assignment is pending, not absent
    c, eds = await sotw_eds(ads, ("llm", "llm2"))
    assert [m.cluster_name for m in clas_of(eds)] == ["llm"]
    await c.send(type_url=EDS, names=["llm", "llm2"], version=eds.version_info, nonce=eds.nonce)
    await c.expect_silence(QUIET_S)


async def test_unknown_04_delta_2_unknown_names_are_listed_removed_once_known_one_sent(ads):
    c = await ads.delta()
    await c.send(type_url=CDS, node_id="envoy-1")
    cds = await c.recv()
    await c.send(type_url=EDS, subscribe=["llm", "ghost-a", "ghost-b"])
    await c.send(type_url=CDS, nonce=cds.nonce)
    r = await c.recv()
    assert delta_names(r) == ["llm"]
    assert sorted(r.removed_resources) == ["ghost-a", "ghost-b"]
    await c.send(type_url=EDS, nonce=r.nonce)
    await c.expect_silence(QUIET_S)


def _empty_pool_config() -> dict:
    cfg = control_plane_config()
    cfg["clusters"].append({"name": "pool0", "nodes": []})
    return cfg


async def test_unknown_05_cluster_with_0_nodes_is_valid_published_and_served_empty_sotw_and_delta():
    cp = ControlPlane(parse_config(_empty_pool_config()))
    await cp.start()
    clients = []
    try:
        for _ in range(300):
            if cp.cla_version("pool0"):
                break
            await asyncio.sleep(0.01)
        assert cp.cla_version("pool0")
        target = f"127.0.0.1:{cp.xds_port}"
        s = ScriptedAdsClient(target)
        await s.open()
        clients.append(s)
        await s.send(type_url=CDS, node_id="envoy-sotw")
        cds = await s.recv()
        assert sorted(clusters_of(cds)) == ["llm", "llm2", "pool0"]
        await s.send(type_url=EDS, names=["pool0"])
        eds = await s.recv()
        [m] = clas_of(eds)
        assert m.cluster_name == "pool0" and not m.endpoints
        d = ScriptedDeltaAdsClient(target)
        await d.open()
        clients.append(d)
        await d.send(type_url=CDS, node_id="envoy-delta")
        dc = await d.recv()
        assert "pool0" in delta_names(dc)
        await d.send(type_url=EDS, subscribe=["pool0"])
        de = await d.recv()
        assert delta_names(de) == ["pool0"] and not de.removed_resources
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{cp.admin_port}/clusters") as resp:
                body = await resp.json()
        pool = next(c for c in body["clusters"] if c["name"] == "pool0")
        assert pool["nodes"] == 0 and pool["routable"] == 0 and pool["healthy_fraction"] == 0.0
    finally:
        for c in clients:
            await c.close()
        await cp.stop()
