"""SnapshotCache: the named consistency check (go-control-plane's Consistent()) and the bounded
memos (count and bytes) that closed streams must not grow."""
from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import parse_config
from xds_server.health.model import Routing
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.memo import BoundedMemo, size_of_names
from xds_server.xds.resources import CLA_TYPE_URL as EDS
from xds_server.xds.resources import CLUSTER_TYPE_URL as CDS
from xds_server.xds.resources import build_cla, build_cluster

CFG = parse_config({"clusters": [
    {"name": n, "nodes": [{"id": f"{n}-a", "address": "127.0.0.1:9000", "probe_address": "127.0.0.1:1"}]}
    for n in ("llm", "llm2")]})
BY_NAME = {c.name: c for c in CFG.clusters}


def cla(name: str) -> endpoint_pb2.ClusterLoadAssignment:
    return build_cla(BY_NAME[name], {f"{name}-a": Routing(100, "HEALTHY")})


def test_consistent_snapshot_has_no_problems():
    cache = SnapshotCache()
    cache.set_resources(CDS, {n: build_cluster(c) for n, c in BY_NAME.items()})
    cache.set_resource(EDS, "llm", cla("llm"))
    assert cache.consistent() == []  # llm2's assignment is pending (warm-up gate): allowed
    assert cache.consistent(complete=True) == [
        "Cluster 'llm2' refers to ClusterLoadAssignment 'llm2', which does not exist"]
    cache.set_resource(EDS, "llm2", cla("llm2"))
    assert cache.consistent(complete=True) == []


def test_consistent_names_an_assignment_without_its_cluster():
    cache = SnapshotCache()
    cache.set_resources(CDS, {"llm": build_cluster(BY_NAME["llm"])})
    cache.set_resource(EDS, "llm", cla("llm"))
    cache.set_resource(EDS, "llm2", cla("llm2"))
    assert cache.consistent() == ["ClusterLoadAssignment 'llm2' is not referred to by any Cluster"]


def test_consistent_follows_eds_service_name_and_ignores_non_eds_clusters():
    cache = SnapshotCache()
    c = build_cluster(BY_NAME["llm"])
    c.eds_cluster_config.service_name = "llm-endpoints"
    static = cluster_pb2.Cluster(name="static", type=cluster_pb2.Cluster.STATIC)
    cache.set_resources(CDS, {"llm": c, "static": static})
    cache.set_resource(EDS, "llm", cla("llm"))
    assert cache.consistent(complete=True) == [
        "Cluster 'llm' refers to ClusterLoadAssignment 'llm-endpoints', which does not exist",
        "ClusterLoadAssignment 'llm' is not referred to by any Cluster"]


def test_memo_is_bounded_by_entries_and_bytes_least_recently_used_out_first():
    m = BoundedMemo(max_entries=3, max_bytes=1000)
    for k in "abc":
        assert m.put(k, k.upper(), 100)
    assert m.get("a") == "A"           # a is now the most recently used
    m.put("d", "D", 100)               # 4 entries > 3: b (least recently used) goes
    assert m.get("b") is None and m.get("a") == "A" and len(m) == 3
    assert not m.put("huge", "x", 251)  # over a quarter of max_bytes: not stored
    assert m.get("huge") is None
    m.put("e", "E", 250)
    m.put("f", "F", 250)
    m.put("g", "G", 250)
    assert m.nbytes <= 1000 and len(m) <= 3
    m.clear()
    assert len(m) == 0 and m.nbytes == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 400)), max_size=200),
       st.integers(1, 8), st.integers(1, 2000))
def test_memo_never_exceeds_its_bounds(puts, max_entries, max_bytes):
    m = BoundedMemo(max_entries, max_bytes)
    for k, n in puts:
        m.put(k, k, n)
        assert len(m) <= max_entries and m.nbytes <= max_bytes
        assert m.nbytes == sum(size for _, size in m._items.values())


def test_subscription_set_memo_of_closed_streams_stays_within_its_byte_bound():
    # Measured before the bound: 200 streams of 20k names left 529 MB behind in the subset-version memo.
    cache = SnapshotCache(memo_max_entries=1024, memo_max_bytes=256 * 1024)
    cache.set_resource(EDS, "llm", cla("llm"))
    for i in range(200):
        names = frozenset([f"s{i}-{j:05d}" for j in range(2_000)] + ["llm"])
        v = cache.subset_version(EDS, names)
        assert v == cache.subset_version(EDS, frozenset(["llm"]))  # only existing names count
    assert cache.memo_bytes() <= 2 * 256 * 1024
    small = frozenset(["llm", "x"])
    cache.subset_version(EDS, small)
    assert cache._subset_versions[EDS].get(small) is not None  # small sets are shared
    assert size_of_names(["ab"]) == 2 + 64
