"""Request classes (lrs.shed.classes) and KV usage in overload shedding: the pure allocation
(xds_server.policy.request_classes, hypothesis), KV-cache usage as a saturation input that fails open, the
class clusters' names, wire copies, LRS aggregation and bootstrap routes."""
from __future__ import annotations

import math
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from xds_server.config import ClusterConfig, NodeConfig, SentinelConfig, ShedClassesConfig, ShedConfig, class_clusters
from xds_server.config.duration import Duration
from xds_server.envoy.bootstrap import ControlPlaneGroup, find_envoy, render_bootstrap, write_bootstrap
from xds_server.health.records import Probes
from xds_server.load.aggregate import ClusterReport, Counts, EndpointReport, LoadAggregator, LocalityReport, Report
from xds_server.load.shedder import class_aliases
from xds_server.policy.overload_drop import ShedInputs, ShedState, shed_step
from xds_server.policy.request_classes import allocate, class_percents

ratio = st.floats(0, 1)
demand = st.one_of(st.floats(0, 1e6), st.just(0.0))


@given(ratio, st.lists(demand, min_size=1, max_size=4), st.lists(ratio, min_size=1, max_size=4))
def test_lower_classes_are_shed_first_and_the_total_is_the_commanded_excess(excess, demands, maxima):
    maxima = (maxima * 4)[:len(demands)]
    out = allocate(excess, demands, maxima)
    assert len(out) == len(demands) and all(0.0 <= r <= m + 1e-12 for r, m in zip(out, maxima, strict=True))
    dropped = sum(r * d for r, d in zip(out, demands, strict=True))
    possible = min(excess * sum(demands), sum(m * d for m, d in zip(maxima, demands, strict=True)))
    assert math.isclose(dropped, possible, rel_tol=1e-9, abs_tol=1e-6)  # the commanded excess when possible
    for hi in range(len(out)):
        if out[hi] > 0:  # a higher class is shed only once every lower one with demand is at its maximum
            assert all(d == 0 or math.isclose(out[lo], maxima[lo], rel_tol=1e-9) for lo, d in
                       enumerate(demands[:hi]))


def test_allocation_examples_and_bad_input():
    # 30 % of 200 = 60 requests: sheddable (100 demand) takes them all -> 60 %
    assert allocate(0.3, [100, 50, 50], [1, 1, 1]) == pytest.approx([0.6, 0, 0])
    # 70 % of 200 = 140: sheddable 100 (all), standard 40 of 50, critical none
    assert allocate(0.7, [100, 50, 50], [1, 1, 1]) == pytest.approx([1.0, 0.8, 0])
    # sheddable capped at 50 %: 50 from it, 50 from standard, 40 from critical
    assert allocate(0.7, [100, 50, 50], [0.5, 1, 1]) == pytest.approx([0.5, 1.0, 0.8])
    assert allocate(0.5, [0, 100, 0], [1, 1, 1]) == pytest.approx([0, 0.5, 0])  # no sheddable traffic
    assert allocate(math.nan, [math.inf, -5, 10], [math.nan, 2, 1]) == [0.0, 0.0, 0.0]
    # percents: rounded to the step, a class at its maximum keeps it exactly
    assert class_percents(30, [100, 50, 50], [100, 100, 100], 5) == [60, 0, 0]
    assert class_percents(70, [100, 50, 50], [97, 100, 100], 5) == [97, 85, 0]


@given(ratio, st.lists(st.integers(0, 1000), min_size=3, max_size=3), st.lists(st.sampled_from([0.0, 5.0, 35.0, 40.0,
       100.0]), min_size=3, max_size=3))
def test_class_shares_stay_within_a_step_of_the_exact_ones_and_keep_what_is_published_near_it(excess, demands, held):
    exact = [100 * r for r in allocate(excess, demands, [1, 1, 1])]
    out = class_percents(100 * excess, demands, [100, 100, 100], 5, held)
    for e, o, h in zip(exact, out, held, strict=True):
        assert abs(o - e) < 5 + 1e-9 and (e > 0 or o == 0) and (e < 100 - 1e-9 or o == 100)
        if 0 < e < 100 - 1e-9 and 0 < h and abs(e - h) < 5:
            assert o == h  # held: no new assignment for noise


def _inp(waiting, kv, age=0.5):
    return ShedInputs(list(waiting), [age] * len(waiting), 100.0, 100.0, 2, kv)


def test_kv_usage_over_the_ratio_counts_as_a_queue_over_warning_and_fails_open():
    cfg = ShedConfig(enabled=True, kv_saturated_ratio=0.95)
    s = shed_step(ShedState(), _inp([0, 0], [0.97, 0.99]), cfg, 50, 100, 0.0)
    assert s.percent == 10.0 and "2 node(s) with KV usage > 0.95" in s.reason  # the headroom, 2 steps
    assert shed_step(ShedState(), _inp([0, 0], [0.97, 0.5]), cfg, 50, 100, 0.0).percent == 0  # mean 25.5
    assert shed_step(ShedState(), _inp([60, 0], [None, 0.96]), cfg, 50, 100, 0.0).percent > 0  # (60 + 51) / 2
    # unknown, NaN or at the ratio: adds nothing
    assert shed_step(ShedState(), _inp([0, 0], [None, math.nan]), cfg, 50, 100, 0.0).percent == 0
    assert shed_step(ShedState(), _inp([0, 0], [0.95, 0.95]), cfg, 50, 100, 0.0).percent == 0
    # stale heartbeats (the KV reading is as old): fail open, whatever the KV says
    stale = shed_step(ShedState(40.0), _inp([0, 0], [1.0, 1.0], age=9.0), cfg, 50, 100, 0.0)
    assert stale.percent == 0 and stale.reason.startswith("fail open")
    # shedding for KV stays on while the nodes stay full (mean 51 > off_ratio x 50)
    assert shed_step(s, _inp([0, 0], [0.97, 0.99]), cfg, 50, 100, 10.0).percent == 10.0


@given(st.lists(st.tuples(st.one_of(st.none(), st.floats(0, 500)), st.one_of(st.none(), st.floats(allow_nan=True)),
                          st.one_of(st.none(), st.floats(0, 10))), min_size=1, max_size=5))
def test_stale_or_missing_queue_telemetry_never_sheds_whatever_the_kv(nodes):
    cfg = ShedConfig(enabled=True)
    waiting, kv, ages = zip(*nodes, strict=True)
    s = shed_step(ShedState(30.0), ShedInputs(waiting, ages, 100.0, 50.0, 1, kv), cfg, 50, 100, 0.0)
    if any(w is None for w in waiting) or any(a is None or a > cfg.stale_after.s for a in ages):
        assert s.percent == 0.0 and s.reason.startswith("fail open")
    assert 0 <= s.percent <= cfg.max_percent


def _config(**classes) -> SentinelConfig:
    node = NodeConfig(id="gpu-a", address="127.0.0.1:9001", probe_address="127.0.0.1:9101")
    return SentinelConfig(clusters=[ClusterConfig(name="llm", nodes=[node])],
                          lrs={"shed": {"enabled": True, "classes": classes}})


def test_class_clusters_are_named_apart_and_published_as_copies():
    on = _config(enabled=True)
    assert list(class_clusters(on.clusters, on.lrs.shed.classes)) == ["llm", "llm~sheddable", "llm~critical"]
    assert class_aliases(on) == {"llm~sheddable": "llm", "llm~critical": "llm"}
    off = _config()  # off by default: nothing more is published (the publisher: test_envoy_publisher.py)
    assert list(class_clusters(off.clusters, off.lrs.shed.classes)) == ["llm"] and class_aliases(off) == {}
    with pytest.raises(ValidationError, match="must differ"):
        ShedClassesConfig(sheddable="batch", critical="batch")
    with pytest.raises(ValidationError, match="header"):
        ShedClassesConfig(header="X Bad")
    with pytest.raises(ValidationError):  # no separator or dot: a class cluster name stays unique
        ShedClassesConfig(critical="a~b")


def test_lrs_reports_of_class_clusters_count_for_the_parent_and_keep_their_own_demand():
    agg = LoadAggregator({"llm": {("127.0.0.1", 9001): "gpu-a"}}, interval_s=1.0, min_gap_s=0.0)
    agg.set_nodes({"llm": {("127.0.0.1", 9001): "gpu-a"}}, {"llm~sheddable": "llm", "llm~critical": "llm"})

    def cr(name: str, issued: int, dropped: int) -> ClusterReport:
        c = Counts(issued, issued, 0, 0)
        return ClusterReport(name, 1.0, (LocalityReport(("", "", ""), 0, c, (EndpointReport("127.0.0.1", 9001, c),)),),
                             dropped, (("overload", dropped),) if dropped else ())

    assert agg.ingest(Report("envoy-1", 1, (cr("llm", 5, 0), cr("llm~sheddable", 3, 7), cr("llm~critical", 2, 0))),
                      10.2) == []
    node = agg.node("llm", "gpu-a", 10.5, 3.0)
    assert (node.issued, node.succeeded) == (10, 10)  # fleet-wide ejection and the views see every class
    assert agg.cluster("llm", 10.5, 3.0).dropped == 7 and agg.drops("llm", 10.5, 3.0) == {"": 7, "overload": 7}
    demand = {n: (t.issued, t.dropped) for n in ("llm", "llm~sheddable", "llm~critical")
              for t in [agg.demand(n, 10.5, 3.0)]}
    assert demand == {"llm": (5, 0), "llm~sheddable": (3, 7), "llm~critical": (2, 0)}
    assert agg.parent_of("llm~critical") == "llm" and agg.parent_of("other") == "other"
    agg.set_nodes({"llm": {("127.0.0.1", 9001): "gpu-a"}})  # classes turned off: class reports are unknown
    assert agg.ingest(Report("envoy-1", 1, (cr("llm~sheddable", 1, 0),)), 11.2) == ["unknown_cluster"]


def test_bootstrap_routes_each_class_to_its_cluster(tmp_path):
    doc = render_bootstrap(xds_port=18001, listener_port=10001, admin_port=9902,
                           classes=ShedClassesConfig(enabled=True, header="x-prio", sheddable="batch"))
    routes = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"]
    assert [(r["match"].get("headers"), r["route"]["cluster"]) for r in routes] == [
        ([{"name": "x-prio", "string_match": {"exact": "batch"}}], "llm~batch"),
        ([{"name": "x-prio", "string_match": {"exact": "critical"}}], "llm~critical"),
        (None, "llm")]
    assert routes[0]["route"]["retry_policy"] == routes[2]["route"]["retry_policy"]
    path = write_bootstrap(tmp_path / "classes.yaml", doc)
    r = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    plain = render_bootstrap(xds_port=18001, listener_port=10001, admin_port=9902, classes=ShedClassesConfig())
    assert plain == render_bootstrap(xds_port=18001, listener_port=10001, admin_port=9902)  # off: unchanged
    c = ClusterConfig(name="a", nodes=[NodeConfig(id="n1", address="127.0.0.1:9001", probe_address="127.0.0.1:9101")])
    with pytest.raises(ValueError, match="config says whether it routes request classes"):
        render_bootstrap(listener_port=1, admin_port=2, groups=[ControlPlaneGroup("g", ("127.0.0.1:1",), (c,))],
                         classes=ShedClassesConfig(enabled=True))


def test_shedder_spreads_the_drop_over_the_classes_and_flips_each_changed_assignment():
    from types import SimpleNamespace

    from xds_server.load.shedder import Shedder
    cfg = _config(enabled=True)
    cfg = cfg.model_copy(update={"lrs": cfg.lrs.model_copy(update={"shed": cfg.lrs.shed.model_copy(
        update={"window": Duration.parse("2s")})})})
    node = SimpleNamespace(heartbeat=SimpleNamespace(last_s=9.9), engine=SimpleNamespace(requests_waiting=70.0,
                                                                                requests_running=None, stalled=False),
                           probe=Probes())
    dirty: list[str] = []
    core = SimpleNamespace(routing={"gpu-a": SimpleNamespace(health_status="HEALTHY")}, health={"gpu-a": node},
                           mark_dirty=dirty.append)
    agg = LoadAggregator({"llm": {("127.0.0.1", 9001): "gpu-a"}}, interval_s=1.0, min_gap_s=0.0)
    agg.set_nodes({"llm": {("127.0.0.1", 9001): "gpu-a"}}, class_aliases(cfg))

    def cr(name: str, issued: int) -> ClusterReport:
        c = Counts(issued, issued, 0, 0)
        return ClusterReport(name, 1.0, (LocalityReport(("", "", ""), 0, c, (EndpointReport("127.0.0.1", 9001, c),)),))

    agg.ingest(Report("envoy-1", 1, (cr("llm", 20), cr("llm~sheddable", 60), cr("llm~critical", 20))), 9.5)
    s = Shedder()
    s.step(cfg, core, agg, "llm", ["gpu-a"], 10.0)  # mean 70 > 50: the 10 % headroom of 100 -> 10 from sheddable
    assert s.shed["llm"].percent == 10.0 and dirty == ["llm"]
    assert s.cla_args("llm~sheddable") == {"shed_percent": 15.0, "shed_flip": True}  # 10 of 60, to 5 % steps
    assert s.cla_args("llm") == {"shed_percent": 0.0, "shed_flip": False}
    assert s.cla_args("llm~critical")["shed_percent"] == 0.0
    view = s.view(cfg, "llm")
    # what the drop was computed from: the window's LRS completions per routable node, and its source
    assert view["shed_capacity"] == {"rps_per_routable_node": 50.0, "headroom": 0.1,
                                     "source": "LRS completions measured with a queue over the budget"}
    assert view["shed_classes"] == {"sheddable": {"cluster": "llm~sheddable", "shed_percent": 15.0},
                                    "standard": {"cluster": "llm", "shed_percent": 0.0},
                                    "critical": {"cluster": "llm~critical", "shed_percent": 0.0}}
    metric = next(iter(s.metric_families(cfg)))
    assert {tuple(x.labels.values()): x.value for x in metric.samples} == {
        ("llm", "total"): 0.1, ("llm", "sheddable"): 0.15, ("llm", "standard"): 0.0, ("llm", "critical"): 0.0}
    s.step(cfg, core, agg, "llm", ["gpu-a"], 10.2)  # nothing changed: no new assignment
    assert dirty == ["llm"] and s.cla_args("llm~sheddable")["shed_flip"] is True
    node.heartbeat.last_s = 0.0  # stale telemetry: fail open, every class lifted at once
    s.step(cfg, core, agg, "llm", ["gpu-a"], 10.4)
    assert dirty == ["llm", "llm"] and s.cla_args("llm~sheddable") == {"shed_percent": 0.0, "shed_flip": False}


def test_envoy_bootstrap_command_routes_the_classes_of_a_config(tmp_path):
    import sys

    import yaml
    cfg = tmp_path / "xds.yaml"
    cfg.write_text(yaml.safe_dump({"clusters": [{"name": "llm", "nodes": [
        {"id": "gpu-a", "address": "127.0.0.1:9001", "probe_address": "127.0.0.1:9101"}]}],
        "lrs": {"shed": {"classes": {"header": "x-prio", "critical": "gold"}}}}))

    def routes(*args: str) -> list[tuple[str | None, str]]:
        r = subprocess.run([sys.executable, "-m", "xds_server.cli", "envoy-bootstrap", *args], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        hcm = yaml.safe_load(r.stdout)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        return [(m["headers"][0]["string_match"]["exact"] if "headers" in (m := x["match"]) else None,
                 x["route"]["cluster"]) for x in hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]]

    assert routes("--classes", str(cfg)) == [("sheddable", "llm~sheddable"), ("gold", "llm~gold"), (None, "llm")]
    assert routes("--classes") == [("sheddable", "llm~sheddable"), ("critical", "llm~critical"), (None, "llm")]
    assert routes() == [(None, "llm")]
    bad = subprocess.run([sys.executable, "-m", "xds_server.cli", "envoy-bootstrap", "--classes", str(tmp_path / "no")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--classes" in bad.stderr


def test_shedder_measures_completions_where_the_queue_is_not_at_envoys_headers():
    # LRS says every request completed (headers came back); the engines' own in-flight count grows
    # by 4 per s, so they complete 20 - 4 = 16 of the 20 rps sent: the entry drop follows 16, not 20
    from types import SimpleNamespace

    from xds_server.load.shedder import Shedder
    cfg = _config(enabled=True)
    cfg = cfg.model_copy(update={"lrs": cfg.lrs.model_copy(update={"shed": cfg.lrs.shed.model_copy(
        update={"window": Duration.parse("2s")})})})
    engines = {n: SimpleNamespace(requests_waiting=0.0, requests_running=2.0, stalled=False)
               for n in ("gpu-a", "gpu-b")}
    core = SimpleNamespace(routing={n: SimpleNamespace(health_status="HEALTHY") for n in engines},
                           health={n: SimpleNamespace(heartbeat=SimpleNamespace(last_s=0.0), engine=e, probe=Probes())
                                   for n, e in engines.items()}, mark_dirty=lambda _c: None)
    addrs = {("127.0.0.1", 9001): "gpu-a", ("127.0.0.1", 9002): "gpu-b"}
    agg = LoadAggregator({"llm": addrs}, interval_s=1.0, min_gap_s=0.0)
    s = Shedder()
    for k in range(8):  # 10 rps to each node; from k=2 on both complete 8: each queue grows by 2 per s
        now = 10.5 + k  # evaluated at each report, as the service does
        c = Counts(10, 10, 0, 0)
        loc = LocalityReport(("", "", ""), 0, Counts(20, 20, 0, 0),
                             (EndpointReport("127.0.0.1", 9001, c), EndpointReport("127.0.0.1", 9002, c)))
        agg.ingest(Report("envoy-1", 1, (ClusterReport("llm", 1.0, (loc,)),)), now)
        for n, e in engines.items():
            e.requests_waiting = 2.0 * max(0, k - 2)
            core.health[n].heartbeat.last_s = now - 0.1
        s.step(cfg, core, agg, "llm", list(engines), now)
        if s.shed["llm"].percent > 0:
            break
    st_ = s.shed["llm"]
    # k=4: 4 waiting at 8 rps each = 0.5 s (not over the budget), k=5: 6 / 8 = 0.75 s
    assert k == 5 and st_.percent == 30.0, st_.reason  # 1 - 16 x 0.9 / 20 = 28 % -> 30
    assert "completed 16.0 rps" in st_.reason and "queue waits ~0.75 s (6 waiting)" in st_.reason
    engines["gpu-b"].requests_running = None  # unknown in-flight: back to LRS's completions for the rate
    s.step(cfg, core, agg, "llm", list(engines), now + 0.1)
    assert "completed 20.0 rps" in s.shed["llm"].reason
    engines["gpu-b"].requests_running = 2.0
    engines["gpu-a"].stalled, engines["gpu-a"].requests_waiting = True, 500.0  # being ejected: no overload
    s.step(cfg, core, agg, "llm", list(engines), now + 0.2)
    assert "gpu-a" not in s.shed["llm"].reason and "mean waiting 6;" in s.shed["llm"].reason  # gpu-b alone
