"""The routing feed (xds_server/feed/service.py) against a real control plane.

- With a simulated fleet (xds_server.testing: engines, agents, xds-server processes, Envoy): the
  snapshot is right, a frozen node's UNHEALTHY arrives within a few hundred ms of its ejection
  (printed with -s), and a reconnecting client gets a fresh snapshot.
- In-process (control plane, agents and engines in this process): a drained node arrives as
  DRAINING and back; changes queued together go out in one update; a subscriber more than the
  queue limit behind is dropped with RESOURCE_EXHAUSTED and reconnects to a fresh snapshot.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
import pytest
from aiohttp import web

from node_probe.agent import AgentConfig, ProbeAgent
from node_probe.sim import SimConfig, build_app
from xds_server.config import parse_config
from xds_server.feed.events import RoutingChange
from xds_server.feed.service import DEFAULT_QUEUE_LIMIT
from xds_server.proto import routing_pb2, routing_pb2_grpc
from xds_server.server import ControlPlane
from xds_server.testing import free_port


class FeedClient:
    """A subscriber: one Watch stream, updates collected with their arrival wall time."""

    def __init__(self, port: int, clusters: tuple[str, ...] = (), name: str = "test") -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.call = routing_pb2_grpc.RoutingFeedStub(self.channel).Watch(
            routing_pb2.WatchRequest(subscriber_id=name, clusters=list(clusters)))

    async def next(self, timeout_s: float = 5.0) -> tuple[float, routing_pb2.RoutingUpdate]:
        upd = await asyncio.wait_for(self.call.read(), timeout_s)
        assert upd is not grpc.aio.EOF
        return time.time(), upd

    async def until(self, pred, timeout_s: float = 10.0) -> tuple[float, routing_pb2.NodeRouting]:
        """Read updates until a node matches ``pred``; (arrival wall time, that node)."""
        end = time.monotonic() + timeout_s
        while True:
            at, upd = await self.next(max(0.01, end - time.monotonic()))
            for n in upd.nodes:
                if pred(n):
                    return at, n

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


# ------------------------------------------------------------------------ real fleet
# Fast ramp; no outlier ejection (a loaded CI machine makes one node's RTT an outlier).
FAST = {"probation": {"clean": "1.5s", "ramp_step_percent": 50, "ramp_step": "250ms"},
        "outlier": {"min_gap_rtt": "5s", "min_gap_ttft": "5s"}}


@pytest.mark.envoy
async def test_feed_snapshot_frozen_node_and_reconnect(make_fleet, http):
    fleet = make_fleet(n_nodes=3, health=FAST)
    await fleet.wait_all_routed(http)
    client = FeedClient(fleet.xds_port, ("llm",))
    try:
        _, snap = await client.next()
        assert snap.snapshot
        nodes = {n.node_id: n for n in snap.nodes}
        assert set(nodes) == {"gpu-a", "gpu-b", "gpu-c"}
        cp_nodes = await fleet.cp_nodes(http)
        for nid, n in nodes.items():
            assert n.address == fleet.node(nid).address and n.cluster == "llm"
            assert n.eds_version == cp_nodes[nid]["xds_version"] != ""
            assert n.eds_health_status == cp_nodes[nid]["eds_health_status"] == "HEALTHY"
            assert n.routable and n.weight >= 1 and n.published_unix_s > 0

        node = fleet.node("gpu-a")
        t_freeze = time.time()
        node.engine.freeze()
        node.agent.freeze()
        try:
            at, a = await client.until(lambda n: n.node_id == "gpu-a" and n.state == "UNHEALTHY")
            async with http.get(f"http://127.0.0.1:{fleet.admin_port}/events") as r:
                events = (await r.json())["events"]
            ejected = [e for e in events if e["node"] == "gpu-a" and e["to"] == "UNHEALTHY"]
            delivery_ms = (at - ejected[0]["time"]) * 1000
            print(f"\nfeed: gpu-a UNHEALTHY {delivery_ms:.0f} ms after its ejection event, "
                  f"{(at - a.published_unix_s) * 1000:.0f} ms after publish, "
                  f"{(at - t_freeze) * 1000:.0f} ms after the freeze ({a.reason})")
            assert not a.routable and a.eds_health_status == "UNHEALTHY"
            assert a.address == node.address and a.eds_version != nodes["gpu-a"].eds_version
            assert 0 <= delivery_ms < 300
            assert at - t_freeze < 2.0

            # A reconnecting subscriber gets a fresh snapshot with the current routing.
            await client.close()
            client = FeedClient(fleet.xds_port, name="again")
            _, snap2 = await client.next()
            again = {n.node_id: n for n in snap2.nodes}
            assert snap2.snapshot and set(again) == set(nodes)
            assert again["gpu-a"].state == "UNHEALTHY" and not again["gpu-a"].routable
            assert again["gpu-b"].routable
        finally:
            node.agent.thaw()
            node.engine.thaw()
    finally:
        await client.close()


# ------------------------------------------------------------------------ in process
@pytest.fixture
async def stack():
    """Two engines + two agents + a control plane (admin token set), all in this process."""
    cleanups = []
    nodes = []
    for nid in ("n1", "n2"):
        port = free_port()
        runner = web.AppRunner(build_app(SimConfig(port=port, replica_id=nid,
                                                   token_interval_ms=5)))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        cleanups.append(runner.cleanup)
        agent = ProbeAgent(AgentConfig(engine_url=f"http://127.0.0.1:{port}",
                                       listen="127.0.0.1:0", node_id=nid, probe_interval_s=0.2,
                                       gpu_interval_s=0))
        aport = await agent.start()
        cleanups.insert(0, agent.stop)
        nodes.append({"id": nid, "address": f"127.0.0.1:{port}",
                      "probe_address": f"127.0.0.1:{aport}"})
    cp = ControlPlane(parse_config({
        "xds": {"listen": "127.0.0.1:0"},
        "admin": {"listen": "127.0.0.1:0", "token": "s3cret"},
        "health": {"ping_interval_ms": 100, "ramp_step_percent": 50, "ramp_step_s": 0.2,
                   "probation_clean_s": 1.0},
        "clusters": [{"name": "llm", "nodes": nodes}]}))
    await cp.start()
    http = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{cp.admin_port}",
                                 headers={"Authorization": "Bearer s3cret"})
    try:
        yield cp, http
    finally:
        await http.close()
        await cp.stop()
        for c in cleanups:
            await c()


async def wait_healthy(client: FeedClient) -> None:
    """Read the snapshot, then updates until both nodes are HEALTHY (no more ramp changes)."""
    _, snap = await client.next()
    assert snap.snapshot and {n.node_id for n in snap.nodes} == {"n1", "n2"}
    state = {n.node_id: n.state for n in snap.nodes}
    while set(state.values()) != {"HEALTHY"}:
        _, upd = await client.next(10.0)
        state.update({n.node_id: n.state for n in upd.nodes})


async def test_drained_node_arrives_as_draining(stack):
    cp, http = stack
    client = FeedClient(cp.xds_port)
    try:
        await wait_healthy(client)
        async with http.post("/nodes/n1/drain?reason=maintenance") as r:
            assert r.status == 200
        _, n1 = await client.until(lambda n: n.node_id == "n1")
        assert n1.state == "DRAINING" and n1.eds_health_status == "DRAINING" and not n1.routable
        async with http.post("/nodes/n1/undrain") as r:
            assert r.status == 200
        _, n1 = await client.until(lambda n: n.node_id == "n1")
        assert n1.state == "HEALTHY" and n1.routable
        async with http.get("/metrics") as r:
            text = await r.text()
        assert "sentinel_routing_feed_subscribers 1.0" in text
    finally:
        await client.close()


def _change(node_id: str, state: str, version: str) -> RoutingChange:
    return RoutingChange(node_id, "llm", "127.0.0.1:1", state == "HEALTHY", state,
                         "HEALTHY" if state == "HEALTHY" else "UNHEALTHY", 100, "test", version,
                         time.time())


async def test_changes_batch_and_slow_subscriber_is_dropped(stack):
    cp, _ = stack
    slow = FeedClient(cp.xds_port, name="slow")
    fast = FeedClient(cp.xds_port, name="fast")
    try:
        await wait_healthy(slow)
        await wait_healthy(fast)
        # Changes published in one step of the loop go out as one update, in order.
        for i, state in enumerate(("UNHEALTHY", "HEALTHY", "UNHEALTHY")):
            for listener in cp.routing_listeners:
                listener(_change("n1", state, f"v{i}"))
        _, upd = await fast.next()
        assert not upd.snapshot
        assert [(n.state, n.eds_version) for n in upd.nodes] == [
            ("UNHEALTHY", "v0"), ("HEALTHY", "v1"), ("UNHEALTHY", "v2")]
        # More than the queue limit at once: the subscriber is dropped, not the control plane.
        for i in range(DEFAULT_QUEUE_LIMIT + 1):
            for listener in cp.routing_listeners:
                listener(_change("n2", "HEALTHY" if i % 2 else "UNHEALTHY", f"w{i}"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                await slow.next()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert cp.routing_feed.dropped_total == 2  # both were behind by the limit + 1
        # A reconnect gets a snapshot holding the last change.
        again = FeedClient(cp.xds_port, name="again")
        _, snap = await again.next()
        await again.close()
        n2 = {n.node_id: n for n in snap.nodes}["n2"]
        assert snap.snapshot and (n2.state, n2.reason) == ("UNHEALTHY", "test")  # the last one
    finally:
        await slow.close()
        await fast.close()


async def test_unknown_cluster_is_invalid_argument(stack):
    cp, _ = stack
    client = FeedClient(cp.xds_port, ("llm", "nope"))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.next()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "clusters" in err.value.details() and "nope" in err.value.details()
    finally:
        await client.close()
