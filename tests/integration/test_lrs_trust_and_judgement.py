"""Who may send load reports, in-process over real gRPC: a forwarded stream is accepted only as
the listed peer replica it claims to be (its certificate identity under mTLS, its host in
plaintext), a peer stream cannot invent Envoys past ``lrs.peer_max_envoys`` nor flood, a
plaintext port off loopback takes no reports without ``lrs.plaintext``, and with
``lrs.traffic_ejection.min_reporters: 2`` one reporter's errors eject nothing while two do;
silent agents whose engines keep serving stay routed when nothing else would be.
Every refusal answers PERMISSION_DENIED and is counted and logged per identity. And how reports
are judged when every node fails alike: no ejection, one ``cluster_failure`` shown in
``/clusters``, ``/nodes`` and ``xds-server status``, cleared when the failures stop."""
from __future__ import annotations

import asyncio

import aiohttp
import grpc
from envoy.service.load_stats.v3 import lrs_pb2

from xds_server.admin.status_text import format_status
from xds_server.config import parse_config
from xds_server.health import model as hm
from xds_server.health.records import ROUTED_STATES
from xds_server.load.peers import MARKER
from xds_server.load.service import LoadReportingService
from xds_server.probing.memory import InMemoryProbes
from xds_server.process.clock import ManualClock
from xds_server.process.tls import ClientTls, dial
from xds_server.server import ControlPlane
from xds_server.testing import TestCA, free_port, wait_for
from xds_server.testing._fault_rig import prometheus_value

LRS = "/envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats"
NODES = {"n0": 8001, "n1": 8002, "n2": 8003, "n3": 8004}


def _config(**over) -> dict:
    cfg = {
        "xds": {"listen": "127.0.0.1:0", "replica_id": "cp-1", "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"ramp_start_percent": 100},
        "clusters": [{"name": "llm", "nodes": [
            {"id": nid, "address": f"127.0.0.1:{port}", "probe_address": f"127.0.0.1:{port + 1000}"}
            for nid, port in NODES.items()]}],
    }
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return cfg


def _request(node_id: str = "", marker: str | None = None, **outcomes: tuple[int, int]) -> bytes:
    """A LoadStatsRequest: ``node.id``, the forwarded marker, and per node (succeeded, errored)."""
    req = lrs_pb2.LoadStatsRequest()
    if node_id:
        req.node.id = node_id
    if marker is not None:
        req.node.metadata.fields[MARKER].string_value = marker
    if outcomes:
        loc = req.cluster_stats.add(cluster_name="llm").upstream_locality_stats.add()
        for nid, (ok, bad) in outcomes.items():
            ep = loc.upstream_endpoint_stats.add(total_issued_requests=ok + bad, total_successful_requests=ok,
                                                 total_error_requests=bad)
            ep.address.socket_address.address, ep.address.socket_address.port_value = "127.0.0.1", NODES[nid]
    return req.SerializeToString()


async def _open(ch: grpc.aio.Channel, first: bytes, then: list[bytes] = ()) -> grpc.StatusCode | grpc.aio.Call:
    """Write ``first`` and ``then`` back to back, as a client that does not wait; the status code
    of a refusal, or the open call once the LoadStatsResponse came."""
    call = ch.stream_stream(LRS)()
    try:
        for raw in (first, *then):
            await call.write(raw)
        await asyncio.wait_for(call.read(), 10)
        return call
    except grpc.aio.AioRpcError as e:
        return e.code()
    except asyncio.InvalidStateError:  # a write after the refusal came: the refusal's own status
        return await call.code()


async def _metrics(cp: ControlPlane) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{cp.admin_port}/metrics") as r:
        return await r.text()


async def test_an_envoy_certificate_carrying_the_replica_marker_is_refused_and_applies_nothing(tmp_path):
    ca = TestCA(tmp_path)
    server = ca.issue("xds", dns=["localhost"], ips=["127.0.0.1"])
    envoy = ca.issue("envoy", dns=["envoy-llm.internal"], client=True)
    replica = ca.issue("cp-2", dns=["cp-2.replicas.internal"], client=True)
    cfg = _config(tls={"mode": "mtls", "cert_file": server.cert, "key_file": server.key, "client_ca_file": ca.cert,
                       "node_allow": [{"identity": "dns:envoy-llm.internal", "node_ids": ["envoy-llm-*"]}]},
                  lrs={"peers": [{"address": f"127.0.0.1:{free_port()}", "replica_id": "cp-2",
                                  "identity": "dns:cp-2.replicas.internal"}]})
    cp = ControlPlane(parse_config(cfg), probe_sources=InMemoryProbes())
    await cp.start()
    try:
        target = f"127.0.0.1:{cp.xds_port}"
        forged = [_request(f"envoy-invented-{i}", "cp-2", n2=(0, 1)) for i in range(400)]
        async with dial(target, tls=ClientTls(ca.cert, envoy.cert, envoy.key, "localhost")) as ch:
            # the Envoy's own certificate with the replica's marker, and 400 invented Envoys behind it
            assert await _open(ch, _request("envoy-llm-gw-2", "cp-2"), forged) is grpc.StatusCode.PERMISSION_DENIED
            # the marker naming this replica's peer by another id, or no peer at all: the same
            assert await _open(ch, _request("envoy-llm-gw-2", "nobody")) is grpc.StatusCode.PERMISSION_DENIED
            # the same certificate as the Envoy it is: accepted
            call = await _open(ch, _request("envoy-llm-gw-2"))
            assert not isinstance(call, grpc.StatusCode)
            call.cancel()
        async with dial(target, tls=ClientTls(ca.cert, replica.cert, replica.key, "localhost")) as ch:
            call = await _open(ch, _request("cp-2", "cp-2"))  # the peer's certificate: accepted
            assert not isinstance(call, grpc.StatusCode)
            call.cancel()
        agg = cp.load.aggregator
        assert agg.reports == 0 and not agg.totals and agg.problems["peer_refused"] == 2
        assert not cp.load.peers.received  # no report credited to the replica it claimed to be
        text = await _metrics(cp)
        assert prometheus_value(text, "sentinel_access_refused_total", port="xds", reason="lrs_peer") == 2
    finally:
        await cp.stop()


async def test_a_plaintext_marker_must_name_a_listed_peer_connecting_from_its_host():
    cfg = _config(lrs={"peers": [{"address": f"127.0.0.1:{free_port()}", "replica_id": "cp-2"},
                                 {"address": f"127.0.0.2:{free_port()}", "replica_id": "cp-3"},
                                 f"127.0.0.1:{free_port()}"],  # the older form: no replica_id
                       "peer_max_envoys": 8})
    cp = ControlPlane(parse_config(cfg), probe_sources=InMemoryProbes())
    await cp.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            for marker in ("nobody", "cp-3", "cp-1"):  # unlisted; listed on 127.0.0.2; this replica's own
                assert await _open(ch, _request(marker, marker)) is grpc.StatusCode.PERMISSION_DENIED, marker
            call = await _open(ch, _request("cp-2", "cp-2"))
            assert not isinstance(call, grpc.StatusCode)
            # the listed peer names 20 Envoys: the first 8 count, the rest are refused and counted
            for i in range(20):
                await call.write(_request(f"envoy-{i}", "cp-2", n0=(1, 0)))
            # the same Envoy again at once, as a flood: not applied
            await call.write(_request("envoy-0", "cp-2", n0=(1, 0)))
            agg = cp.load.aggregator
            await wait_for(lambda: agg.problems["peer_too_many_reporters"] == 12 and agg.problems["flood"] == 1, 5,
                           what="12 Envoys past the bound and 1 flood counted")
            assert agg.totals[("llm", "n0")].succeeded == 8 and agg.reporters(cp.clock.now()) == 8
            call.cancel()
        assert agg.problems["peer_refused"] == 3
        text = await _metrics(cp)
        assert prometheus_value(text, "sentinel_access_refused_total", port="xds", reason="lrs_peer") == 3
    finally:
        await cp.stop()


async def _served(service: LoadReportingService) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    service.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def test_plaintext_off_loopback_takes_load_reports_only_when_said():
    # xds.listen off loopback in plaintext (the service reads the address from its config; the
    # test serves it on 127.0.0.1)
    for said in (False, True):
        cfg = parse_config(_config(xds={"listen": "0.0.0.0:18000"}, tls={"mode": "plaintext"},
                                   lrs={"plaintext": said}))
        service = LoadReportingService(lambda cfg=cfg: cfg)
        server, port = await _served(service)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = ch.stream_stream(LRS)()
                await call.write(_request("envoy-1"))
                if said:
                    await asyncio.wait_for(call.read(), 10)
                    await call.write(_request(n2=(0, 10)))
                    await wait_for(lambda s=service: s.aggregator.reports == 1, 5, what="the report applied")
                    call.cancel()
                    continue
                try:
                    await asyncio.wait_for(call.read(), 10)
                    raise AssertionError("a load-report stream was accepted off loopback without lrs.plaintext")
                except grpc.aio.AioRpcError as e:
                    assert e.code() is grpc.StatusCode.PERMISSION_DENIED and "lrs.plaintext" in (e.details() or "")
                assert service.aggregator.reports == 0 and service.aggregator.problems["plaintext_refused"] == 1
        finally:
            await server.stop(0)


def _routed(probes: InMemoryProbes, clock: ManualClock, seconds: float) -> None:
    """Every node's first heartbeat and good probe, then ``seconds`` of heartbeats on time."""
    for nid in NODES:
        probes[nid].heartbeat()
        probes[nid].probe(ttft_ms=20.0)
    _beat(probes, clock, seconds)


def _beat(probes: InMemoryProbes, clock: ManualClock, seconds: float) -> None:
    """``seconds`` pass with every node's heartbeat on time (every 100 ms)."""
    for _ in range(round(seconds / 0.1)):
        clock.advance(0.1)
        for nid in NODES:
            probes[nid].heartbeat()


async def test_one_reporters_errors_eject_nothing_with_min_reporters_two_and_two_reporters_eject():
    for min_reporters in (1, 2):
        probes, clock = InMemoryProbes(), ManualClock()
        cfg = _config(lrs={"traffic_ejection": {"min_requests": 4, "min_reporters": min_reporters}})
        cp = ControlPlane(parse_config(cfg), clock=clock, probe_sources=probes)
        await cp.start()
        try:
            _routed(probes, clock, 5.0)  # evidence counts from when a node entered its state
            assert all(cp.core.health[n].state in ROUTED_STATES for n in NODES)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
                forger = await _open(ch, _request("envoy-forger"))
                await forger.write(_request(n0=(20, 0), n1=(20, 0), n2=(0, 20)))
                await wait_for(lambda cp=cp: cp.load.aggregator.reports == 1, 5, what="the forged report applied")
                n2 = cp.core.health["n2"]
                if min_reporters == 1:  # one reporter is enough evidence: ejected (the default)
                    assert n2.state.name == "UNHEALTHY" and "failures seen by envoy-forger" in n2.reason
                    continue
                assert n2.state in ROUTED_STATES
                assert "min_reporters 2" in cp.load.ejector.held["n2"]
                # a second reporter sees n2 fail too: now it is ejected, the reason naming both
                _beat(probes, clock, 1.0)  # past the flood gap
                second = await _open(ch, _request("envoy-2"))
                await second.write(_request(n0=(5, 0), n1=(5, 0), n2=(1, 4)))
                await wait_for(lambda cp=cp: cp.core.health["n2"].state.name == "UNHEALTHY", 5, what="n2 ejected")
                assert "failures seen by envoy-2, envoy-forger" in cp.core.health["n2"].reason
                assert all(cp.core.health[n].state in ROUTED_STATES for n in ("n0", "n1"))
        finally:
            await cp.stop()


async def test_every_node_failing_alike_ejects_none_and_raises_one_cluster_failure_until_it_clears():
    probes, clock = InMemoryProbes(), ManualClock()
    cp = ControlPlane(parse_config(_config(lrs={"traffic_ejection": {"window_s": 3.0}})), clock=clock,
                      probe_sources=probes)
    await cp.start()
    try:
        _routed(probes, clock, 5.0)
        admin = f"http://127.0.0.1:{cp.admin_port}"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch, aiohttp.ClientSession() as http:
            envoy = await _open(ch, _request("envoy-1"))
            # a query of death: every node fails the long prompts, ~65 % of the traffic
            await envoy.write(_request(n0=(7, 13), n1=(7, 13), n2=(6, 14)))
            await wait_for(lambda: cp.load.aggregator.reports == 1, 5, what="the report applied")
            assert all(cp.core.health[n].state in ROUTED_STATES for n in NODES)
            kinds = [e.kind for e in cp.core.events.recent(100)]
            assert kinds.count("cluster_failure") == 1 and "traffic_held_back" not in kinds
            async with http.get(f"{admin}/clusters") as r:
                (llm,) = [c for c in (await r.json())["clusters"] if c["name"] == "llm"]
            (scope,) = llm["traffic"]["cluster_failure"]["scopes"]
            assert (scope["scope"], scope["failing_nodes"], scope["nodes"]) == ("cluster", 3, 3)
            async with http.get(f"{admin}/nodes") as r:
                lines = format_status(await r.json())
            assert lines[0].startswith("CLUSTER FAILURE in llm: 3 of 3 nodes with traffic in the cluster fail "
                                       "real requests alike (67 %")
            # the same failures again: still one event; then the window passes clean: cleared
            _beat(probes, clock, 1.0)
            await envoy.write(_request(n0=(7, 13), n1=(7, 13), n2=(6, 14)))
            await wait_for(lambda: cp.load.aggregator.reports == 2, 5, what="the second report")
            _beat(probes, clock, 4.0)
            await envoy.write(_request(n0=(20, 0), n1=(20, 0), n2=(20, 0)))
            await wait_for(lambda: cp.load.aggregator.reports == 3, 5, what="the clean report")
            kinds = [e.kind for e in cp.core.events.recent(100)]
            assert kinds.count("cluster_failure") == 1 and kinds.count("cluster_failure_cleared") == 1
            async with http.get(f"{admin}/nodes") as r:
                assert not (await r.json())["cluster_failures"]
            envoy.cancel()
    finally:
        await cp.stop()


async def test_silent_survivors_whose_traffic_succeeds_stay_routed_until_their_traffic_stops():
    # four nodes: two out for failed probes; the two survivors' agents go silent while their
    # engines keep serving (2 of 4 silent: not the fleet-wide fail-static's "more than half")
    probes, clock = InMemoryProbes(), ManualClock()
    cp = ControlPlane(parse_config(_config()), clock=clock, probe_sources=probes)
    await cp.start()
    try:
        _routed(probes, clock, 2.0)
        for _ in range(5):
            for nid in ("n0", "n1"):
                probes[nid].probe(kind=hm.ProbeResultKind.HTTP_STATUS, http_status=503)
        assert [cp.core.health[n].state.name for n in NODES] == ["UNHEALTHY", "UNHEALTHY", "HEALTHY", "HEALTHY"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            envoy = await _open(ch, _request("envoy-1"))
            await envoy.write(_request(n2=(12, 0), n3=(12, 0)))
            await wait_for(lambda: cp.load.aggregator.reports == 1, 5, what="the report applied")
            for _ in range(10):  # 1 s: n2 and n3 silent, n0 and n1 still beating (probes failing)
                clock.advance(0.1)
                for nid in ("n0", "n1"):
                    probes[nid].heartbeat()
            assert cp.core.health["n2"].state.name == cp.core.health["n3"].state.name == "UNHEALTHY"
            await wait_for(lambda: cp.core.planner.kept_silent.get("llm") == ("n2", "n3"), 5, what="n2, n3 kept")
            assert [cp.view.node(n)["eds_health_status"] for n in NODES] == ["UNHEALTHY", "UNHEALTHY", "HEALTHY",
                                                                            "HEALTHY"]
            # n3's host froze: its requests stop completing; n2 keeps serving
            for _ in range(20):
                clock.advance(0.1)
                for nid in ("n0", "n1"):
                    probes[nid].heartbeat()
            await envoy.write(_request(n2=(12, 0)))
            await wait_for(lambda: cp.load.aggregator.reports == 2, 5, what="the second report applied")
            clock.advance(0.1)  # the coalesced publish
            assert cp.core.planner.kept_silent.get("llm") == ("n2",)
            assert cp.view.node("n3")["eds_health_status"] == "UNHEALTHY"
            kinds = [(e.node_id, e.kind) for e in cp.core.events.recent(200) if e.kind.startswith("fail_static_kept")]
            assert kinds == [("n2", "fail_static_kept"), ("n3", "fail_static_kept"), ("n3", "fail_static_kept_ended")]
            envoy.cancel()
    finally:
        await cp.stop()
