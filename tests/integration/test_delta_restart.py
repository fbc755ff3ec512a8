"""Delta ADS across control-plane restarts, with the real Envoy under load: Envoy
reconnects with ``initial_resource_versions``; with identical state nothing is resent and the
cluster stays warm; with a changed cluster the new CDS re-warms it and the assignment, although
its version matches what Envoy holds, is sent again so the cluster leaves warming at once. No
request fails, no cluster waits out initial_fetch_timeout."""
from __future__ import annotations

import asyncio

import pytest
import yaml

from xds_server.testing import LoadGenerator, restart_control_plane, wait_for

pytestmark = pytest.mark.envoy

# The restarted process resumes the nodes' states from state.path (README's config), and weights
# carry no RTT term, so a same-state restart publishes exactly what Envoy holds from its first
# build on: Envoy redials within ~0.1 s of the port opening (the bootstrap's xDS backoff) and,
# without these, would see the new process's WARMING -> PROBATION ramp or RTT-weight moves.
FAST = {"probation": {"clean": "1s", "ramp_step_percent": 50, "ramp_step": "200ms"}, "score": {"rtt_weight": 0.0}}


async def envoy_view(fleet, http) -> dict:
    """Envoy's own account: warming/active cluster gauges, init-fetch timeouts, llm's state."""
    base = f"http://127.0.0.1:{fleet.envoy_admin_port}"
    async with http.get(f"{base}/stats", params={"filter": r"^(cluster_manager\.(warming|active)_clusters|"
                                                         r"cluster\.llm\.init_fetch_timeout)$"}) as r:
        stats = dict(line.split(": ", 1) for line in (await r.text()).splitlines() if ": " in line)
    async with http.get(f"{base}/config_dump", params={"resource": "dynamic_warming_clusters"}) as r:
        warming = [c["cluster"]["name"] for c in (await r.json()).get("configs", [])]
    async with http.get(f"{base}/config_dump", params={"resource": "dynamic_active_clusters"}) as r:
        active = {c["cluster"]["name"]: c["cluster"] for c in (await r.json()).get("configs", [])}
    return {"warming_gauge": int(stats.get("cluster_manager.warming_clusters", -1)),
            "init_fetch_timeouts": int(stats.get("cluster.llm.init_fetch_timeout", 0)),
            "warming": warming, "active": active}


async def served_version(fleet, http) -> str:
    """The assignment version the control plane serves now (``/clusters``)."""
    async with http.get(f"http://127.0.0.1:{fleet.admin_port}/clusters") as r:
        return (await r.json())["clusters"][0]["xds_version"]


async def envoy_stream(fleet, http) -> dict | None:
    async with http.get(f"http://127.0.0.1:{fleet.admin_port}/xds/clients") as r:
        clients = (await r.json())["clients"]
    mine = [c for c in clients if c["node_id"] == "envoy-llm-gw-1" and len(c["types"]) == 2]
    return mine[0] if mine else None


async def test_delta_restart_01_identical_state_then_changed_cluster_0_failed_0_stuck_warming(make_fleet, http,
                                                                                              tmp_path):
    fleet = make_fleet(n_nodes=2, api_type="DELTA_GRPC", health=FAST, config_options={
        "state": {"path": str(tmp_path / "state.json"), "write_interval_s": 0.5}})
    await fleet.wait_all_routed(http)
    load = LoadGenerator(fleet.url, concurrency=4)
    await load.start()
    try:
        load.phase("before")
        await asyncio.sleep(1.0)

        # 1. identical state: Envoy offers what it holds; the new process sends nothing back.
        #    What Envoy holds is read just before the restart (ramp steps and fresh RTT samples
        #    move the assignment's version while the fleet runs).
        held = (await envoy_stream(fleet, http))["types"]["ClusterLoadAssignment"]["resource_versions"]
        load.phase("restart, same state")
        await restart_control_plane(fleet, down_s=1.0)

        async def resynced():
            s = await envoy_stream(fleet, http)
            return s if s and all(t["subscribed_count"] >= 1 for t in s["types"].values()) else None

        await wait_for(resynced, timeout_s=15.0)
        await asyncio.sleep(0.5)

        async def in_sync():  # the stream's view and the version served, read without a publish between
            v0 = await served_version(fleet, http)
            st = await envoy_stream(fleet, http)
            return (st, v0) if st and v0 == await served_version(fleet, http) else None
        s, served = await wait_for(in_sync, timeout_s=5.0)
        same = await envoy_view(fleet, http)
        load.phase("after same-state restart")
        await asyncio.sleep(1.0)

        # 2. a changed cluster (connect timeout): CDS is resent, Envoy warms the cluster, and the
        #    assignment (same version as held) must follow or the cluster stays warming.
        cfg = yaml.safe_load((fleet.workdir / "xds.yaml").read_text())
        cfg["clusters"][0]["connect_timeout_ms"] = 2500
        (fleet.workdir / "xds.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        load.phase("restart, changed cluster")
        await restart_control_plane(fleet, down_s=1.0)

        async def rewarmed():
            v = await envoy_view(fleet, http)
            c = v["active"].get("llm")
            return v if c and c.get("connect_timeout") == "2.500s" and not v["warming"] else None

        async def why() -> str:
            v = await envoy_view(fleet, http)
            return (f"llm not active with the new setting and warm: warming {v['warming']}, gauge "
                    f"{v['warming_gauge']}, init_fetch_timeouts {v['init_fetch_timeouts']}, connect_timeout "
                    f"{v['active'].get('llm', {}).get('connect_timeout')}; stream {await envoy_stream(fleet, http)}")

        try:
            changed = await wait_for(rewarmed, timeout_s=10.0, step_s=0.05)
        except AssertionError:
            raise AssertionError(await why()) from None

        load.phase("after changed restart")
        await asyncio.sleep(1.0)
        hosts = await fleet.envoy_hosts(http)
    finally:
        await load.stop()
    total = load.totals()
    print(f"\ndelta restarts: ok {total.ok}, failed {dict(total.failures)}; "
          + "; ".join(f"{k}: {v.ok}" for k, v in load.phases.items()))
    assert total.failed == 0, dict(total.failures)
    assert all(p.ok > 10 for k, p in load.phases.items() if k != "start"), {k: p.ok for k, p in load.phases.items()}
    # identical state: Envoy reconnected with initial_resource_versions, so the new process sent
    # no CDS response, and no EDS response when it serves the version Envoy held; either way
    # Envoy ends holding exactly the version /clusters names. (The assignment can move around a
    # restart, e.g. weights from fresh RTT samples; then it alone is sent, and ACKed.)
    assert s["variant"] == "delta"
    assert s["types"]["Cluster"]["responses"] == 0
    eds = s["types"]["ClusterLoadAssignment"]
    assert eds["resource_versions"] == {"llm": served}, (eds, served, held)
    if held == {"llm": served}:
        assert eds["responses"] == 0, (eds, held)
    else:
        assert eds["responses"] == 0 or eds["resources_acked"], (eds, held)
    assert same["warming"] == [] and same["warming_gauge"] == 0 and "llm" in same["active"]
    # changed cluster: active again with the new setting, never waited out initial_fetch_timeout
    assert changed["warming_gauge"] == 0 and changed["init_fetch_timeouts"] == 0
    assert sorted(hosts.values()) == ["HEALTHY", "HEALTHY"]
