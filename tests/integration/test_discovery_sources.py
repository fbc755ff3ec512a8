"""Nodes from a targets file and from Kubernetes pods, through the reload path,
on a ControlPlane with in-memory probe sources, real ADS/admin ports and a local fake API server
(fake_kube.py) serving list and watch; one end-to-end test runs the real ``xds-server serve``."""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys

import aiohttp
import pytest
import yaml
from fake_kube import FakeKube

from xds_server.config import parse_config
from xds_server.health import model as hm
from xds_server.probing.memory import InMemoryProbes
from xds_server.server import ControlPlane
from xds_server.testing import ManagedProcess, ScriptedAdsClient, free_port, wait_for
from xds_server.xds.resources import CLA_TYPE_URL

STATIC = {"id": "s0", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:9001"}


def base(discovery: dict) -> dict:
    return {"xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
            "admin": {"listen": "127.0.0.1:0"},
            "health": {"ramp_start_percent": 100, "drain_timeout_s": 60},
            "reload": {"watch_interval_s": 0, "drain_check_interval_s": 0.05},
            "tls": {"agents": {"mode": "plaintext"}},  # discovery from Kubernetes needs it stated
            "clusters": [{"name": "llm", "nodes": [STATIC], "discovery": discovery}]}


def target(i: int, host: str = "127.0.0.1") -> dict:
    return {"id": f"f{i}", "address": f"{host}:{8100 + i}", "probe_address": f"{host}:{9100 + i}"}


def eds_of(cla_any) -> dict[str, str]:
    from envoy.config.core.v3 import health_check_pb2
    from envoy.config.endpoint.v3 import endpoint_pb2
    cla = endpoint_pb2.ClusterLoadAssignment()
    cla_any.Unpack(cla)
    return {f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}":
            health_check_pb2.HealthStatus.Name(e.health_status) for loc in cla.endpoints for e in loc.lb_endpoints}


class Env:
    """A started ControlPlane whose every node's in-memory agent heartbeats every 50 ms, with
    ``in_flight[node id]`` requests running (default 1: a draining node is drained, and dropped,
    once the test sets 0)."""

    def __init__(self, doc: dict) -> None:
        self.probes = InMemoryProbes()
        self.cp = ControlPlane(parse_config(doc), probe_sources=self.probes)
        self._pump: asyncio.Task | None = None
        self.in_flight: dict[str, float] = {}

    async def __aenter__(self) -> Env:
        await self.cp.start()
        self._pump = asyncio.create_task(self._beat())
        return self

    async def __aexit__(self, *exc) -> None:
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump
        await self.cp.stop()

    async def _beat(self) -> None:
        while True:
            for nid, s in list(self.probes.sources.items()):
                if self.cp.sessions.get(nid) is s:
                    s.heartbeat(requests_running=self.in_flight.get(nid, 1.0))
            await asyncio.sleep(0.05)

    def eds(self) -> dict[str, str]:
        res = self.cp.cache.resources(CLA_TYPE_URL).get("llm")
        return eds_of(res.any) if res is not None else {}

    async def healthy(self, node_id: str, address: str) -> None:
        """WARMING once its agent answers, then HEALTHY in EDS after a good probe (sent again
        while the node is still WARMING, as its agent would: a result read while its heartbeats
        are missed, e.g. our loop starved under load, does not promote it)."""
        await wait_for(lambda: node_id in self.cp.health and self.cp.health[node_id].state.value == "WARMING",
                       timeout_s=15.0, step_s=0.02, what=f"{node_id} WARMING")

        def routed() -> bool:
            if self.eds().get(address) == "HEALTHY":
                return True
            if self.cp.health[node_id].state.value == "WARMING":
                self.probes[node_id].probe(ttft_ms=20.0)
            return False

        await wait_for(routed, timeout_s=15.0, step_s=0.05, what=lambda: f"{address} HEALTHY in {self.eds()}")

    async def nodes(self) -> dict[str, dict]:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{self.cp.admin_port}/nodes") as r:
            return {n["id"]: n for n in (await r.json())["nodes"]}


# -- targets file ----------------------------------------------------------------------------

async def test_targets_file_add_change_address_bad_file_and_remove(tmp_path):
    path = tmp_path / "targets.yaml"
    path.write_text(yaml.safe_dump([target(1)]))
    async with Env(base({"file": {"path": str(path), "interval_s": 0.05}})) as env:
        assert set(env.cp.health) == {"s0", "f1"}  # read at start, merged with the static node
        await env.healthy("f1", "127.0.0.1:8101")
        path.write_text(yaml.safe_dump([target(1), target(2)]))
        await wait_for(lambda: "f2" in env.cp.health, timeout_s=15.0, step_s=0.02)
        assert env.cp.health["f2"].state.value in ("COLD", "WARMING")  # added: not routed yet
        assert env.eds()["127.0.0.1:8102"] != "HEALTHY"
        await env.healthy("f2", "127.0.0.1:8102")

        path.write_text("- {id: f1, address: 127.0.0.1:8101, probe_address: 127.0.0.1:9101}\n- {id: f3}\n")
        src = env.cp.discovery.sources[("llm", "file")]
        await wait_for(lambda: src.error, timeout_s=15.0, step_s=0.02)
        assert f"targets file {path}: entry 1 (id 'f3'): address: Field required" in src.error
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{env.cp.admin_port}/metrics") as r:
                text = await r.text()
            async with s.get(f"http://127.0.0.1:{env.cp.admin_port}/readyz") as r:
                ready = await r.json()
        assert 'sentinel_discovery_errors_total{cluster="llm",source="file"} 1.0' in text
        assert 'sentinel_discovery_nodes{cluster="llm",source="file"} 2.0' in text
        assert ready["discovery"]["clusters"]["llm"][0]["error"] == src.error
        assert set(env.cp.health) == {"s0", "f1", "f2"}  # the last good set stays
        assert env.eds()["127.0.0.1:8102"] == "HEALTHY"

        moved = {**target(2), "address": "127.0.0.1:8202"}
        path.write_text(yaml.safe_dump([moved]))  # f1 removed; f2 at another address
        await wait_for(lambda: "127.0.0.1:8202" in env.eds(), timeout_s=15.0, step_s=0.02)
        assert "127.0.0.1:8102" not in env.eds()  # readdressed: the old endpoint is gone at once
        assert env.cp.health["f2"].state.value in ("COLD", "WARMING")  # ... and the new one starts over
        assert env.eds()["127.0.0.1:8101"] == "DRAINING"  # removed: drained, then dropped
        env.in_flight["f1"] = 0
        await wait_for(lambda: "f1" not in env.cp.health, timeout_s=15.0, step_s=0.02)
        nodes = await env.nodes()
        assert set(nodes) == {"s0", "f2"} and nodes["f2"]["address"] == "127.0.0.1:8202"
        assert src.error is None and src.loads == 3


async def test_reload_keeps_discovered_nodes_and_follows_a_changed_discovery_section(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(yaml.safe_dump([target(1)]))
    b.write_text(yaml.safe_dump([target(2)]))
    doc = base({"file": {"path": str(a), "interval_s": 0.05}})
    async with Env(doc) as env:
        doc["health"]["drain_timeout_s"] = 0.2
        changes = await env.cp.reload(parse_config(doc), "test")  # same discovery: f1 stays
        assert changes["removed"] == [] and set(env.cp.health) == {"s0", "f1"}
        doc["clusters"][0]["discovery"]["file"]["path"] = str(b)
        changes = await env.cp.reload(parse_config(doc), "test")
        assert changes["added"] == ["f2"] and changes["removed"] == ["f1"]
        assert env.eds()["127.0.0.1:8101"] == "DRAINING"


# -- Kubernetes ------------------------------------------------------------------------------

@pytest.fixture
async def kube(tmp_path):
    fake = FakeKube()
    await fake.start()
    fake.kubeconfig_path = fake.kubeconfig(tmp_path / "kubeconfig")
    try:
        yield fake
    finally:
        await fake.stop()


def kube_doc(fake: FakeKube, **kw) -> dict:
    spec = {"namespace": "default", "label_selector": {"app": "vllm"}, "target_port": "http",
            "probe_port": "probe", "kubeconfig": fake.kubeconfig_path, "retry_backoff_s": 0.05, **kw}
    return base({"kubernetes": spec})


async def test_pods_ready_added_being_deleted_drained_and_deleted_dropped(kube):
    kube.nodes["worker-1"] = {"topology.kubernetes.io/region": "r-1", "topology.kubernetes.io/zone": "z-a"}
    kube.add_pod("p1", ip="127.0.1.1", ready=True)
    kube.add_pod("p2")  # Pending: no podIP
    kube.add_pod("other", ip="127.0.1.9", ready=True, labels={"app": "something-else"})
    async with Env(kube_doc(kube, locality_from="node")) as env:
        await wait_for(lambda: "p1" in env.cp.health, timeout_s=15.0, step_s=0.02)
        await env.healthy("p1", "127.0.1.1:8000")
        nodes = await env.nodes()
        assert set(nodes) == {"s0", "p1"}
        assert nodes["p1"]["probe_address"] == "127.0.1.1:9100"
        assert nodes["p1"]["locality"] == {"region": "r-1", "zone": "z-a", "sub_zone": ""}
        src = env.cp.discovery.sources[("llm", "kubernetes")]
        assert src.skipped == {"p2": "no status.podIP yet"}

        kube.set_ready("p2", False, ip="127.0.1.2")  # scheduled, not Ready: not routed, not added
        await wait_for(lambda: src.skipped.get("p2", "").startswith("not Ready"), timeout_s=15.0, step_s=0.02)
        assert "p2" not in env.cp.health
        kube.set_ready("p2")
        await wait_for(lambda: "p2" in env.cp.health, timeout_s=15.0, step_s=0.02)
        assert env.cp.health["p2"].state.value in ("COLD", "WARMING")  # a new pod starts unrouted
        await env.healthy("p2", "127.0.1.2:8000")
        assert kube.node_reads == ["worker-1"]  # read once for both pods

        kube.mark_deleting("p1")  # deletionTimestamp: drained at once, then dropped
        await wait_for(lambda: env.eds().get("127.0.1.1:8000") == "DRAINING", timeout_s=15.0, step_s=0.02)
        assert env.cp.health["p1"].effective_state.value == "DRAINING"
        env.in_flight["p1"] = 0
        await wait_for(lambda: "p1" not in env.cp.health, timeout_s=15.0, step_s=0.02)
        kube.delete_pod("p1")
        kube.delete_pod("p2")  # deleted without a grace period: drained, then dropped as well
        await wait_for(lambda: env.eds().get("127.0.1.2:8000") == "DRAINING", timeout_s=15.0, step_s=0.02)
        env.in_flight["p2"] = 0
        await wait_for(lambda: set(env.cp.health) == {"s0"}, timeout_s=15.0, step_s=0.02)
        assert list(env.eds()) == ["127.0.0.1:8001"]


async def test_watch_restart_resumes_from_last_resource_version_without_duplicates(kube):
    kube.add_pod("p1", ip="127.0.1.1", ready=True)
    async with Env(kube_doc(kube)) as env:
        src = env.cp.discovery.sources[("llm", "kubernetes")]
        await wait_for(lambda: "p1" in env.cp.health, timeout_s=15.0, step_s=0.02)
        watch_rvs = lambda: [rv for kind, _, rv in kube.requests if kind == "watch"]  # noqa: E731 - a one-line probe
        resumed_from = [str(kube.rv)]  # the first watch starts at the list's resourceVersion
        for i in range(2, 5):
            await wait_for(lambda i=i: len(watch_rvs()) == i - 1, timeout_s=15.0, step_s=0.02)
            kube.add_pod(f"p{i}", ip=f"127.0.1.{i}", ready=True)
            kube.add_pod(f"x{i}", labels={"app": "other"})  # not selected: only a bookmark tells
            kube.bookmark()
            await wait_for(lambda: src.state.resource_version == str(kube.rv), timeout_s=15.0, step_s=0.02)
            resumed_from.append(str(kube.rv))
            kube.end_watches()
        await wait_for(lambda: len(watch_rvs()) == 4, timeout_s=15.0, step_s=0.02)
        await wait_for(lambda: {"p1", "p2", "p3", "p4"} <= set(env.cp.health), timeout_s=15.0, step_s=0.02)
        assert watch_rvs() == resumed_from  # each watch resumed where the last one ended
        assert [r for r in kube.requests if r[0] == "list"] == [("list", "default", None)]
        sent = [(e["type"], e["object"]["metadata"].get("name"), e["object"]["metadata"]["resourceVersion"])
                for e in kube.sent]
        assert len(sent) == len(set(sent)) and src.state.stale == 0 and src.state.applied == 3
        assert src.errors == 0 and src.gone == 0


async def test_gone_410_relists_and_converges(kube):
    kube.add_pod("p1", ip="127.0.1.1", ready=True)
    kube.add_pod("p2", ip="127.0.1.2", ready=True)
    async with Env(kube_doc(kube)) as env:
        src = env.cp.discovery.sources[("llm", "kubernetes")]
        await wait_for(lambda: {"p1", "p2"} <= set(env.cp.health) and kube._watches, timeout_s=15.0, step_s=0.02)
        kube.hold_watches()  # the API server away: changes happen while no watch runs
        kube.end_watches()
        kube.delete_pod("p1")
        kube.add_pod("p3", ip="127.0.1.3", ready=True)
        kube.expire()  # ... and the history holding them is compacted
        kube.release_watches()
        await wait_for(lambda: src.gone == 1 and src.lists == 2, timeout_s=15.0, step_s=0.02,
                       what=lambda: str(src.status()))
        await wait_for(lambda: "p3" in env.cp.health, timeout_s=15.0, step_s=0.02)
        assert env.eds()["127.0.1.1:8000"] == "DRAINING"  # p1, deleted meanwhile: drained
        env.in_flight["p1"] = 0
        await wait_for(lambda: set(env.cp.health) == {"s0", "p2", "p3"}, timeout_s=15.0, step_s=0.02)
        assert [n.id for n in src.nodes] == ["p2", "p3"] and src.error is None
        kube.add_pod("p4", ip="127.0.1.4", ready=True)  # the watch after the relist runs
        await wait_for(lambda: "p4" in env.cp.health, timeout_s=15.0, step_s=0.02)


async def test_an_ejected_pod_that_still_exists_stays_ejected_across_a_restart(kube, tmp_path):
    """The state file keeps a discovered node's ejection as it does a configured one's: the pod
    found again after the restart resumes UNHEALTHY (not WARMING, then routed at its first good
    probe), its healthy peer resumes routed; one deleted meanwhile gets nothing back."""
    for i in (1, 2, 3):
        kube.add_pod(f"p{i}", ip=f"127.0.1.{i}", ready=True)
    doc = {**kube_doc(kube), "state": {"path": str(tmp_path / "state.json"), "write_interval_s": 0.05}}
    saved = lambda: json.loads((tmp_path / "state.json").read_text())["nodes"]  # noqa: E731 - a one-line probe
    async with Env(doc) as env:
        for i in (1, 2, 3):
            await env.healthy(f"p{i}", f"127.0.1.{i}:8000")
        for _ in range(2):  # 2 consecutive probe failures eject (seed 001)
            env.probes["p1"].probe(kind=hm.ProbeResultKind.TIMEOUT)
        await wait_for(lambda: env.eds().get("127.0.1.1:8000") == "UNHEALTHY", timeout_s=5.0, step_s=0.02)
        await wait_for(lambda: (tmp_path / "state.json").exists() and saved().get("p1", {}).get("state") == "UNHEALTHY"
                       and saved().get("p3", {}).get("state") == "HEALTHY", timeout_s=5.0, step_s=0.02)
    kube.delete_pod("p3")  # gone while the control plane was down
    async with Env(doc) as env:
        await wait_for(lambda: all(n in env.cp.health and env.cp.health[n].state.value != "COLD" for n in ("p1", "p2")),
                       timeout_s=15.0, step_s=0.02, what="p1 and p2 found again and heard")
        assert env.cp.health["p1"].state.value == "UNHEALTHY"       # the ejection survived
        assert env.cp.health["p1"].ejection.cause is hm.EjectionCause.PROBE
        assert env.cp.health["p2"].state.value == "HEALTHY"         # routed again without a probe
        await wait_for(lambda: env.eds().get("127.0.1.2:8000") == "HEALTHY", timeout_s=5.0, step_s=0.02)
        assert env.eds()["127.0.1.1:8000"] == "UNHEALTHY"
        assert "p3" not in env.cp.health
        # written again meanwhile: p3's kept state waits in the file for its pod (until max_age_s)
        await wait_for(lambda: saved().get("p1", {}).get("state") == "UNHEALTHY", timeout_s=5.0, step_s=0.02)


# -- end to end: the real xds-server process --------------------------------------------------

async def test_serve_process_discovers_pods_into_nodes_and_eds(kube, tmp_path):
    xds_port, admin_port = free_port(), free_port()
    doc = kube_doc(kube)
    doc["xds"]["listen"], doc["admin"]["listen"] = f"127.0.0.1:{xds_port}", f"127.0.0.1:{admin_port}"
    (tmp_path / "xds.yaml").write_text(yaml.safe_dump(doc))
    kube.add_pod("p1", ip="127.0.1.1", ready=True)
    proc = ManagedProcess("xds-server", [sys.executable, "-m", "xds_server.cli", "serve", "--config",
                                         str(tmp_path / "xds.yaml")], tmp_path / "server.log",
                          ready_pattern="admin listening")
    ads = ScriptedAdsClient(f"127.0.0.1:{xds_port}")
    base_url = f"http://127.0.0.1:{admin_port}"
    try:
        proc.start()
        await ads.open()
        await ads.send(type_url=CLA_TYPE_URL, names=["llm"], node_id="envoy-1")
        seen: dict[str, str] = {}

        async def eds_has(address: str | None, absent: str | None = None) -> bool:
            with contextlib.suppress(asyncio.TimeoutError):
                while True:
                    resp = await ads.recv(timeout_s=0.2)
                    seen.clear()
                    seen.update(eds_of(resp.resources[0]))
                    await ads.send(type_url=CLA_TYPE_URL, names=["llm"], version=resp.version_info,
                                   nonce=resp.nonce, node_id="envoy-1")
            return (address is None or address in seen) and (absent is None or absent not in seen)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async def node_ids() -> set[str]:
                try:
                    async with s.get(f"{base_url}/nodes") as r:
                        return {n["id"] for n in (await r.json())["nodes"]} if r.status == 200 else set()
                except (TimeoutError, aiohttp.ClientError):  # not up yet, or a loaded machine
                    return set()

            await wait_for(lambda: node_ids(), timeout_s=20.0, step_s=0.1)
            await wait_for(lambda: eds_has("127.0.1.1:8000"), timeout_s=20.0, step_s=0.0,
                           what=lambda: f"p1 in EDS {seen}")
            assert await node_ids() == {"s0", "p1"}
            kube.add_pod("p2", ip="127.0.1.2", ready=True)
            kube.mark_deleting("p1")
            await wait_for(lambda: eds_has("127.0.1.2:8000", absent="127.0.1.1:8000"), timeout_s=20.0,
                           step_s=0.0, what=lambda: f"p2 in, p1 out of EDS {seen}")
            assert await node_ids() == {"s0", "p2"}
    finally:
        await ads.close()
        proc.stop()
    log = (tmp_path / "server.log").read_text()
    assert "config reloaded (discovery): 1 added" in log and "dropped 1 node(s) removed from config: p1" in log
