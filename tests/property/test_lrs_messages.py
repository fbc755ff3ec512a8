"""Hostile and arbitrary LRS messages through the pure decode + aggregate path (xds_server.load):
random bytes, unknown clusters, absurd counts and intervals, many localities and endpoints,
forged or broken peer markers. Never an exception outside ReportRefused, never a refused entry
applied, memory (slots, localities, reporters) bounded; and two replicas forwarding to each other
(xds_server.load.peers) hold the same sums, each report once, whichever replica an Envoy is on.
(tests/unit/test_lrs_aggregate.py covers the sums, windows and Envoy's quirks.)"""
from __future__ import annotations

from envoy.service.load_stats.v3 import lrs_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xds_server.config import parse_config
from xds_server.load.aggregate import Counts, LoadAggregator
from xds_server.load.peers import MARKER, PeerSet, forwarded_by
from xds_server.load.report import ReportRefused, decode_report, decode_request

NODES = {"llm": {("127.0.0.1", 9001): "gpu-a", ("127.0.0.1", 9002): "gpu-b"}}
LIMITS = {"max_clusters": 8, "max_endpoints": 64}
KNOWN = {"unknown_cluster", "absurd_count", "bad_interval", "flood", "unknown_endpoint", "too_many_categories",
         "too_many_localities"}
MAX_COUNT = 1_000_000

u64 = st.integers(0, 2**64 - 1)
counts = st.one_of(st.integers(0, 1000), u64)
texts = st.text(max_size=12)


@st.composite
def requests(draw) -> lrs_pb2.LoadStatsRequest:
    """A LoadStatsRequest: known, unknown, control-plane and odd cluster names; any counts and
    intervals (Duration seconds over the whole int64 range); many localities and endpoints."""
    req = lrs_pb2.LoadStatsRequest()
    if draw(st.booleans()):
        req.node.id = draw(texts)
    for _ in range(draw(st.integers(0, 3))):
        cs = req.cluster_stats.add(cluster_name=draw(st.sampled_from(["llm", "other", "xds_cluster", "", "llm\x00"])),
                                   total_dropped_requests=draw(counts))
        if draw(st.booleans()):
            cs.load_report_interval.seconds = draw(st.integers(-(2**63), 2**63 - 1))
            cs.load_report_interval.nanos = draw(st.integers(-999_999_999, 999_999_999))
        for _ in range(draw(st.integers(0, 3))):
            cs.dropped_requests.add(category=draw(texts), dropped_count=draw(counts))
        for _ in range(draw(st.integers(0, 6))):
            loc = cs.upstream_locality_stats.add(total_issued_requests=draw(counts),
                                                 total_successful_requests=draw(counts),
                                                 priority=draw(st.integers(0, 2**32 - 1)))
            loc.locality.region, loc.locality.zone = draw(texts), draw(st.sampled_from(["a", "b", ""]))
            for _ in range(draw(st.integers(0, 3))):
                ep = loc.upstream_endpoint_stats.add(
                    total_issued_requests=draw(counts), total_successful_requests=draw(counts),
                    total_error_requests=draw(counts), total_requests_in_progress=draw(counts))
                ep.address.socket_address.address = draw(st.sampled_from(["127.0.0.1", "10.0.0.1", ""]))
                ep.address.socket_address.port_value = draw(st.sampled_from([9001, 9002, 0, 2**32 - 1]))
    return req


def _figures(agg: LoadAggregator, now: float) -> dict[str, tuple[int, int, int]]:
    return {n: (t.issued, t.succeeded, t.errored)
            for n in ("gpu-a", "gpu-b") for t in [agg.node("llm", n, now, 1e6)]}


def _expected(req: lrs_pb2.LoadStatsRequest, retain_s: float) -> dict[str, list[int]]:
    """What the spec says a (not flooding) report adds per node: every "llm" entry whose interval
    is absent or within 0..10 x retain_s and whose every count is within MAX_COUNT adds its known
    endpoints' counts; any other entry adds nothing."""
    out = {"gpu-a": [0, 0, 0], "gpu-b": [0, 0, 0]}
    for cs in req.cluster_stats:
        if cs.cluster_name != "llm":
            continue
        if cs.HasField("load_report_interval"):
            iv = cs.load_report_interval.seconds + cs.load_report_interval.nanos / 1e9
            if not 0 <= iv <= retain_s * 10:
                continue
        values = [cs.total_dropped_requests, *(d.dropped_count for d in cs.dropped_requests)]
        for loc in cs.upstream_locality_stats:
            values += [loc.total_issued_requests, loc.total_successful_requests, loc.total_error_requests,
                       loc.total_requests_in_progress]
            for ep in loc.upstream_endpoint_stats:
                values += [ep.total_issued_requests, ep.total_successful_requests, ep.total_error_requests,
                           ep.total_requests_in_progress]
        if any(v > MAX_COUNT for v in values):
            continue
        for loc in cs.upstream_locality_stats:
            for ep in loc.upstream_endpoint_stats:
                node = NODES["llm"].get((ep.address.socket_address.address, ep.address.socket_address.port_value))
                if node is not None:
                    for i, v in enumerate((ep.total_issued_requests, ep.total_successful_requests,
                                           ep.total_error_requests)):
                        out[node][i] += v
    return out


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_random_bytes_decode_or_are_refused_as_undecodable(raw):
    try:
        req = decode_request(raw)
    except ReportRefused as e:
        assert e.reason == "undecodable"
        return
    try:
        decode_report(req, "envoy-1", 1, **LIMITS)
    except ReportRefused as e:
        assert e.reason == "too_large"


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.tuples(requests(), st.floats(0.0, 3.0), st.integers(1, 3)), min_size=1, max_size=8))
def test_hostile_reports_never_raise_never_apply_refused_entries_and_stay_bounded(batch):
    agg = LoadAggregator(NODES, interval_s=1.0, retain_s=5.0, max_count=MAX_COUNT, min_gap_s=0.5,
                         max_categories=4, max_localities=5)
    now = 0.0
    last: dict[int, float] = {}  # stream -> when its last report was accepted
    for req, gap, stream in batch:
        now += gap
        try:
            rep = decode_report(decode_request(req.SerializeToString()), "envoy-1", stream, **LIMITS)
        except ReportRefused as e:
            assert e.reason == "too_large"
            continue
        before = _figures(agg, now)
        found = agg.ingest(rep, now)
        assert set(found) <= KNOWN
        flood = bool(rep.clusters) and stream in last and now - last[stream] < 0.5
        assert ("flood" in found) == flood
        if rep.clusters and not flood:
            last[stream] = now
        want = {n: [0, 0, 0] for n in before} if flood else _expected(req, 5.0)
        after = _figures(agg, now)
        assert {n: [a - b for a, b in zip(after[n], before[n], strict=True)] for n in after} == want
    # memory: per cluster its known nodes, at most max_localities localities and max_categories
    # + 1 drop series, each at most retain_s / interval_s + 2 slots; nothing for unknown clusters
    assert agg.slot_count() <= (2 + agg.max_localities + 4 + 1) * (5 + 2)
    assert agg.localities("other") == [] and len(agg.localities("llm")) <= agg.max_localities


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 400), st.integers(1, 3))
def test_many_localities_are_bounded_and_their_endpoints_still_count(n_localities, issued):
    agg = LoadAggregator(NODES, max_localities=16)
    req = lrs_pb2.LoadStatsRequest()
    cs = req.cluster_stats.add(cluster_name="llm")
    for i in range(n_localities):
        loc = cs.upstream_locality_stats.add(total_issued_requests=issued)
        loc.locality.region = f"r{i}"
        ep = loc.upstream_endpoint_stats.add(total_issued_requests=issued, total_successful_requests=issued)
        ep.address.socket_address.address, ep.address.socket_address.port_value = "127.0.0.1", 9001
    found = agg.ingest(decode_report(req, "e", 1, max_clusters=8, max_endpoints=1000), 1.0)
    assert len(agg.localities("llm")) == min(16, n_localities)
    assert ("too_many_localities" in found) == (n_localities > 16)
    assert agg.totals[("llm", "gpu-a")] == Counts(issued * n_localities, issued * n_localities, 0)


@given(st.one_of(st.none(), st.text(max_size=80), st.integers(), st.booleans(), st.floats(allow_nan=True)),
       st.booleans())
def test_a_marker_counts_only_as_a_non_empty_string(value, with_node):
    req = lrs_pb2.LoadStatsRequest()
    if with_node:
        req.node.id = "cp-1"
        if value is None:
            req.node.metadata.fields[MARKER].null_value = 0
        elif isinstance(value, str):
            req.node.metadata.fields[MARKER].string_value = value
        elif isinstance(value, bool):
            req.node.metadata.fields[MARKER].bool_value = value
        else:
            req.node.metadata.fields[MARKER].number_value = float(value)
    got = forwarded_by(req)
    if with_node and isinstance(value, str) and value:
        assert got == value[:64] or (len(value) > 64 and got is not None and len(got) <= 64)
    else:
        assert got is None


def _replica(me: str, peer: str) -> PeerSet:
    cfg = parse_config({"xds": {"listen": "127.0.0.1:1", "replica_id": me},
                        "lrs": {"peers": [{"address": peer, "replica_id": "cp-x"}]},
                        "clusters": [{"name": "llm", "nodes": [
                            {"id": "gpu-a", "address": "127.0.0.1:9001", "probe_address": "127.0.0.1:9101"},
                            {"id": "gpu-b", "address": "127.0.0.1:9002", "probe_address": "127.0.0.1:9102"}]}]})
    return PeerSet(cfg)


def _envoy_report(per_node: dict[int, int]) -> lrs_pb2.LoadStatsRequest:
    req = lrs_pb2.LoadStatsRequest()
    loc = req.cluster_stats.add(cluster_name="llm").upstream_locality_stats.add()
    for port, n in per_node.items():
        ep = loc.upstream_endpoint_stats.add(total_issued_requests=n, total_successful_requests=n)
        ep.address.socket_address.address, ep.address.socket_address.port_value = "127.0.0.1", port
    return req


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["envoy-1", "envoy-2", "envoy-3"]), st.integers(0, 1),
                          st.dictionaries(st.sampled_from([9001, 9002]), st.integers(0, 50), max_size=2)),
                min_size=1, max_size=30))
def test_two_replicas_forwarding_hold_the_same_sums_each_report_once(reports):
    # each report lands on the replica the Envoy's stream is on at that moment (it may move
    # between reports); that replica applies it and forwards it, the other applies the forwarded
    # copy (flood-checked per Envoy and peer stream) and never forwards it back
    peers = [_replica("cp-1", "127.0.0.1:2"), _replica("cp-2", "127.0.0.1:1")]
    aggs = [LoadAggregator(NODES, interval_s=1.0, retain_s=1e6), LoadAggregator(NODES, interval_s=1.0, retain_s=1e6)]
    want = {"gpu-a": 0, "gpu-b": 0}
    now = 0.0
    last: dict[str, float] = {}
    for envoy, on, per_node in reports:
        now += 1.0
        last[envoy] = now
        req = _envoy_report(per_node)
        rep = decode_report(req, envoy, 7, **LIMITS)
        assert aggs[on].ingest(rep, now) == []
        peers[on].forward(envoy, req)
        link = peers[on].links[0]
        fwd = decode_request(link.queue.get_nowait()[1])  # (queued at, bytes)
        assert forwarded_by(fwd) == f"cp-{on + 1}" and fwd.node.id == envoy
        assert list(fwd.cluster_stats) == list(req.cluster_stats)
        other = 1 - on
        got = decode_report(fwd, fwd.node.id, 99, **LIMITS)
        assert got.clusters == rep.clusters
        assert aggs[other].ingest(got, now + 0.001) == []  # flood-checked per Envoy, as a direct stream
        assert all(link.queue.empty() for p in peers for link in p.links)  # nothing forwarded twice
        for port, n in per_node.items():
            want["gpu-a" if port == 9001 else "gpu-b"] += n
    for agg in aggs:
        assert {n: agg.totals.get(("llm", n), Counts()).issued for n in want} == want
        assert agg.reporters(now) == sum(1 for at in last.values() if now - at <= agg.stale_after_s)
