"""Helpers for the xDS conformance suite: an in-process ADS server over a SnapshotCache, scripted
SotW/delta clients (xds_server.testing) and small builders for test resources."""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from xds_server.config import parse_config
from xds_server.health.model import Routing
from xds_server.testing import ScriptedAdsClient, ScriptedDeltaAdsClient
from xds_server.xds.ads import AdsServicer
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.resources import (
    CLA_TYPE_URL as EDS,
)
from xds_server.xds.resources import (
    CLUSTER_TYPE_URL as CDS,
)
from xds_server.xds.resources import (
    RESOURCE_TYPES,
    build_cla,
    build_cluster,
)

CFG = parse_config({"clusters": [
    {"name": "llm", "nodes": [{"id": "a", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:1"},
                              {"id": "b", "address": "127.0.0.1:8002", "probe_address": "127.0.0.1:2"}]},
    {"name": "llm2", "nodes": [{"id": "c", "address": "127.0.0.1:8003", "probe_address": "127.0.0.1:3"}]},
]})
CLUSTERS = {c.name: c for c in CFG.clusters}


def cla(cluster: str = "llm", weight: int = 100, health: str = "HEALTHY") -> endpoint_pb2.ClusterLoadAssignment:
    """A ClusterLoadAssignment of a test cluster with every node at ``weight`` / ``health``."""
    c = CLUSTERS[cluster]
    return build_cla(c, {n.id: Routing(weight, health) for n in c.nodes})


def empty_cla(cluster: str) -> endpoint_pb2.ClusterLoadAssignment:
    """An assignment with no endpoints (how a test takes every endpoint of a cluster away)."""
    return endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster)


def clas_of(resp) -> list[endpoint_pb2.ClusterLoadAssignment]:
    """Unpacked assignments of a SotW response."""
    out = []
    for a in resp.resources:
        m = endpoint_pb2.ClusterLoadAssignment()
        a.Unpack(m)
        out.append(m)
    return out


def clusters_of(resp) -> list[str]:
    """Cluster names of a SotW CDS response."""
    out = []
    for a in resp.resources:
        m = cluster_pb2.Cluster()
        a.Unpack(m)
        out.append(m.name)
    return out


def delta_names(resp) -> list[str]:
    """Names of the resources of a delta response."""
    return [r.name for r in resp.resources]


@dataclass
class AdsServer:
    """An in-process ADS server: ``cache``, ``servicer``, ``port``; ``sotw()`` / ``delta()`` open clients."""

    cache: SnapshotCache
    servicer: AdsServicer
    server: grpc.aio.Server
    port: int
    clients: list = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def sotw(self) -> ScriptedAdsClient:
        c = ScriptedAdsClient(self.target)
        await c.open()
        self.clients.append(c)
        return c

    async def delta(self) -> ScriptedDeltaAdsClient:
        c = ScriptedDeltaAdsClient(self.target)
        await c.open()
        self.clients.append(c)
        return c

    def publish_clusters(self, *names: str, **changes) -> None:
        """CDS = the named test clusters (``changes`` applied to each and validated, e.g. connect_timeout)."""
        self.cache.set_resources(CDS, {n: build_cluster(type(CLUSTERS[n]).model_validate(
            {**CLUSTERS[n].model_dump(), **changes})) for n in names})

    def only_stream(self):
        (s,) = self.servicer.streams.values()
        return s


async def start_ads_server(validate: bool = True, **grpc_options) -> AdsServer:
    """Start an ADS server on a free port with CDS {llm, llm2} and the CLA of llm published."""
    cache = SnapshotCache(validators={tu: t.validate for tu, t in RESOURCE_TYPES.items()} if validate else None)
    cache.set_resources(CDS, {c.name: build_cluster(c) for c in CFG.clusters})
    cache.set_resource(EDS, "llm", cla("llm"))
    servicer = AdsServicer(cache)
    srv = grpc.aio.server(options=list(grpc_options.items()))
    servicer.add_to_server(srv)  # the production registration: shared pre-encoded responses
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    return AdsServer(cache, servicer, srv, port)


async def stop_ads_server(s: AdsServer) -> None:
    for c in s.clients:
        await c.close()
    await s.server.stop(0)


def control_plane_config(**xds) -> dict:
    """A ControlPlane config for protocol tests: clusters llm (a, b) and llm2 (c) whose agents do
    not exist (nodes stay COLD), the warm-up gate open at once, free ports."""
    from xds_server.testing import free_port

    def node(nid: str, port: int) -> dict:
        return {"id": nid, "address": f"127.0.0.1:{port}", "probe_address": f"127.0.0.1:{free_port()}"}

    return {
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0, **xds},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"reconnect_backoff_initial_ms": 1000, "reconnect_backoff_max_ms": 5000},
        "clusters": [{"name": "llm", "nodes": [node("a", 8001), node("b", 8002)]},
                     {"name": "llm2", "nodes": [node("c", 8003)]}],
    }


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found")
