"""The pure LRS aggregation (xds_server.load.aggregate) and report decoding (xds_server.load.report):
sums across Envoys, sliding windows, Envoy's quirks, and bad input never applied (hypothesis)."""
from __future__ import annotations

import math

import pytest
from envoy.config.endpoint.v3 import load_report_pb2
from envoy.service.load_stats.v3 import lrs_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xds_server.config import ConfigError, parse_config
from xds_server.load.aggregate import ClusterReport, Counts, EndpointReport, LoadAggregator, LocalityReport, Report
from xds_server.load.report import ReportRefused, decode_report, decode_request

NODES = {"llm": {("127.0.0.1", 9001): "gpu-a", ("127.0.0.1", 9002): "gpu-b", ("127.0.0.1", 9003): "gpu-c"}}
PORTS = {"gpu-a": 9001, "gpu-b": 9002, "gpu-c": 9003}


def report(reporter: str, per_node: dict[str, Counts], *, cluster: str = "llm", stream: int = 1,
           interval_s: float | None = 1.0, dropped: int = 0) -> Report:
    eps = tuple(EndpointReport("127.0.0.1", PORTS.get(n, 9999), c) for n, c in per_node.items())
    loc = Counts(sum(c.issued for c in per_node.values()), sum(c.succeeded for c in per_node.values()),
                 sum(c.errored for c in per_node.values()), sum(c.in_progress for c in per_node.values()))
    locs = (LocalityReport(("r", "z", ""), 0, loc, eps),) if per_node else ()
    return Report(reporter, stream, (ClusterReport(cluster, interval_s, locs, dropped,
                                                   (("capacity_lost", dropped),) if dropped else ()),))


counts = st.builds(Counts, st.integers(0, 500), st.integers(0, 500), st.integers(0, 500), st.integers(0, 50))


@given(st.lists(st.tuples(st.sampled_from(["envoy-1", "envoy-2", "envoy-3"]),
                          st.dictionaries(st.sampled_from(["gpu-a", "gpu-b", "gpu-c"]), counts, max_size=3)),
                min_size=1, max_size=40))
def test_sums_across_envoys_equal_what_was_reported(reports):
    agg = LoadAggregator(NODES, interval_s=1.0, retain_s=1000.0, min_gap_s=0.5)
    want: dict[str, list[int]] = {n: [0, 0, 0] for n in PORTS}
    now = 0.0
    for reporter, per_node in reports:
        now += 0.4  # three Envoys interleaved; each reports at most once a second
        agg.ingest(report(reporter, per_node, stream=hash(reporter) % 7), now)
        now += 0.4
    # recompute what was accepted: a stream's report within 0.5 s of its previous one is a flood
    agg2 = LoadAggregator(NODES, interval_s=1.0, retain_s=1000.0, min_gap_s=0.5)
    now = 0.0
    for reporter, per_node in reports:
        now += 0.4
        if not agg2.ingest(report(reporter, per_node, stream=hash(reporter) % 7), now):
            for n, c in per_node.items():
                want[n][0] += c.issued
                want[n][1] += c.succeeded
                want[n][2] += c.errored
        now += 0.4
    for n in PORTS:
        t = agg.node("llm", n, now, 1000.0)
        assert [t.issued, t.succeeded, t.errored] == want[n]
        tot = agg.totals.get(("llm", n), Counts())
        assert [tot.issued, tot.succeeded, tot.errored] == want[n]
    c = agg.cluster("llm", now, 1000.0)
    assert c.issued == sum(w[0] for w in want.values())


@given(st.lists(st.tuples(st.sampled_from(["envoy-1", "envoy-2", "envoy-3"]),
                          st.dictionaries(st.sampled_from(["gpu-a", "gpu-b"]), counts, max_size=2)),
                min_size=1, max_size=30), st.floats(1.0, 30.0))
def test_failing_reporters_are_those_that_reported_errors_within_the_window(reports, window_s):
    agg = LoadAggregator(NODES, interval_s=1.0, retain_s=1000.0, min_gap_s=0.0)
    seen: list[tuple[float, str, str]] = []  # (when, reporter, node) of each report with errors
    now = 0.0
    for reporter, per_node in reports:
        now += 0.7
        assert agg.ingest(report(reporter, per_node), now) == []
        seen += [(now, reporter, n) for n, c in per_node.items() if c.errored]
    first = int((now - window_s) // 1.0) + 1  # the window's first slot, as the aggregator counts it
    for n in ("gpu-a", "gpu-b"):
        want = tuple(sorted({r for at, r, node in seen if node == n and int(at // 1.0) >= first}))
        assert agg.node("llm", n, now, window_s).failing == want


def test_window_slides_and_in_progress_is_a_gauge_per_envoy():
    agg = LoadAggregator(NODES, interval_s=1.0, retain_s=30.0, stale_after_s=3.0)
    agg.ingest(report("e1", {"gpu-a": Counts(10, 9, 1, 4)}), 1.0)
    agg.ingest(report("e2", {"gpu-a": Counts(5, 5, 0, 2)}), 1.2)
    agg.ingest(report("e1", {"gpu-a": Counts(10, 10, 0, 3)}), 2.0)
    t = agg.node("llm", "gpu-a", 2.0, 10.0)
    assert (t.issued, t.succeeded, t.errored, t.reporters) == (25, 24, 1, 2)
    assert t.in_progress == 3 + 2  # latest per Envoy, never summed over intervals
    assert t.success_ratio == pytest.approx(24 / 25)
    # e1 reports again without gpu-a: a node missing from a report had nothing open from it
    agg.ingest(report("e1", {"gpu-b": Counts(1, 1, 0, 0)}), 3.0)
    assert agg.node("llm", "gpu-a", 3.0, 10.0).in_progress == 2
    # e2 goes silent: its gauge stops counting after stale_after_s
    assert agg.node("llm", "gpu-a", 4.5, 10.0).in_progress == 0
    # 1.5 s window at t=3: only the slots of t=2 and t=3
    assert agg.node("llm", "gpu-a", 3.0, 1.5).issued == 10
    # beyond retain_s everything ages out
    agg.prune(100.0)
    assert agg.slot_count() == 0 and agg.node("llm", "gpu-a", 100.0, 30.0).issued == 0


@given(st.floats(0.0, 20.0), st.floats(0.0, 20.0), st.floats(0.1, 100.0))
def test_a_read_never_sees_figures_past_retain_before_or_after_a_report_prunes_them(at_s, later_s, window_s):
    """Reads and prune agree on what is kept: a window wider than ``retain_s`` read before the
    next report (which prunes) sums what that report leaves, never slots it drops."""
    agg = LoadAggregator(NODES, interval_s=1.0, retain_s=5.0, min_gap_s=0.5)
    agg.ingest(report("e1", {"gpu-a": Counts(4, 3, 1, 0)}), at_s)
    now = at_s + later_s
    before = agg.node("llm", "gpu-a", now, window_s)
    before_cluster = agg.cluster("llm", now, window_s)
    agg.prune(now)
    after = agg.node("llm", "gpu-a", now, window_s)
    assert (before.issued, before.errored, before.reporters) == (after.issued, after.errored, after.reporters)
    assert before_cluster.reporters == agg.cluster("llm", now, window_s).reporters
    if later_s < 5.0 and window_s >= later_s + 1.0:  # its slot is within both the window and retain_s
        assert before.issued == 4
    if later_s >= 6.0:  # a whole retain_s and a slot past it: gone, whatever the window
        assert (before.issued, before.reporters) == (0, 0)


def test_drops_are_cluster_level_and_counted_per_category():
    agg = LoadAggregator(NODES)
    agg.ingest(report("e1", {"gpu-a": Counts(4, 4, 0, 0)}, dropped=6), 1.0)
    agg.ingest(report("e2", {}, dropped=3), 1.1)
    assert agg.cluster("llm", 1.1, 10.0).dropped == 9
    assert agg.drops("llm", 1.1, 10.0) == {"": 9, "capacity_lost": 9}
    assert agg.node("llm", "gpu-a", 1.1, 10.0).dropped == 0


def test_bad_entries_are_counted_and_never_applied():
    agg = LoadAggregator(NODES, max_count=1000)
    assert agg.ingest(report("e1", {"gpu-a": Counts(1, 1, 0, 0)}, cluster="nope"), 1.0) == ["unknown_cluster"]
    assert agg.ingest(report("e1", {"gpu-a": Counts(10**6, 0, 0, 0)}, stream=2), 1.0) == ["absurd_count"]
    assert agg.ingest(report("e1", {"gpu-a": Counts(1, 1, 0, 0)}, stream=3, interval_s=math.nan), 1.0) \
        == ["bad_interval"]
    assert agg.ingest(report("e1", {"gpu-x": Counts(1, 1, 0, 0)}, stream=4), 1.0) == ["unknown_endpoint"]
    assert agg.ingest(report("e1", {"gpu-a": Counts(1, 1, 0, 0)}, cluster="xds_cluster", stream=5), 1.0) == []
    assert agg.ignored_clusters == 1
    assert agg.node("llm", "gpu-a", 1.0, 10.0).issued == 0
    # a flood: a second report on one stream within min_gap_s
    assert agg.ingest(report("e1", {"gpu-a": Counts(2, 2, 0, 0)}, stream=9), 2.0) == []
    assert agg.ingest(report("e1", {"gpu-a": Counts(2, 2, 0, 0)}, stream=9), 2.1) == ["flood"]
    assert agg.node("llm", "gpu-a", 2.1, 10.0).issued == 2
    assert dict(agg.problems) == {"unknown_cluster": 1, "absurd_count": 1, "bad_interval": 1,
                                  "unknown_endpoint": 1, "flood": 1}


def _request(draw_clusters) -> lrs_pb2.LoadStatsRequest:
    req = lrs_pb2.LoadStatsRequest()
    req.node.id = "envoy-1"
    for name, interval, locs, dropped in draw_clusters:
        cs = req.cluster_stats.add(cluster_name=name, total_dropped_requests=dropped)
        if interval is not None:
            cs.load_report_interval.FromNanoseconds(interval)
        cs.dropped_requests.add(category="c" + name[:3], dropped_count=dropped)
        for port, issued, ok, err, inprog, metric in locs:
            loc = cs.upstream_locality_stats.add(total_issued_requests=issued, total_successful_requests=ok,
                                                 total_error_requests=err, total_requests_in_progress=inprog)
            ep = loc.upstream_endpoint_stats.add(total_issued_requests=issued, total_successful_requests=ok,
                                                 total_error_requests=err, total_requests_in_progress=inprog)
            ep.address.socket_address.address = "127.0.0.1"
            ep.address.socket_address.port_value = port
            ep.load_metric_stats.add(metric_name="x", num_requests_finished_with_metric=1, total_metric_value=metric)
    return req


u64 = st.integers(0, 2**64 - 1)
clusters_st = st.lists(st.tuples(
    st.sampled_from(["llm", "other", "xds_cluster", ""]),
    st.one_of(st.none(), st.integers(-10**12, 10**13)),
    st.lists(st.tuples(st.sampled_from([9001, 9002, 9003, 1, 65535]), u64, u64, u64, u64,
                       st.floats(allow_nan=True, allow_infinity=True)), max_size=4),
    u64), max_size=6)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=150)
@given(st.lists(clusters_st, min_size=1, max_size=8))
def test_hostile_reports_never_crash_and_stay_bounded(batches):
    agg = LoadAggregator(NODES, interval_s=1.0, retain_s=5.0, max_count=10_000_000)
    now = 0.0
    for clusters in batches:
        raw = _request(clusters).SerializeToString()
        try:
            rep = decode_report(decode_request(raw), "envoy-1", 1, max_clusters=4, max_endpoints=12)
        except ReportRefused as e:
            assert e.reason == "too_large"
            continue
        now += 1.0
        before = dict(agg.totals)
        found = agg.ingest(rep, now)
        for k, v in agg.totals.items():  # whatever was applied passed the count bound
            b = before.get(k, Counts())
            assert 0 <= v.issued - b.issued <= 10_000_000 * 4
        assert set(found) <= {"unknown_cluster", "absurd_count", "bad_interval", "unknown_endpoint",
                              "too_many_categories"}
    # memory: 3 nodes + localities + drops, each at most retain_s / interval_s + 1 slots
    assert agg.slot_count() <= (3 + 1 + 17) * 7


def test_decode_refuses_oversized_and_undecodable():
    req = _request([("llm", 10**9, [(9001, 1, 1, 0, 0, 0.0)] * 3, 0)] * 3)
    with pytest.raises(ReportRefused, match="cluster_stats: 3 entries, at most 2"):
        decode_report(req, "e", 1, max_clusters=2, max_endpoints=100)
    with pytest.raises(ReportRefused, match="upstream_endpoint_stats: 9 entries, at most 8"):
        decode_report(req, "e", 1, max_clusters=10, max_endpoints=8)
    with pytest.raises(ReportRefused) as e:
        decode_request(b"\xff\xff\xff")
    assert e.value.reason == "undecodable"
    rep = decode_report(req, "e", 1, max_clusters=10, max_endpoints=100)
    assert rep.clusters[0].interval_s == 1.0 and rep.clusters[0].localities[0].endpoints[0].port == 9001


def test_load_report_proto_fields_are_the_ones_read():
    # the field names this module reads exist in the xds-protos version installed
    names = set(load_report_pb2.UpstreamEndpointStats.DESCRIPTOR.fields_by_name)
    assert {"total_successful_requests", "total_error_requests", "total_issued_requests",
            "total_requests_in_progress", "address"} <= names


@pytest.mark.parametrize(("lrs", "named"), [
    ({"retain": "5s", "traffic_ejection": {"window": "10s"}},
     r"lrs: retain \(5 s\) must be at least traffic_ejection\.window \(10 s\)"),
    ({"retain": "3s", "interval": "2s", "traffic_ejection": {"window": "3s"}},
     r"lrs: retain \(3 s\) must be at least 2 x interval"),
])
def test_a_window_longer_than_retain_is_refused_naming_both(lrs, named):
    base = {"xds": {"listen": "127.0.0.1:0"}, "clusters": [{"name": "llm", "nodes": []}]}
    with pytest.raises(ConfigError, match=named):
        parse_config({**base, "lrs": lrs})
    parse_config({**base, "lrs": {**lrs, "retain": "20s"}})  # retain long enough: accepted
