"""Hot reload of the config file (add, remove, change, invalid file; SIGHUP,
POST /reload and a change of the file), on a ControlPlane with in-memory probe sources, a real
admin endpoint and a real ADS stream that must stay open across every reload."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import re
from pathlib import Path

import aiohttp
import pytest
import yaml

from xds_server.config import load_config
from xds_server.probing.memory import InMemoryProbes
from xds_server.server import ControlPlane
from xds_server.testing import ScriptedAdsClient, wait_for
from xds_server.xds.resources import CLA_TYPE_URL

TOKEN = "reload-token"


def node(i: int) -> dict:
    return {"id": f"n{i}", "address": f"127.0.0.1:{8001 + i}", "probe_address": f"127.0.0.1:{9001 + i}"}


BASE = {
    "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
    "admin": {"listen": "127.0.0.1:0", "token": TOKEN},
    "health": {"ramp_start_percent": 100},
    "reload": {"watch_interval_s": 0.1, "drain_check_interval_s": 0.05},
    "clusters": [{"name": "llm", "nodes": [node(0), node(1)]}],
}


class Env:
    def __init__(self, tmp: Path) -> None:
        self.path = tmp / "xds.yaml"
        self.path.write_text(yaml.safe_dump(BASE))
        self.probes = InMemoryProbes()
        self.cp = ControlPlane(load_config(self.path), probe_sources=self.probes, config_path=str(self.path))
        self.pump: asyncio.Task | None = None
        self.silent: set[str] = set()
        self.fields: dict[str, dict] = {}   # node id -> the HeartbeatObserved fields its heartbeats carry

    async def _pump(self) -> None:  # every agent heartbeats every 50 ms, as a live agent would
        while True:
            for nid, s in list(self.probes.sources.items()):
                if nid in self.cp.sessions and self.cp.sessions[nid] is s and nid not in self.silent:
                    s.heartbeat(**self.fields.get(nid, {}))
            await asyncio.sleep(0.05)

    def write(self, doc: dict) -> None:
        self.path.write_text(yaml.safe_dump(doc))

    def eds(self, weights: bool = False) -> dict[str, str] | dict[str, int]:
        """node address -> published EDS health status of cluster llm (``weights``: its
        load_balancing_weight)."""
        from envoy.config.core.v3 import health_check_pb2
        from envoy.config.endpoint.v3 import endpoint_pb2

        res = self.cp.cache.resources(CLA_TYPE_URL).get("llm")
        if res is None:
            return {}
        cla = endpoint_pb2.ClusterLoadAssignment()
        res.any.Unpack(cla)
        return {f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}":
                e.load_balancing_weight.value if weights else health_check_pb2.HealthStatus.Name(e.health_status)
                for loc in cla.endpoints for e in loc.lb_endpoints}

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.cp.admin_port}"


def routed(e: Env) -> bool:
    """Both nodes HEALTHY in EDS; a node still WARMING gets another good probe, as its agent
    would send one (a result read while its heartbeats are missed, e.g. our loop starved under
    load, does not promote it)."""
    if e.eds() and set(e.eds().values()) == {"HEALTHY"}:
        return True
    for nid in ("n0", "n1"):
        if e.cp.health[nid].state.value == "WARMING":
            e.probes[nid].probe(ttft_ms=20.0)
    return False


@pytest.fixture
async def env(tmp_path):
    e = Env(tmp_path)
    await e.cp.start()
    e.pump = asyncio.create_task(e._pump())
    ads = ScriptedAdsClient(f"127.0.0.1:{e.cp.xds_port}")
    try:
        await ads.open()
        await wait_for(lambda: all(e.cp.health[n].state.value == "WARMING" for n in ("n0", "n1")), timeout_s=5.0,
                       step_s=0.02)
        await wait_for(lambda: routed(e), timeout_s=5.0, step_s=0.05)
        await ads.send(type_url=CLA_TYPE_URL, names=["llm"], node_id="envoy-1")
        first = await ads.recv()
        e.ads, e.ads_stream_ids = ads, set(e.cp.ads.streams)
        e.last = first
        yield e
        assert set(e.cp.ads.streams) == e.ads_stream_ids, "the ADS stream was not kept open across reloads"
    finally:
        e.pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await e.pump
        await ads.close()
        await e.cp.stop()


async def test_added_node_starts_unrouted_then_is_routed_after_a_good_probe(env):
    doc = copy.deepcopy(BASE)
    doc["clusters"][0]["nodes"].append(node(2))
    env.write(doc)
    st = await env.cp.reload_file("test")
    assert st["ok"] and st["changes"]["added"] == ["n2"] and st["changes"]["removed"] == []
    assert env.cp.health["n2"].state.value in ("COLD", "WARMING")
    assert env.eds()["127.0.0.1:8003"] != "HEALTHY"
    assert env.eds()["127.0.0.1:8001"] == "HEALTHY" and env.eds()["127.0.0.1:8002"] == "HEALTHY"
    await wait_for(lambda: env.cp.health["n2"].state.value == "WARMING", timeout_s=3.0, step_s=0.02)
    env.probes["n2"].probe(ttft_ms=20.0)
    await wait_for(lambda: env.eds().get("127.0.0.1:8003") == "HEALTHY", timeout_s=5.0, step_s=0.02)
    # the open ADS stream got the new assignment
    resp = await env.ads.recv(timeout_s=5.0)
    assert resp.type_url == CLA_TYPE_URL


async def test_removed_node_is_drained_then_dropped(env):
    doc = copy.deepcopy(BASE)
    doc["clusters"][0]["nodes"] = [node(0)]
    doc["health"]["drain_timeout_s"] = 0.5
    env.write(doc)
    st = await env.cp.reload_file("test")
    assert st["changes"]["removed"] == ["n1"]
    assert env.eds()["127.0.0.1:8002"] == "DRAINING"
    assert env.cp.health["n1"].effective_state.value == "DRAINING"
    await wait_for(lambda: "n1" not in env.cp.health, timeout_s=5.0, step_s=0.02)
    assert "n1" not in env.cp.sessions and list(env.eds()) == ["127.0.0.1:8001"]
    async with aiohttp.ClientSession() as s, s.get(env.admin + "/nodes") as r:
        assert [n["id"] for n in (await r.json())["nodes"]] == ["n0"]


async def test_changed_threshold_applies_at_once(env):
    """A threshold read when weights are computed applies with the reload, for a node whose
    reports do not change: n0 reports 60 requests waiting, over health.load.queue_warning (default
    50: its weight times queue_warning_weight_factor), under the 100 the reload sets."""
    n0, n1 = "127.0.0.1:8001", "127.0.0.1:8002"
    env.fields["n0"] = {"requests_waiting": 60.0}
    await wait_for(lambda: 0 < env.eds(weights=True)[n0] < env.eds(weights=True)[n1], timeout_s=5.0, step_s=0.02)
    doc = copy.deepcopy(BASE)
    doc["health"]["queue_warning"] = 100
    env.write(doc)
    st = await env.cp.reload_file("test")
    assert st["ok"] and st["changes"] == {"added": [], "removed": [], "changed": [], "restart_needed": []}
    assert env.cp.config.health.load.queue_warning == 100
    await wait_for(lambda: env.eds(weights=True)[n0] == env.eds(weights=True)[n1], timeout_s=5.0, step_s=0.02)


async def test_invalid_file_is_rejected_and_running_config_stays(env):
    doc = copy.deepcopy(BASE)
    doc["clusters"][0]["nodes"][0]["capacity"] = -1
    env.write(doc)
    async with aiohttp.ClientSession() as s:
        async with s.post(env.admin + "/reload", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 422
            body = await r.json()
        assert not body["ok"] and any("clusters.0.nodes.0.capacity" in e for e in body["errors"])
        async with s.get(env.admin + "/readyz") as r:
            ready = await r.json()
        assert r.status == 200 and ready["config_reload"]["ok"] is False
        assert any("clusters.0.nodes.0.capacity" in e for e in ready["config_reload"]["errors"])
        async with s.get(env.admin + "/metrics") as r:
            text = await r.text()
        # 1 or 2: the file watcher (0.1 s) may have seen the bad file before the POST did
        assert re.search(r'^sentinel_config_reloads_total\{result="invalid"\} [12]\.0$', text, re.M), text
        assert 'sentinel_config_reloads_total{result="ok"} 0.0' in text
        assert "sentinel_config_last_reload_ok 0.0" in text
        async with s.post(env.admin + "/reload", headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
    assert set(env.cp.health) == {"n0", "n1"} and set(env.eds().values()) == {"HEALTHY"}
    assert env.cp.config.clusters[0].nodes[0].capacity == 1


async def test_file_change_is_picked_up_and_restart_only_fields_keep_running_values(env):
    doc = copy.deepcopy(BASE)
    doc["clusters"][0]["nodes"].append(node(3))
    doc["xds"]["listen"] = "127.0.0.1:1"
    env.write(doc)
    await wait_for(lambda: "n3" in env.cp.health, timeout_s=5.0, step_s=0.02)
    st = env.cp.reload_status
    assert st["source"] == "file change" and st["changes"]["restart_needed"] == ["xds.listen"]
    assert env.cp.config.xds.listen == "127.0.0.1:0"
    assert env.cp.counters.config_reloads["ok"] == 1
