"""Property tests over the pure stream bookkeeping and the encoder (no gRPC): random walks of
subscription changes, cache changes, reconnects and ACKs must always converge to what the
protocol promises.

What is checked is what the stream *sent*: every response goes through the production encoder
(:func:`encode_response`) to wire bytes and is decoded as a client would. Client model (what
Envoy does with responses): resources are stored by name with their version and their bytes,
``removed_resources`` are dropped, an unsubscribed name is forgotten, a reconnect sends what it
holds in ``initial_resource_versions``. Convergence compares the bytes held with the bytes of the
cache's current resources, so a server with correct bookkeeping that ships stale resource bytes
fails (``test_property_check_catches_a_server_that_sends_stale_bytes`` shows it).
"""
from __future__ import annotations

import pytest
from conformance_support import CDS, EDS
from envoy.service.discovery.v3 import discovery_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import parse_config
from xds_server.config.duration import Duration
from xds_server.health.model import Routing
from xds_server.xds.cache import CachedResource, SnapshotCache
from xds_server.xds.delta import DeltaStream
from xds_server.xds.encoding import encode_response, response_message
from xds_server.xds.protocol import ResponsePlan, StreamIdentity
from xds_server.xds.resources import build_cla, build_cluster
from xds_server.xds.sotw import SotwStream

NAMES = ["c0", "c1", "c2", "c3"]
CFG = parse_config({"clusters": [
    {"name": n, "nodes": [{"id": f"{n}-a", "address": "127.0.0.1:9000", "probe_address": "127.0.0.1:1"}]}
    for n in NAMES]})
BY_NAME = {c.name: c for c in CFG.clusters}

op = st.one_of(
    st.tuples(st.just("subscribe"), st.sets(st.sampled_from(NAMES), min_size=1, max_size=2)),
    st.tuples(st.just("unsubscribe"), st.sets(st.sampled_from(NAMES), min_size=1, max_size=2)),
    st.tuples(st.just("set_cla"), st.sampled_from(NAMES), st.integers(1, 3)),
    st.tuples(st.just("remove_cla"), st.sampled_from(NAMES)),
    st.tuples(st.just("set_clusters"), st.sets(st.sampled_from(NAMES)), st.integers(1, 2)),
    st.tuples(st.just("reconnect")),
    st.tuples(st.just("ack")),
)


def set_cla(cache: SnapshotCache, name: str, weight: int) -> None:
    c = BY_NAME[name]
    cache.set_resource(EDS, name, build_cla(c, {n.id: Routing(weight, "HEALTHY") for n in c.nodes}))


def set_clusters(cache: SnapshotCache, names: set[str], timeout_s: int) -> None:
    cache.set_resources(CDS, {n: build_cluster(BY_NAME[n].model_copy(update={"connect_timeout": Duration(timeout_s)}))
                              for n in names})


_ids = iter(range(1, 1 << 62))


def new_stream(cls):
    """A stream with its identity injected as the shell would (unique id and nonce prefix)."""
    sid = next(_ids)
    return cls(StreamIdentity(sid, f"test.{sid:x}.", 0.0))


def serve(stream, cache) -> list[bytes]:
    """What our server writes for the responses due now: the production encoder's bytes."""
    return [encode_response(p, cache) for p in stream.plans(cache)]


class StaleBytesServer:
    """A test-only mutation: the same bookkeeping (versions, nonces, names), but each resource is
    shipped with the bytes it had the first time it was sent (stale content, current version)."""

    def __init__(self) -> None:
        self.first: dict[str, object] = {}

    def __call__(self, stream, cache) -> list[bytes]:
        out = []
        for p in stream.plans(cache):
            res = tuple(CachedResource(r.name, r.version, self.first.setdefault((p.type_url, r.name), r.any))
                        for r in p.resources)
            stale = ResponsePlan(p.variant, p.type_url, p.version, p.nonce, res, p.removed)
            out.append(response_message(stale).SerializeToString())
        return out


class DeltaClient:
    """What Envoy keeps from a delta stream (by name: version; and the resource bytes)."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, str]] = {CDS: {}, EDS: {}}
        self.bytes: dict[str, dict[str, bytes]] = {CDS: {}, EDS: {}}
        self.eds_subscribed: set[str] = set()
        self.nonces: set[str] = set()
        self.last_nonce: dict[str, str] = {}

    def apply(self, resp: discovery_pb2.DeltaDiscoveryResponse) -> None:
        assert resp.nonce and resp.nonce not in self.nonces
        self.nonces.add(resp.nonce)
        self.last_nonce[resp.type_url] = resp.nonce
        names = [r.name for r in resp.resources]
        assert len(names) == len(set(names)), "duplicate names"
        assert not set(names) & set(resp.removed_resources)
        for r in resp.resources:
            assert r.version and r.resource.type_url == resp.type_url
            self.held[resp.type_url][r.name] = r.version
            self.bytes[resp.type_url][r.name] = r.resource.value
        for n in resp.removed_resources:
            self.held[resp.type_url].pop(n, None)
            self.bytes[resp.type_url].pop(n, None)

    def forget(self, type_url: str, name: str) -> None:
        self.held[type_url].pop(name, None)
        self.bytes[type_url].pop(name, None)


def drain(stream, cache, client, server=serve) -> int:
    out = [discovery_pb2.DeltaDiscoveryResponse.FromString(b) for b in server(stream, cache)]
    for r in out:
        client.apply(r)
    return len(out)


def assert_holds(held_bytes: dict[str, bytes], cache: SnapshotCache, type_url: str, name: str) -> None:
    """The client holds exactly the bytes of the cache's current resource ``name``."""
    assert held_bytes.get(name) == cache.resources(type_url)[name].any.value, f"stale bytes of {name}"


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=25))
def test_prop_delta_client_converges_to_cache_for_every_walk(ops):
    delta_walk(ops, serve)


def delta_walk(ops, server) -> None:
    """One random walk on a delta stream served by ``server``; AssertionError on a violation."""
    cache = SnapshotCache()
    set_clusters(cache, {"c0", "c1"}, 1)
    set_cla(cache, "c0", 1)
    client = DeltaClient()

    def open_stream():
        s = new_stream(DeltaStream)
        s.on_request(discovery_pb2.DeltaDiscoveryRequest(type_url=CDS, initial_resource_versions=client.held[CDS]))
        s.on_request(discovery_pb2.DeltaDiscoveryRequest(
            type_url=EDS, resource_names_subscribe=sorted(client.eds_subscribed),
            initial_resource_versions={n: v for n, v in client.held[EDS].items() if n in client.eds_subscribed}))
        return s

    stream = open_stream()
    drain(stream, cache, client, server)
    for o in ops:
        kind = o[0]
        if kind == "subscribe":
            client.eds_subscribed |= o[1]
            stream.on_request(discovery_pb2.DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=sorted(o[1])))
            before = {}
            out = [discovery_pb2.DeltaDiscoveryResponse.FromString(b) for b in server(stream, cache)]
            for r in out:
                before.update({x.name: x.version for x in r.resources})
                client.apply(r)
            answered = set(before) | {n for r in out for n in r.removed_resources}
            pending = {n for n in o[1] if n in cache.resources(CDS) and n not in cache.resources(EDS)}
            assert o[1] - pending <= answered, "every subscribed name is answered"
            continue
        if kind == "unsubscribe":
            client.eds_subscribed -= o[1]
            for n in o[1]:
                client.forget(EDS, n)
            stream.on_request(discovery_pb2.DeltaDiscoveryRequest(type_url=EDS,
                                                                  resource_names_unsubscribe=sorted(o[1])))
            assert drain(stream, cache, client, server) == 0, "an unsubscribe-only request gets no response"
            continue
        if kind == "set_cla":
            set_cla(cache, o[1], o[2])
        elif kind == "remove_cla":
            cache.remove_resource(EDS, o[1])
        elif kind == "set_clusters":
            set_clusters(cache, o[1], o[2])
        elif kind == "reconnect":
            stream = open_stream()
        elif kind == "ack":
            for tu, nonce in client.last_nonce.items():
                stream.on_request(discovery_pb2.DeltaDiscoveryRequest(type_url=tu, response_nonce=nonce))
        drain(stream, cache, client, server)
        # Convergence: CDS exactly the cache (versions and bytes); every subscribed assignment
        # that exists at the cache's version and with its bytes; a subscribed name that exists
        # nowhere is not held.
        assert client.held[CDS] == {n: r.version for n, r in cache.resources(CDS).items()}
        for n in cache.resources(CDS):
            assert_holds(client.bytes[CDS], cache, CDS, n)
        for n in client.eds_subscribed:
            r = cache.resources(EDS).get(n)
            if r is not None:
                assert client.held[EDS].get(n) == r.version, n
                assert_holds(client.bytes[EDS], cache, EDS, n)
            elif n not in cache.resources(CDS):
                assert n not in client.held[EDS], n
    assert drain(stream, cache, client, server) == 0, "quiescent: nothing more to send"


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=25))
def test_prop_sotw_client_converges_and_an_ack_is_never_answered(ops):
    sotw_walk(ops, serve)


def sotw_walk(ops, server) -> None:
    """One random walk on a SotW stream served by ``server``; AssertionError on a violation."""
    cache = SnapshotCache()
    set_clusters(cache, {"c0", "c1"}, 1)
    set_cla(cache, "c0", 1)
    held_cds: dict[str, bytes] = {}
    held_eds: dict[str, bytes] = {}
    subscribed: set[str] = set()
    last: dict[str, discovery_pb2.DiscoveryResponse] = {}
    nonces: set[str] = set()
    stream = new_stream(SotwStream)

    def request(tu: str, names=()) -> None:
        prev = last.get(tu)
        stream.on_request(discovery_pb2.DiscoveryRequest(
            type_url=tu, resource_names=sorted(names), version_info=prev.version_info if prev else "",
            response_nonce=prev.nonce if prev else ""))

    def drain_sotw() -> int:
        out = [discovery_pb2.DiscoveryResponse.FromString(b) for b in server(stream, cache)]
        for r in out:
            assert r.nonce not in nonces
            nonces.add(r.nonce)
            last[r.type_url] = r
            if r.type_url == CDS:
                held_cds.clear()
            from envoy.config.cluster.v3 import cluster_pb2
            from envoy.config.endpoint.v3 import endpoint_pb2
            for a in r.resources:
                m = cluster_pb2.Cluster() if r.type_url == CDS else endpoint_pb2.ClusterLoadAssignment()
                a.Unpack(m)
                name = m.name if r.type_url == CDS else m.cluster_name
                target = held_cds if r.type_url == CDS else held_eds
                target[name] = a.value  # what was sent, not what the cache holds
        return len(out)

    request(CDS)
    drain_sotw()
    for o in ops:
        kind = o[0]
        if kind in ("subscribe", "unsubscribe"):
            subscribed = subscribed | o[1] if kind == "subscribe" else subscribed - o[1]
            for n in list(held_eds):
                if n not in subscribed:
                    del held_eds[n]
            request(EDS, subscribed)
        elif kind == "set_cla":
            set_cla(cache, o[1], o[2])
        elif kind == "remove_cla":
            cache.remove_resource(EDS, o[1])
        elif kind == "set_clusters":
            set_clusters(cache, o[1], o[2])
        elif kind == "reconnect":
            stream = new_stream(SotwStream)
            last.clear()
            request(CDS)
            if subscribed:
                request(EDS, subscribed)
        elif kind == "ack":
            for tu in list(last):
                request(tu, subscribed if tu == EDS else ())
            assert drain_sotw() == 0, "an ACK with unchanged state gets no response"
            continue
        drain_sotw()
        assert set(held_cds) == set(cache.resources(CDS))
        for n in held_cds:
            assert_holds(held_cds, cache, CDS, n)
        for n in subscribed:
            r = cache.resources(EDS).get(n)
            if r is not None and EDS in stream.types:
                assert_holds(held_eds, cache, EDS, n)
        if last.get(CDS) is not None:  # the CDS version names what the client holds
            assert last[CDS].version_info == cache.type_version(CDS)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(NAMES), max_size=4, unique=True), st.lists(st.sampled_from(NAMES), max_size=3),
       st.text(min_size=1, max_size=300), st.sampled_from(["sotw", "delta"]))
def test_prop_shared_encoding_is_byte_equivalent_to_the_message(names, removed, nonce, variant):
    cache = SnapshotCache()
    for n in NAMES:
        set_cla(cache, n, 1 + NAMES.index(n))
    res = tuple(cache.resources(EDS)[n] for n in names)
    plan = ResponsePlan(variant, EDS, cache.type_version(EDS), nonce, res, tuple(removed) if variant == "delta" else ())
    wire = encode_response(plan, cache)
    cls = discovery_pb2.DiscoveryResponse if variant == "sotw" else discovery_pb2.DeltaDiscoveryResponse
    assert cls.FromString(wire) == response_message(plan)
    assert encode_response(plan, cache) == wire  # memoized body, same bytes


def test_property_check_catches_a_server_that_sends_stale_bytes():
    # The same walks pass against ours and fail against the mutation (a past blind spot:
    # a check of versions alone passes both).
    sotw_walk([("subscribe", {"c0"}), ("set_cla", "c0", 2)], serve)
    delta_walk([("subscribe", {"c0"}), ("set_cla", "c0", 2)], serve)
    with pytest.raises(AssertionError, match="stale bytes of c0"):
        sotw_walk([("subscribe", {"c0"}), ("set_cla", "c0", 2)], StaleBytesServer())
    with pytest.raises(AssertionError, match="stale bytes of c0"):
        delta_walk([("subscribe", {"c0"}), ("set_cla", "c0", 2)], StaleBytesServer())
    with pytest.raises(AssertionError, match="stale bytes of c"):
        delta_walk([("set_clusters", {"c0", "c1"}, 2)], StaleBytesServer())  # CDS too
