"""The control plane driven in memory: a ManualClock, in-memory probe sources, no sockets.

Covers the publish planner (coalescing, warm-up gate), three past bugs (fail-static
look-back, DRAINING state metric, outlier wake-up timers) and the layering (no import cycle).
"""
from __future__ import annotations

import ast
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from xds_server.admin.metrics import ControlPlaneCollector
from xds_server.config import parse_config
from xds_server.control.last_good import LastGoodHistory
from xds_server.control.publish import PublishPlanner
from xds_server.health import model as hm
from xds_server.policy.cluster_routing import counted_silent
from xds_server.probing.memory import InMemoryProbes
from xds_server.process.clock import ManualClock
from xds_server.server import ControlPlane
from xds_server.xds.resources import CLA_TYPE_URL


def config(n: int = 3, xds: dict | None = None, **health) -> dict:
    return {
        "xds": {"listen": "127.0.0.1:0", "coalesce_window_ms": 0, "warmup_timeout_ms": 5000, **(xds or {})},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"failure_detector": "count", "ramp_start_percent": 100.0, **health},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.1:{8001 + i}", "probe_address": f"127.0.0.1:{9001 + i}"}
            for i in range(n)]}],
    }


def in_memory(cfg: dict) -> tuple[ControlPlane, ManualClock, InMemoryProbes]:
    clock, probes = ManualClock(), InMemoryProbes()
    cp = ControlPlane(parse_config(cfg), clock=clock, probe_sources=probes)
    cp.open()
    return cp, clock, probes


def all_healthy(cp: ControlPlane, clock: ManualClock, probes: InMemoryProbes, hb_s: float = 0.1,
                rounds: int = 20) -> None:
    for _ in range(rounds):
        for nid in cp.core.node_cfg:
            probes[nid].heartbeat()
            probes[nid].probe(ttft_ms=20.0)
        clock.advance(hb_s)
    assert {nh.state for nh in cp.health.values()} == {hm.NodeState.HEALTHY}


def published(cp: ControlPlane) -> dict[str, str]:
    from envoy.config.endpoint.v3 import endpoint_pb2

    m = endpoint_pb2.ClusterLoadAssignment()
    m.ParseFromString(cp.cache.resources(CLA_TYPE_URL)["llm"].any.value)
    names = {0: "UNKNOWN", 1: "HEALTHY", 2: "UNHEALTHY", 3: "DRAINING"}
    return {e.endpoint.hostname: names[e.health_status] for lle in m.endpoints for e in lle.lb_endpoints}


def slow_builds(cp: ControlPlane, clock: ManualClock, build_s: float) -> list[float]:
    """Make every publish take ``build_s`` of the clock (moved inside on_publish, as the loop's
    clock moves while a large cluster is built); returns the list each publish's start is added to."""
    write = cp.core.on_publish
    at: list[float] = []

    def slow_write(p):
        at.append(clock.now())
        write(p)
        clock._now += build_s

    cp.core.on_publish = slow_write
    return at


def metric_samples(cp: ControlPlane, name: str) -> dict:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ControlPlaneCollector(cp.view))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    return {tuple(sorted(s.labels.items())): s.value for s in fams[name].samples}


# -- publish planner (pure) ---------------------------------------------------------------------


def test_planner_publishes_an_isolated_change_at_once_and_coalesces_within_the_window():
    p = PublishPlanner(parse_config(config(xds={"coalesce_window_ms": 100})))
    assert p.mark_dirty("llm", warm=False, now_s=1.0) is None  # gate closed: held
    assert p.mark_dirty("llm", warm=True, now_s=1.0) == 1.0     # quiet: at once
    assert p.mark_dirty("llm", warm=True, now_s=1.0) is None    # already scheduled
    p.last_publish_s, p.dirty = 1.0, set()
    p.disarm()
    assert p.mark_dirty("llm", warm=True, now_s=1.03) == 1.1    # within the window: at its end


def test_planner_spaces_publishes_by_the_build_ratio_when_a_build_is_longer_than_the_window():
    p = PublishPlanner(parse_config(config(xds={"coalesce_window_ms": 5, "publish_build_ratio": 3})))
    p.gate_open.add("llm")
    p.last_publish_s, p.last_build_s = 1.0, 0.02  # a 20 ms build: the next one >= 60 ms later
    assert p.min_gap_s() == 0.06
    assert abs(p.mark_dirty("llm", warm=True, now_s=1.01) - 1.06) < 1e-9
    p.disarm()
    assert p.mark_dirty("llm", warm=True, now_s=1.5) == 1.5     # after a quiet gap: at once
    p.disarm()
    p.last_build_s = 0.001                                      # a 1 ms build: the window decides
    assert abs(p.mark_dirty("llm", warm=True, now_s=1.001) - 1.005) < 1e-9
    off = PublishPlanner(parse_config(config(xds={"coalesce_window_ms": 5, "publish_build_ratio": 0})))
    off.last_build_s = 0.02
    assert off.min_gap_s() == 0.005


def test_core_measures_each_publish_build_on_its_clock_and_spaces_the_next_by_it():
    """A build that takes 20 ms of the clock (the ManualClock moved inside on_publish, as the
    loop's clock moves while a large cluster is built) puts the next publish of a burst 60 ms
    after it; every publish still happens (none is lost)."""
    cp, clock, probes = in_memory(config(xds={"coalesce_window_ms": 5, "warmup_timeout_ms": 0}))
    all_healthy(cp, clock, probes)
    at = slow_builds(cp, clock, 0.02)
    cp.core.drain("n0", True, "t")  # published at once (an operator action)
    assert len(at) == 1 and abs(cp.core.planner.last_build_s - 0.02) < 1e-9
    t0 = at[0]
    cp.core.drain("n1", True, "t")
    cp.core.observe("n2", hm.DrainRequested(True, "t"), clock.now())  # a change in the burst: scheduled
    clock.advance(0.03)
    assert len(at) == 2
    clock.advance(0.2)
    assert len(at) == 3 and at[2] - at[1] >= 0.06 - 1e-9
    assert published(cp)["n2"] == "DRAINING" and t0 < at[1]


def test_warm_up_gate_holds_a_cluster_until_every_node_left_warming_or_the_timeout():
    cp, clock, probes = in_memory(config())
    for nid in ("n0", "n1"):
        probes[nid].heartbeat()
        probes[nid].probe()
    clock.advance(0.01)
    assert cp.cla_version("llm") == ""  # n2 still COLD
    clock.advance(5.0)  # warm-up timeout
    assert cp.cla_version("llm") != ""
    assert published(cp)["n2"] == "UNHEALTHY"


def test_a_configured_cluster_with_no_nodes_is_published_at_start_not_after_the_warm_up_timeout():
    """``nodes: []`` meets "every node left COLD" at once, but no node change ever
    marked it, so it waited for ``warmup_timeout_ms`` (5 s) while an Envoy asked for it."""
    cfg = config()
    cfg["clusters"].append({"name": "empty", "nodes": []})
    cp, clock, _ = in_memory(cfg)
    clock.advance(0.01)  # the first publish runs on the clock, well inside the 5 s timeout
    assert cp.cla_version("empty") != ""
    assert "empty" in cp.core.planner.gate_open
    assert cp.cla_version("llm") == ""  # the other cluster's nodes are all COLD: still held


# -- bug 1: fail-static look-back ----------------------------------------------------------------


def test_fail_static_keeps_last_good_assignment_after_more_publishes_than_the_old_bound():
    """The old look-back kept the last 64 publishes: more than 64 publishes between the burst's
    start and fail-static left no good one, so the bad state was published. Now the last good
    assignment itself is always kept (here with a history cap of 8)."""
    cp, clock, probes = in_memory(config(
        5, xds={"fail_static_history_max": 8, "publish": {"measure_refresh": "0s"}}, consecutive_misses=1,
        fail_static_window_ms=400))
    all_healthy(cp, clock, probes)
    # n2, n3, n4 (3 of 5: most) go silent 300 ms apart in total; n2 is ejected at +180 ms, before
    # fail-static starts (when n4's first miss is seen at +480 ms); meanwhile n0 publishes every 1 ms
    # (its GPU free memory, a measure: published at once with measure_refresh 0).
    for nid in cp.core.node_cfg:
        probes[nid].heartbeat()
    bad_publishes = []
    write = cp.core.on_publish

    def counting(p):
        if p.routing["n2"].health_status == "UNHEALTHY" and not p.held:
            bad_publishes.append(p)
        write(p)

    cp.core.on_publish = counting
    t0 = clock.now()
    last = {"n2": t0, "n3": t0 + 0.15, "n4": t0 + 0.3}
    i = 0
    while not cp.core.fail_static.active and clock.now() < t0 + 2.0:
        now = clock.now()
        probes["n0"].heartbeat(gpu_free_ratio=0.5 + 0.1 * (i % 2))
        probes["n1"].heartbeat()
        for nid, until in last.items():
            if now <= until and round((now - t0) * 1000) % 100 == 0:
                probes[nid].heartbeat()
        i += 1
        clock.advance(0.001)
    assert cp.core.fail_static.active
    assert len(bad_publishes) > 64  # n2 ejected and published that way, many times, before fail-static
    clock.advance(0.001)
    assert published(cp) == {f"n{k}": "HEALTHY" for k in range(5)}


@given(st.lists(st.tuples(st.floats(0, 100), st.integers(0, 5)), min_size=1, max_size=60),
       st.floats(0, 100), st.integers(2, 6))
@settings(max_examples=200, deadline=None)
def test_last_good_history_answers_like_an_unbounded_one_or_older_never_missing(entries, floor_frac, cap):
    """For any limit at or after every floor passed so far, the bounded history answers with the
    unbounded answer or an older recorded entry, and never with nothing when one exists."""
    entries = sorted(entries)
    h = LastGoodHistory(cap)
    full: list[tuple[float, dict]] = []
    floor = entries[0][0] * floor_frac / 100.0
    for t, v in entries:
        r = {"x": hm.Routing(v + 1, "HEALTHY")}
        h.record(t, r, floor)
        full.append((t, r))
    for limit in [floor] + [t for t, _ in full] + [t + 0.5 for t, _ in full]:
        if limit < floor:
            continue
        want = [r for t, r in full if t < limit]
        got = h.before(limit)
        if want:
            assert got is not None and any(got is r for r in want)
        else:
            assert got is None
    assert len(h) <= cap


# -- bug 2: DRAINING state metric ------------------------------------------------------------------


def test_node_state_metric_draining_is_one_while_drained():
    cp, clock, probes = in_memory(config())
    all_healthy(cp, clock, probes)
    cp.drain("n1", True, "maintenance")
    s = metric_samples(cp, "sentinel_node_state")
    assert s[(("cluster", "llm"), ("node", "n1"), ("state", "DRAINING"))] == 1.0
    assert s[(("cluster", "llm"), ("node", "n1"), ("state", "HEALTHY"))] == 0.0
    assert sum(v for k, v in s.items() if ("node", "n1") in k) == 1.0
    cp.drain("n1", False, "done")
    s = metric_samples(cp, "sentinel_node_state")
    assert s[(("cluster", "llm"), ("node", "n1"), ("state", "DRAINING"))] == 0.0
    assert s[(("cluster", "llm"), ("node", "n1"), ("state", "HEALTHY"))] == 1.0


# -- bug 3: outlier wake-up timers -------------------------------------------------------------------


def test_outlier_ejection_wake_up_is_one_timer_per_cluster_not_one_per_publish():
    cp, clock, probes = in_memory(config(4, outlier_ejection_s=30.0))
    all_healthy(cp, clock, probes)
    for _ in range(30):  # n3's TTFT far above the others': an outlier
        for nid in cp.core.node_cfg:
            probes[nid].heartbeat()
            probes[nid].probe(ttft_ms=500.0 if nid == "n3" else 20.0)
        clock.advance(0.1)
    assert published(cp)["n3"] == "UNHEALTHY" and cp.core.wake_timer_count() == 1
    pending = clock.pending()
    for i in range(200):  # 200 publishes while n3 serves its ejection
        probes["n0"].heartbeat(gpu_free_ratio=0.5 + 0.1 * (i % 2))
        for nid in ("n1", "n2", "n3"):
            probes[nid].heartbeat()
        clock.advance(0.01)
    assert cp.core.wake_timer_count() == 1
    assert clock.pending() <= pending + 1  # old code: one more call_at per publish (~200)
    for _ in range(300):  # 30 s: n3's TTFT is normal again; its ejection time runs out
        for nid in cp.core.node_cfg:
            probes[nid].heartbeat()
            probes[nid].probe(ttft_ms=20.0)
        clock.advance(0.1)
    assert published(cp)["n3"] == "HEALTHY"  # the wake-up re-published the cluster
    assert cp.core.wake_timer_count() == 0


# -- layering -----------------------------------------------------------------------------------


def _imports(pkg_root: pathlib.Path, package: str) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for f in pkg_root.rglob("*.py"):
        rel = f.relative_to(pkg_root.parent).with_suffix("")
        mod = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[mod] = {d for d in deps if d.startswith(package + ".") or d == package}
    return {m: {d for d in ds if d in graph and d != m} for m, ds in graph.items()}


def test_no_import_cycle_in_the_control_plane_and_admin_never_imports_the_server():
    root = pathlib.Path(__file__).resolve().parents[2] / "xds_server"
    g = _imports(root, "xds_server")

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            m = todo.pop()
            for d in g.get(m, ()):
                if d == b:
                    return True
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return False

    mine = [m for m in g if m.startswith(("xds_server.control", "xds_server.admin")) or m == "xds_server.server"]
    assert not reaches("xds_server.admin.app", "xds_server.server")
    assert not reaches("xds_server.admin.views", "xds_server.server")
    assert [m for m in mine if reaches(m, m)] == []


# -- the in-memory seam ---------------------------------------------------------------------------


def test_in_memory_probe_source_detects_silence_on_the_manual_clock_exactly_as_seed_000_says():
    cp, clock, probes = in_memory(config())
    all_healthy(cp, clock, probes)
    for nid in cp.core.node_cfg:
        probes[nid].heartbeat()
    t0 = clock.now()
    for _ in range(37):  # n1 and n2 keep beating every 10 ms; n0 is silent from t0
        clock.advance(0.01)
        probes["n1"].heartbeat()
        probes["n2"].heartbeat()
    clock.advance_to(t0 + 0.379)
    assert cp.health["n0"].state is hm.NodeState.HEALTHY and cp.health["n0"].heartbeat.consecutive_misses == 2
    clock.advance_to(t0 + 0.381)  # 3 misses: +180, +280, +380 ms (interval 100 ms, grace 80 ms)
    assert cp.health["n0"].state is hm.NodeState.UNHEALTHY
    assert published(cp)["n0"] == "UNHEALTHY" and cp.routing["n0"].health_status == "UNHEALTHY"
    assert [e.to_state for e in cp.events][-1] == "UNHEALTHY"


def test_steady_heartbeats_leave_the_routing_alone_and_a_queue_or_threshold_change_still_reweights():
    """The routing key is not recomputed while nothing it reads changes; a changed
    queue, and new thresholds after a reconfigure with the very same heartbeats, still re-weight."""
    cp, clock, probes = in_memory(config(2))
    all_healthy(cp, clock, probes)
    assert cp.core.routing["n0"].weight == 100
    for _ in range(5):
        probes["n0"].heartbeat(requests_waiting=0.0)
        clock.advance(0.1)
    assert cp.core.routing["n0"].weight == 100
    warn = cp.config.health.load.queue_warning
    probes["n0"].heartbeat(requests_waiting=warn + 1)
    clock.advance(0.1)
    reduced = cp.core.routing["n0"].weight
    assert reduced < 100
    raw = config(2, queue_warning=warn + 10)
    cp.core.reconfigure(parse_config(raw))
    for _ in range(3):
        probes["n0"].heartbeat(requests_waiting=warn + 1)  # the same value: only the threshold moved
        clock.advance(0.1)
    cp.core.publish()
    assert cp.core.routing["n0"].weight == 100


def test_fail_static_enters_once_misses_are_counted_rolls_back_and_ends_when_the_late_ones_heartbeat():
    """Fail-static's entry is judged once the model has counted misses for the need (more than
    fail_static_fraction of the nodes): nodes silent only by time, their Ticks late (a loaded
    loop, or held after our own stall), count from their Tick on. An ejection published before
    the entry is rolled back to the last good assignment. Nodes silent by time heartbeating
    again change no miss count; fail-static must still be re-checked, or it stays on and keeps
    a really dead node (n2 here) routed for as long as it is dead."""
    cp, clock, probes = in_memory(config(5))
    all_healthy(cp, clock, probes)
    for nid in cp.core.node_cfg:
        probes[nid].heartbeat()
    probes["n3"]._cancel()  # their Ticks are late: silent by time, no miss counted yet
    probes["n4"]._cancel()
    t0 = clock.now()
    while cp.health["n2"].state is not hm.NodeState.UNHEALTHY and clock.now() < t0 + 1.0:
        clock.advance(0.01)
        probes["n0"].heartbeat()
        probes["n1"].heartbeat()
    cp.core.publish()
    assert not cp.core.fail_static.active  # one counted miss of 5 (n2): n3 and n4 not counted yet
    assert published(cp)["n2"] == "UNHEALTHY"
    assert cp.health["n3"].heartbeat.consecutive_misses == 0
    probes["n3"].emit(hm.Tick())  # the late Ticks run: 3 of 5 counted, silent within the window
    probes["n4"].emit(hm.Tick())
    assert cp.core.fail_static.active and cp.core._counted_silent.nodes() == {"n2", "n3", "n4"}
    cp.core.publish()
    assert published(cp)["n2"] == "HEALTHY"  # the last good assignment, from before the burst
    t1 = clock.now()
    while clock.now() < t1 + 1.0:  # n3 and n4 are back; n2 stays dead
        clock.advance(0.05)
        for nid in ("n0", "n1", "n3", "n4"):
            probes[nid].heartbeat()
    assert not cp.core.fail_static.active
    assert cp.health["n2"].state is hm.NodeState.UNHEALTHY
    assert published(cp)["n2"] == "UNHEALTHY"
    assert cp.core._counted_silent.nodes() == {n for n, nh in cp.health.items() if counted_silent(nh)} == {"n2"}


def test_fail_static_ends_when_nodes_silent_only_by_time_heartbeat_again():
    """Active, with fewer misses counted than the need and the rest silent by time only (n1: its
    Tick late): n1 heartbeating again changes no miss count, yet must end the episode."""
    cp, clock, probes = in_memory(config(5))
    all_healthy(cp, clock, probes)
    for nid in cp.core.node_cfg:
        probes[nid].heartbeat()
    t0 = clock.now()
    while not cp.core.fail_static.active and clock.now() < t0 + 0.5:  # n2, n3, n4 silent
        clock.advance(0.01)
        probes["n0"].heartbeat()
        probes["n1"].heartbeat()
    assert cp.core.fail_static.active
    probes["n1"]._cancel()  # n1 goes silent too, its Tick late
    clock.advance(0.25)
    probes["n0"].heartbeat()
    probes["n2"].heartbeat()  # counted: n3, n4 (2 of 5, below the need); by time also n1: still on
    assert cp.core.fail_static.active and cp.health["n1"].heartbeat.consecutive_misses == 0
    probes["n1"].heartbeat()
    assert not cp.core.fail_static.active


_LANE_ACTIONS = st.lists(st.tuples(
    st.sampled_from(["n0", "n1", "n2"]),
    st.sampled_from(["hb"] * 6 + ["hb_waiting", "hb_gpu", "hb_warming", "probe", "probe_slow", "probe_fail",
                                  "close"]),
    st.sampled_from([0.0, 0.03, 0.1, 0.1, 0.25, 0.6])), max_size=120)


def _run_lane(actions, lane: bool) -> tuple:
    """Run ``actions`` on an in-memory control plane (the steady lane on or off); what it ended with."""
    cp, clock, probes = in_memory(config(3, failure_detector="phi", probation_clean_s=0.5,
                                         ramp_start_percent=50.0, ramp_step_s=0.2))
    if not lane:
        cp.core._steady_lane = False
    returned, runs_open = [], 0
    for nid, what, dt in actions:
        clock.advance(dt)
        p = probes[nid]
        if what.startswith("hb"):
            fields = {"hb_waiting": {"requests_waiting": 60.0}, "hb_gpu": {"gpu_free_ratio": 0.01},
                      "hb_warming": {"engine_state": "WARMING"}}.get(what, {})
            returned.append(p.heartbeat(**fields))
        elif what.startswith("probe"):
            returned.append(p.probe(ttft_ms=5_000.0 if what == "probe_slow" else 20.0,
                                    kind=hm.ProbeResultKind.TIMEOUT if what == "probe_fail" else hm.ProbeResultKind.OK))
        else:
            returned.append(p.close())
        runs_open += len(cp.core.health.runs)
        returned.append((dict(cp.core._keys), sorted(cp.core.planner.dirty)))
    clock.advance(1.0)
    events = [(e.node_id, e.kind, e.reason, e.from_state, e.to_state) for e in cp.core.events]
    shown = published(cp) if "llm" in cp.cache.resources(CLA_TYPE_URL) else None
    return (dict(cp.health), dict(cp.core.routing), returned, events, shown,
            dict(cp.core.counters.heartbeats), (cp.core.steady_beats, runs_open) if lane else None)


@settings(max_examples=60, deadline=None)
@given(_LANE_ACTIONS)
def test_the_steady_heartbeat_lane_decides_as_the_full_observe(actions):
    """ControlCore.observe's steady lane (quiet heartbeat of a node heard last time: no state,
    miss or ramp change, only the routing key checked) ends with the same health, routing,
    returned Tick deadlines, events and published assignment as the full path."""
    with_lane, without = _run_lane(actions, lane=True), _run_lane(actions, lane=False)
    assert with_lane[:-1] == without[:-1]


def test_the_steady_lane_takes_the_heartbeats_of_a_steady_fleet():
    actions = [(f"n{i}", "probe" if k % 5 == 0 else "hb", 0.1 if i == 0 else 0.0) for k in range(60) for i in range(3)]
    with_lane, without = _run_lane(actions, lane=True), _run_lane(actions, lane=False)
    assert with_lane[:-1] == without[:-1]
    steady, runs_open = with_lane[-1]
    assert steady > 60  # most of the 144 heartbeats (the rest: warm-up, ramp steps due, clean-period runs)
    assert runs_open > 50  # and the steady nodes' heartbeats were folded in place between probes


def test_the_health_table_settles_a_folded_run_on_every_read_and_a_write_ends_it():
    """Readers never see a record older than the heartbeats folded in place: item, get, values,
    items and dict() all settle the run; a write or a delete ends it."""
    from xds_server.control.node_table import HealthTable
    from xds_server.health.beats import BeatRun

    cfg = parse_config(config(1)).health
    hb = hm.HeartbeatObserved(engine_state="READY")
    nh = hm.initial("n0", 0.0)
    for k in range(1, 4):
        nh, _ = hm.step(nh, hb, k * 0.1, cfg)
    for reader in (lambda t: t["n0"], lambda t: t.get("n0"), lambda t: next(iter(t.values())),
                   lambda t: dict(t.items())["n0"], lambda t: dict(t)["n0"]):
        table = HealthTable()
        table["n0"] = nh
        table.runs["n0"] = run = BeatRun.start(nh, hb, cfg)
        ref = nh
        for k in range(4, 7):
            run.fold(hb, k * 0.1, cfg)
            ref, _ = hm.step(ref, hb, k * 0.1, cfg)
        assert "n0" in table and len(table) == 1 and list(table) == ["n0"]
        assert reader(table) == ref and ref.heartbeat.last_s == pytest.approx(0.6) and not table.runs
    table = HealthTable()
    table["n0"] = nh
    table.runs["n0"] = BeatRun.start(nh, hb, cfg)
    table["n0"] = hm.initial("n0", 9.0)
    assert not table.runs and table["n0"].since_s == 9.0
    table.runs["n0"] = BeatRun.start(nh, hb, cfg)
    del table["n0"]
    assert not table.runs and "n0" not in table and table.get("n0") is None
