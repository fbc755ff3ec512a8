"""States an operator can see: fail-static, held-back, unreachable, draining and
unrouted nodes read the same in /nodes, `xds-server status` and /metrics, and agree with what
Envoy was told. A ControlPlane on a manual clock with in-memory probe sources (real admin HTTP),
and for the unreachable agent the real gRPC probe session dialling a port with nothing on it."""
from __future__ import annotations

import logging

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from xds_server.admin.status_text import format_status
from xds_server.config import parse_config
from xds_server.probing.memory import InMemoryProbes
from xds_server.process.clock import ManualClock
from xds_server.server import ControlPlane
from xds_server.testing import free_port, wait_for


def config(n: int, **health) -> dict:
    return {
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"ramp_start_percent": 100, **health},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.1:{8001 + i}", "probe_address": f"127.0.0.1:{9001 + i}"}
            for i in range(n)]}],
    }


@pytest.fixture
async def plane():
    """``start(n, **health)`` -> (cp, probes, clock, base URL) with every node HEALTHY."""
    made = []

    async def start(n: int, **health):
        probes, clock = InMemoryProbes(), ManualClock()
        cp = ControlPlane(parse_config(config(n, **health)), clock=clock, probe_sources=probes)
        made.append(cp)
        await cp.start()
        for i in range(n):
            probes[f"n{i}"].heartbeat()
            probes[f"n{i}"].probe(ttft_ms=20.0)
        return cp, probes, clock, f"http://127.0.0.1:{cp.admin_port}"

    try:
        yield start
    finally:
        for cp in made:
            await cp.stop()


async def admin_state(url: str) -> tuple[dict, dict[tuple[str, str], float], list[str], int, dict]:
    """(/nodes, display-state gauge {(node, state): value}, status lines, /readyz status, /readyz body)."""
    # each request bounded well under pytest's 300 s: a hang (seen once in CI) then names its request
    async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=20)) as http:
        async with http.get("/nodes") as r:
            nodes = await r.json()
        async with http.get("/metrics") as r:
            fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
        async with http.get("/readyz") as r:
            ready_status, ready = r.status, await r.json()
    shown = {(s.labels["node"], s.labels["state"]): s.value for s in fams["sentinel_node_display_state"].samples}
    shown["fail_static"] = fams["sentinel_fail_static"].samples[0].value
    return nodes, shown, format_status(nodes), ready_status, ready


def beat(probes, clock, live, seconds: float, **fields) -> None:
    """Advance ``seconds`` in 50 ms steps, heartbeats from the ``live`` nodes each step."""
    for _ in range(round(seconds / 0.05)):
        clock.advance(0.05)
        for nid in live:
            probes[nid].heartbeat(**fields.get(nid, {}))


def row(lines: list[str], nid: str) -> list[str]:
    return next(line for line in lines if line.startswith(nid + " ")).split()


async def test_states_01_fail_static_6_of_10_silent_shown_FAIL_STATIC_never_healthy_and_unrouted(plane):
    _cp, probes, clock, url = await plane(10)
    live = [f"n{i}" for i in range(10)]
    beat(probes, clock, live, 0.5)
    beat(probes, clock, live[6:], 1.0)   # n0..n5 fall silent together: 6 of 10 > 50 %
    nodes, shown, lines, _, _ = await admin_state(url)
    assert nodes["fail_static"]["active"] is True and nodes["fail_static"]["held_clusters"] == ["llm"]
    for v in nodes["nodes"]:
        # never "published HEALTHY" and "not routed because UNHEALTHY" at once
        assert not (v["eds_health_status"] == "HEALTHY" and v["not_routed_because"]), v
    silent = [v for v in nodes["nodes"] if v["id"] in live[:6]]
    assert [v["display_state"] for v in silent] == ["FAIL_STATIC"] * 6
    assert all(v["routed"] and v["health_state"] == "UNHEALTHY" and v["verdict_not_applied"] for v in silent)
    assert lines[0].startswith("FAIL-STATIC for ") and "clusters held: llm" in lines[0]
    assert row(lines, "n0")[2] == "FAIL_STATIC" and row(lines, "n9")[2] == "HEALTHY"
    assert shown["fail_static"] == 1.0
    assert sum(shown[(f"n{i}", "FAIL_STATIC")] for i in range(10)) == 6


async def test_states_02_1_of_3_queue_blocked_nodes_held_back_by_the_50pct_cap_shown_HELD_BACK(plane):
    _cp, probes, clock, url = await plane(4)   # cap: 50 % of 4 = 2 soft ejections
    deep = {"requests_waiting": 150.0}         # > queue_critical 100: a soft block
    beat(probes, clock, ["n0", "n1", "n2", "n3"], 0.3, n0=deep, n1=deep, n2=deep)
    nodes, shown, lines, _, _ = await admin_state(url)
    by = {v["id"]: v for v in nodes["nodes"]}
    held = [nid for nid, v in by.items() if v["display_state"] == "HELD_BACK"]
    assert held == ["n2"]   # n0, n1 ejected (sorted by id), n2 held back, n3 fine
    assert by["n2"]["routed"] and "queue: 150 waiting > 100" in by["n2"]["held_back"]
    assert by["n2"]["display_reason"].startswith("held back by max_ejection_percent: queue")
    assert [by[n]["routed"] for n in ("n0", "n1")] == [False, False]
    assert by["n0"]["not_routed_because"].startswith("queue: 150 waiting")
    assert row(lines, "n2")[2] == "HELD_BACK" and row(lines, "n0")[3] == "-"   # unrouted: no weight shown
    assert shown[("n2", "HELD_BACK")] == 1.0 and shown[("n0", "HELD_BACK")] == 0.0


async def test_states_03_unhealthy_weight_hidden_draining_reason_says_drain_readyz_503_at_0_routable(plane):
    cp, probes, clock, url = await plane(2)
    beat(probes, clock, ["n0", "n1"], 0.3)
    cp.drain("n1", True, "maintenance")
    beat(probes, clock, ["n0"], 1.0)   # n0 keeps beating; n1 is drained, then silent
    beat(probes, clock, [], 1.0)       # both silent: n0 UNHEALTHY too
    nodes, shown, lines, ready_status, ready = await admin_state(url)
    by = {v["id"]: v for v in nodes["nodes"]}
    assert by["n0"]["health_state"] == "UNHEALTHY" and by["n0"]["weight"] == 100   # what was published ...
    assert row(lines, "n0")[3] == "-"                                              # ... is not shown as a share
    assert by["n1"]["display_state"] == "DRAINING"
    assert by["n1"]["display_reason"].startswith("operator drain for ") and "PROBATION ramp" not in \
        by["n1"]["display_reason"].split("(health")[0]
    assert ready_status == 503 and ready["routable_nodes"] == 0
    assert "0 routable nodes" in ready["why_not_ready"]
    assert shown[("n1", "DRAINING")] == 1.0 and shown[("n0", "UNHEALTHY")] == 1.0


async def test_states_04_unreachable_agent_shown_UNREACHABLE_in_3_views_log_1_line_for_10_dials(caplog):
    dead = free_port()   # nothing listens here
    cfg = parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"reconnect_backoff_initial_ms": 20, "reconnect_backoff_max_ms": 40},
        "probe": {"channel_initial_backoff_ms": 20},
        "clusters": [{"name": "llm", "nodes": [
            {"id": "gone", "address": "127.0.0.1:8001", "probe_address": f"127.0.0.1:{dead}"}]}],
    })
    caplog.set_level(logging.INFO, logger="xds_server")
    cp = ControlPlane(cfg)
    await cp.start()
    url = f"http://127.0.0.1:{cp.admin_port}"
    try:
        sess = cp.sessions["gone"]
        await wait_for(lambda: sess.failed_dials >= 10, timeout_s=20.0, step_s=0.05)
        nodes, shown, lines, _, _ = await admin_state(url)
    finally:
        await cp.stop()
    [v] = nodes["nodes"]
    assert v["display_state"] == "UNREACHABLE" and v["health_state"] == "COLD"
    assert v["agent_failed_dials"] >= 10 and "UNAVAILABLE" in v["display_reason"]
    assert row(lines, "gone")[2] == "UNREACHABLE"
    assert shown[("gone", "UNREACHABLE")] == 1.0 and shown[("gone", "COLD")] == 0.0
    dial_lines = [r for r in caplog.records if "gone" in r.getMessage()
                  and ("unreachable" in r.getMessage() or "closed" in r.getMessage())]
    assert len(dial_lines) == 1, [r.getMessage() for r in dial_lines]   # not one per retry


async def test_states_05_version_in_clusters_equals_the_acked_resource_version_in_xds_clients(plane):
    from xds_server.testing import ScriptedAdsClient
    from xds_server.xds.resources import CLA_TYPE_URL as EDS
    from xds_server.xds.resources import CLUSTER_TYPE_URL as CDS

    cp, probes, clock, url = await plane(2)
    beat(probes, clock, ["n0", "n1"], 0.2)   # the manual clock runs the publish timer
    c = ScriptedAdsClient(f"127.0.0.1:{cp.xds_port}")
    await c.open()
    try:
        await c.send(type_url=CDS, node_id="envoy-v")
        cds = await c.recv()
        await c.send(type_url=EDS, names=["llm"])
        await c.send(type_url=CDS, version=cds.version_info, nonce=cds.nonce)
        eds = await c.recv()
        await c.send(type_url=EDS, names=["llm"], version=eds.version_info, nonce=eds.nonce)
        async with aiohttp.ClientSession(url) as http:
            async def acked():
                async with http.get("/xds/clients") as r:
                    body = await r.json()
                streams = [s for s in body["clients"] if s["node_id"] == "envoy-v"]
                t = streams[0]["types"]["ClusterLoadAssignment"] if streams else {}
                return t if t.get("acked_nonce") == eds.nonce else None
            t = await wait_for(acked, timeout_s=5.0, step_s=0.05)
            async with http.get("/clusters") as r:
                [cl] = (await r.json())["clusters"]
        assert t["resources_acked"] is True
        assert t["resource_versions"] == {"llm": cl["xds_version"]}
    finally:
        await c.close()


async def test_states_06_429_for_2s_on_3_of_4_shown_REFUSING_2_blocked_1_held_back_back_on_1_good_probe(plane):
    """Every probe answered 429 for ``busy_refusal_block_s`` (2 s here): REFUSING, not routed, its
    reason the run; the 50 % cap holds the third back (routed at the 30 % busy share, one event);
    the first good probe routes it at full weight again, without probation."""
    cp, probes, clock, url = await plane(4, busy_refusal_block_s=2.0)
    live = ["n0", "n1", "n2", "n3"]
    for _ in range(6):   # 429 at 0, 0.5, ..., 2.5 s
        for nid in live[:3]:
            probes[nid].probe(kind="HTTP_STATUS", http_status=429)
        beat(probes, clock, live, 0.5)
    nodes, shown, lines, _, _ = await admin_state(url)
    by = {v["id"]: v for v in nodes["nodes"]}
    assert [by[n]["display_state"] for n in live] == ["REFUSING", "REFUSING", "HELD_BACK", "HEALTHY"]
    assert [by[n]["routed"] for n in live] == [False, False, True, True]
    assert by["n0"]["display_reason"].startswith("busy: every probe answered HTTP 429 for 2.5 s (6 probes")
    assert by["n0"]["not_routed_because"].startswith("busy: every probe answered HTTP 429")
    assert by["n2"]["health_state"] == "REFUSING" and by["n2"]["weight"] == 30
    assert by["n2"]["display_reason"].startswith("held back by max_ejection_percent: busy: every probe answered")
    assert row(lines, "n0")[2:4] == ["REFUSING", "-"] and row(lines, "n2")[2:4] == ["HELD_BACK", "30"]
    assert shown[("n0", "REFUSING")] == 1.0 and shown[("n2", "HELD_BACK")] == 1.0
    assert cp.core.counters.events["held_back"] == 1
    probes["n0"].probe(ttft_ms=25.0)
    beat(probes, clock, live, 0.1)
    nodes, shown, lines, _, _ = await admin_state(url)
    n0 = next(v for v in nodes["nodes"] if v["id"] == "n0")
    assert n0["display_state"] == "HEALTHY" and n0["routed"] and n0["weight"] == 100
    assert n0["display_reason"].startswith("load eased: first good probe (TTFT 25 ms) after refusing work")
    assert shown[("n0", "REFUSING")] == 0.0 and shown[("n0", "HEALTHY")] == 1.0
