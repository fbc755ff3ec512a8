"""LRS with two control-plane replicas (``lrs.peers``, xds_server/load/peers.py): each Envoy's
LRS stream lands on one replica, which forwards every report to the other, so both sum every
Envoy's reports exactly once. With real Envoys: one on each replica and one whose bootstrap
lists both; and in-process, the peer edges (refused without lrs.peers or under this replica's
own id, a forwarded report never forwarded back, a full queue counted, never blocking; over
mtls, a peer allowed or refused by its client certificate as an Envoy is)."""
from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.service.load_stats.v3 import lrs_pb2
from lrs_support import send_counted

from xds_server.config import parse_config
from xds_server.envoy.bootstrap import find_envoy, render_bootstrap, write_bootstrap
from xds_server.load.peers import MARKER
from xds_server.process.tls import ClientTls, dial
from xds_server.server import ControlPlane
from xds_server.testing import (
    InMemoryProbes,
    ManagedProcess,
    StandaloneEnvoy,
    TestCA,
    free_port,
    wait_for,
)
from xds_server.testing._envoy import envoy_process
from xds_server.testing._fault_rig import prometheus_value

LRS_METHOD = "/envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats"


async def _json(http, url: str) -> dict:
    async with http.get(url) as r:
        return await r.json()


async def _metrics(http, admin: str) -> str:
    async with http.get(f"{admin}/metrics") as r:
        return await r.text()


@pytest.mark.envoy
async def test_two_replicas_each_sum_every_envoy_exactly_once(make_fleet, http):
    p2 = free_port()
    fleet = make_fleet(n_nodes=3, xds_options={"replica_id": "cp-1"},
                       config_options={"lrs": {"peers": [{"address": f"127.0.0.1:{p2}", "replica_id": "cp-2"}]}})
    r1 = f"127.0.0.1:{fleet.xds_port}"
    cfg2 = fleet.config_dict()
    a2 = free_port()
    cfg2.update(xds={"listen": f"127.0.0.1:{p2}", "replica_id": "cp-2"}, admin={"listen": f"127.0.0.1:{a2}"},
                lrs={"peers": [{"address": r1, "replica_id": "cp-1"}]})
    assert fleet.workdir is not None
    (fleet.workdir / "cp-2.yaml").write_text(yaml.safe_dump(cfg2, sort_keys=False))
    cp2 = ManagedProcess("cp-2", [*fleet._py("-m", "xds_server.cli", "serve", "--config",
                                             str(fleet.workdir / "cp-2.yaml"))],
                         fleet.workdir / "cp-2.log", ready_pattern="admin listening")
    admins = {"cp-1": f"http://127.0.0.1:{fleet.admin_port}", "cp-2": f"http://127.0.0.1:{a2}"}
    # the fleet's Envoy lists cp-1 only, envoy-2 cp-2 only, envoy-3 both (cp-2 first): each
    # replica holds at least one Envoy's LRS stream, and one bootstrap is docs/replicas.md's
    envoy2 = StandaloneEnvoy(p2, node_id="envoy-2")
    tmp = tempfile.TemporaryDirectory(prefix="xds-envoy3-")
    wd3 = Path(tmp.name)
    port3, admin3 = free_port(), free_port()
    boot3 = write_bootstrap(wd3 / "envoy.yaml", render_bootstrap(
        xds_replicas=(f"127.0.0.1:{p2}", r1), listener_port=port3, admin_port=admin3, cluster="llm",
        node_id="envoy-3"))
    envoy3 = envoy_process(find_envoy(), boot3, wd3, concurrency=1)
    try:
        started = asyncio.ensure_future(asyncio.to_thread(cp2.start, 30.0))  # the Envoys meanwhile:
        await envoy2.start()  # they dial until cp-2 answers
        envoy3.start()
        await started
        await fleet.wait_all_routed(http)

        async def listed() -> bool:  # Envoy counts a cluster's traffic from the first report naming it
            for admin in admins.values():
                with contextlib.suppress(Exception):
                    cl = (await _json(http, f"{admin}/clusters"))["clusters"][0]["traffic"]
                    if cl["envoys_reporting_cluster"] != 3:
                        return False
                    continue
                return False
            return True

        await wait_for(listed, 20, what="both replicas hear all 3 Envoys report cluster llm")
        streams = {r: prometheus_value(await _metrics(http, a), "sentinel_lrs_streams") for r, a in admins.items()}
        assert streams["cp-1"] >= 1 and streams["cp-2"] >= 1 and sum(streams.values()) == 3, streams
        sent = await send_counted((fleet.url, envoy2.url, f"http://127.0.0.1:{port3}"))

        async def reported(admin: str) -> dict[str, dict] | None:
            nodes = {v["id"]: v["traffic"] for v in (await _json(http, f"{admin}/nodes"))["nodes"]}
            got = {nid: t["since_start"]["succeeded"] for nid, t in nodes.items()}
            return nodes if got == sent else None

        views = {r: await wait_for(lambda a=a: reported(a), 10, what=f"{r}'s totals equal what was sent {sent}")
                 for r, a in admins.items()}
        print(f"\nsent per node {sent}; LRS streams per replica {streams}")
        for r, nodes in views.items():
            for nid, t in nodes.items():
                assert t["since_start"] == {"issued": sent[nid], "succeeded": sent[nid], "errored": 0}, (r, nid)
                assert t["reporting_envoys"] == 3, (r, nid)
        for r, admin in admins.items():
            text = await _metrics(http, admin)
            other = "cp-2" if r == "cp-1" else "cp-1"
            assert prometheus_value(text, "sentinel_lrs_peer_up") == 1.0, r
            assert prometheus_value(text, "sentinel_lrs_peer_forwarded_total") > 0, r
            assert prometheus_value(text, "sentinel_lrs_peer_received_total", replica=other) > 0, r
            assert prometheus_value(text, "sentinel_lrs_peer_dropped_total", reason="queue_full") == 0, r
            assert prometheus_value(text, "sentinel_lrs_reporting_envoys") == 3, r
            assert 'reason="peer_refused"' not in text, r
    finally:
        envoy3.stop()
        tmp.cleanup()
        envoy2.stop()
        cp2.stop()


def _peer(port: int, rid: str) -> dict:
    return {"address": f"127.0.0.1:{port}", "replica_id": rid}


def _cfg(xds: int, rid: str, peers: list[dict]):
    return parse_config({
        "xds": {"listen": f"127.0.0.1:{xds}", "replica_id": rid}, "admin": {"listen": f"127.0.0.1:{free_port()}"},
        # no flood check here (min_report_gap_ratio 0): reports are written back to back
        "lrs": {"peers": peers, "peer_queue": 2, "peer_max_delay_s": 60, "peer_backoff_max_s": 0.5,
                "min_report_gap_ratio": 0},
        "clusters": [{"name": "llm", "nodes": [{"id": "gpu-a", "address": "127.0.0.1:9001",
                                                 "probe_address": "127.0.0.1:9101"}]}]})


def _report(issued: int, node_id: str = "", marker: str | None = None) -> bytes:
    req = lrs_pb2.LoadStatsRequest()
    if node_id:
        req.node.id = node_id
    if marker is not None:
        req.node.metadata.fields[MARKER].string_value = marker
    if issued:
        loc = req.cluster_stats.add(cluster_name="llm").upstream_locality_stats.add(total_issued_requests=issued)
        ep = loc.upstream_endpoint_stats.add(total_issued_requests=issued, total_successful_requests=issued)
        ep.address.socket_address.address, ep.address.socket_address.port_value = "127.0.0.1", 9001
    return req.SerializeToString()


async def _refused(port: int, hello: bytes) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream(LRS_METHOD)()
        await call.write(hello)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(call.read(), 10)
        return e.value.code()


async def test_peer_edges_refused_counted_and_never_forwarded_twice():
    p1, p2 = free_port(), free_port()
    a = ControlPlane(_cfg(p1, "cp-1", [_peer(p2, "cp-2")]), probe_sources=InMemoryProbes())
    lone = ControlPlane(_cfg(free_port(), "cp-9", []), probe_sources=InMemoryProbes())
    await a.start()
    await lone.start()
    b: ControlPlane | None = None
    try:
        # a replica without lrs.peers refuses forwarded reports; a stream under its own id too
        assert await _refused(lone.xds_port, _report(0, "cp-1", "cp-1")) is grpc.StatusCode.PERMISSION_DENIED
        assert await _refused(p1, _report(0, "cp-1", "cp-1")) is grpc.StatusCode.PERMISSION_DENIED
        assert lone.load.aggregator.problems["peer_refused"] == 1 == a.load.aggregator.problems["peer_refused"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{p1}") as ch:
            envoy = ch.stream_stream(LRS_METHOD)()
            await envoy.write(_report(0, "envoy-1"))
            await asyncio.wait_for(envoy.read(), 10)
            # cp-2 is down: reports wait in the bounded queue (2), the rest are dropped and counted
            for n in (1, 2, 3):
                await envoy.write(_report(n))
            await wait_for(lambda: getattr(a.load.aggregator.totals.get(("llm", "gpu-a")), "issued", 0) == 6, 5,
                           what="cp-1 applied 6")
            link = a.load.peers.links[0]
            assert link.dropped["queue_full"] == 1 and link.queue.qsize() == 2 and not link.up
            b = ControlPlane(_cfg(p2, "cp-2", [_peer(p1, "cp-1")]), probe_sources=InMemoryProbes())
            await b.start()
            await wait_for(lambda: link.up and link.forwarded == 2, 10, what="the queue drained once cp-2 was up")
            bt = b.load.aggregator
            await wait_for(lambda: ("llm", "gpu-a") in bt.totals and bt.totals[("llm", "gpu-a")].issued == 3, 5,
                           what="cp-2 applied the 2 queued reports (1 + 2)")
            # a forwarded report is applied and never forwarded back: cp-1 still counts 6
            await envoy.write(_report(4))
            await wait_for(lambda: bt.totals[("llm", "gpu-a")].issued == 7, 5, what="cp-2 applied the next")
            await asyncio.sleep(0.3)
            assert a.load.aggregator.totals[("llm", "gpu-a")].issued == 10
            assert b.load.peers.links[0].forwarded == 0 and dict(b.load.peers.received) == {"cp-1": 3}
            assert bt.reporters(b.clock.now()) == 1  # the Envoy, not the forwarding replica
            # cp-2 goes away; a report that waits past lrs.peer_max_delay is dropped as stale
            # when the stream is back (applied then it would land in the wrong window)
            await b.stop()
            await wait_for(lambda: not link.up, 5, what="cp-1 saw cp-2 go")
            await envoy.write(_report(5))
            await wait_for(lambda: link.queue.qsize() == 1, 5, what="the report queued")
            link.monotonic = lambda: time.monotonic() + 61.0  # 61 s later, for the link's clock
            b = ControlPlane(_cfg(p2, "cp-2", [_peer(p1, "cp-1")]), probe_sources=InMemoryProbes())
            await b.start()
            await wait_for(lambda: link.dropped["stale"] == 1, 10, what="the late report dropped as stale")
            assert link.forwarded == 3 and ("llm", "gpu-a") not in b.load.aggregator.totals
            envoy.cancel()
    finally:
        for cp in (b, lone, a):
            if cp is not None:
                await cp.stop()


async def test_peers_over_mtls_are_allowed_by_their_client_certificate(tmp_path):
    # mtls on both xDS ports; each replica dials its peer with its own client certificate, which
    # must match the identity the peer lists for its replica id (lrs.peers), whatever
    # tls.node_allow (the Envoys' rule) says
    ca = TestCA(tmp_path)
    server = ca.issue("xds", dns=["localhost"], ips=["127.0.0.1"])
    cert = {r: ca.issue(r, dns=[f"{r}.replicas.internal"], client=True) for r in ("cp-1", "cp-2", "cp-3")}
    envoy = ca.issue("envoy", dns=["envoy.internal"], client=True)
    allow = [{"identity": "dns:envoy.internal", "node_ids": ["envoy-*"]}]
    p1, p2, p3 = free_port(), free_port(), free_port()

    def cfg(port: int, rid: str, peer: int, peer_id: str):
        return parse_config({
            "xds": {"listen": f"127.0.0.1:{port}", "replica_id": rid}, "admin": {"listen": f"127.0.0.1:{free_port()}"},
            "tls": {"mode": "mtls", "cert_file": server.cert, "key_file": server.key, "client_ca_file": ca.cert,
                    "node_allow": allow},
            "lrs": {"peers": [{"address": f"127.0.0.1:{peer}", "replica_id": peer_id,
                               "identity": f"dns:{peer_id}.replicas.internal"}], "peer_tls": {
                "mode": "mtls", "ca_file": ca.cert, "cert_file": cert[rid].cert, "key_file": cert[rid].key}},
            "clusters": [{"name": "llm", "nodes": [{"id": "gpu-a", "address": "127.0.0.1:9001",
                                                     "probe_address": "127.0.0.1:9101"}]}]})

    cps = [ControlPlane(cfg(p1, "cp-1", p2, "cp-2"), probe_sources=InMemoryProbes()),
           ControlPlane(cfg(p2, "cp-2", p1, "cp-1"), probe_sources=InMemoryProbes()),
           ControlPlane(cfg(p3, "cp-3", p2, "cp-2"), probe_sources=InMemoryProbes())]  # not one of cp-2's peers
    for cp in cps:
        await cp.start()
    try:
        a, b, c = cps
        await wait_for(lambda: a.load.peers.links[0].up and b.load.peers.links[0].up, 10, what="cp-1 <-> cp-2 up")
        await wait_for(lambda: "PERMISSION_DENIED" in c.load.peers.links[0].last_error, 10,
                       what="cp-3 refused by cp-2's lrs.peers")
        assert not c.load.peers.links[0].up and b.load.aggregator.problems["peer_refused"] >= 1
        async with dial(f"127.0.0.1:{p1}", tls=ClientTls(ca.cert, envoy.cert, envoy.key)) as ch:
            call = ch.stream_stream(LRS_METHOD)()
            await call.write(_report(0, "envoy-1"))
            await asyncio.wait_for(call.read(), 10)
            await call.write(_report(5))
            await wait_for(lambda: ("llm", "gpu-a") in b.load.aggregator.totals, 5, what="cp-2 got the report")
            assert b.load.aggregator.totals[("llm", "gpu-a")] == a.load.aggregator.totals[("llm", "gpu-a")]
            assert a.load.aggregator.totals[("llm", "gpu-a")].issued == 5
            call.cancel()
    finally:
        for cp in reversed(cps):
            await cp.stop()
