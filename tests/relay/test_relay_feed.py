"""The relay's routing-feed client against a real grpc.aio server: snapshot, changes, and a
reconnect (with a fresh snapshot) after the server drops the stream; against a real control
plane that freezes: the keepalive drops the stream and the client redials."""
from __future__ import annotations

import asyncio
import sys
import time

import grpc
import yaml

from sentinel_relay.feed import FeedClient
from xds_server.proto import routing_pb2, routing_pb2_grpc
from xds_server.testing import ManagedProcess, free_port, wait_for


class Feed(routing_pb2_grpc.RoutingFeedServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def Watch(self, request, context):
        self.calls += 1
        nodes = [routing_pb2.NodeRouting(node_id="a", address="10.0.0.1:8000", routable=True, state="HEALTHY"),
                 routing_pb2.NodeRouting(node_id="b", address="10.0.0.2:8000", routable=True, state="HEALTHY")]
        yield routing_pb2.RoutingUpdate(snapshot=True, nodes=nodes)
        if self.calls == 1:
            yield routing_pb2.RoutingUpdate(nodes=[routing_pb2.NodeRouting(
                node_id="b", address="10.0.0.2:8000", routable=False, state="UNHEALTHY", reason="test")])
            await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")  # the client must reconnect
        await asyncio.sleep(30)


async def test_feed_client_snapshot_changes_and_reconnect():
    server = grpc.aio.server()
    feed = Feed()
    routing_pb2_grpc.add_RoutingFeedServicer_to_server(feed, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    seen: list[tuple[str, str, bool]] = []
    up: list[bool] = []
    client = FeedClient(f"127.0.0.1:{port}", lambda n, snap: seen.append((n.node_id, n.state, snap)),
                        reconnect_max_s=0.2, on_connected=up.append)
    client.start()
    try:
        for _ in range(100):
            if feed.calls >= 2 and len(seen) >= 5:
                break
            await asyncio.sleep(0.05)
        assert seen[:3] == [("a", "HEALTHY", True), ("b", "HEALTHY", True), ("b", "UNHEALTHY", False)]
        assert seen[3:5] == [("a", "HEALTHY", True), ("b", "HEALTHY", True)]  # fresh snapshot
        assert up[:3] == [True, False, True]
        assert client.nodes["b"].state == "HEALTHY"
    finally:
        await client.stop()
        await server.stop(0)


async def test_feed_from_a_frozen_control_plane_is_dropped_and_redialled(tmp_path):
    """A real ``xds-server serve`` feeds the client; idle pings every 1 s do not end the stream
    (the server accepts them); SIGSTOP (no FIN, no RST) is noticed by the keepalive within ~2 s
    and the client redials, getting a fresh snapshot after SIGCONT."""
    xds_port, admin_port = free_port(), free_port()
    cfg = {"xds": {"listen": f"127.0.0.1:{xds_port}", "warmup_timeout_ms": 0},
           "admin": {"listen": f"127.0.0.1:{admin_port}"},
           "clusters": [{"name": "llm", "nodes": [{"id": "a", "address": "127.0.0.1:8001",
                                                    "probe_address": f"127.0.0.1:{free_port()}"}]}]}
    (tmp_path / "xds.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    cp = ManagedProcess("xds-server", [sys.executable, "-m", "xds_server.cli", "serve", str(tmp_path / "xds.yaml")],
                        tmp_path / "xds.log", ready_pattern="admin listening")
    up: list[tuple[float, bool]] = []
    snapshots: list[float] = []
    client = FeedClient(f"127.0.0.1:{xds_port}", lambda n, snap: snapshots.append(time.monotonic()) if snap else None,
                        reconnect_max_s=0.5, keepalive_s=1.0,
                        on_connected=lambda u: up.append((time.monotonic(), u)))
    try:
        cp.start()
        client.start()
        await wait_for(lambda: up and up[-1][1], timeout_s=10.0)
        await asyncio.sleep(3.5)  # idle: pings only
        assert [u for _, u in up] == [True], up  # no GOAWAY for pinging too often
        t0 = time.monotonic()
        cp.freeze()
        await wait_for(lambda: not up[-1][1], timeout_s=10.0, step_s=0.05)
        dropped_s = up[-1][0] - t0
        cp.thaw()
        n = len(snapshots)
        await wait_for(lambda: len(snapshots) > n and up[-1][1], timeout_s=10.0)
    finally:
        await client.stop()
        cp.stop()
    print(f"\nfeed dropped {dropped_s:.2f} s after the control plane froze")
    assert dropped_s <= 3.0, dropped_s  # a PING each 1 s (+-15 % jitter), 1 s to answer


class OneSnapshot(routing_pb2_grpc.RoutingFeedServicer):
    """A replica's feed: one snapshot with node "a" in ``state``, then it holds the stream."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.calls = 0

    async def Watch(self, request, context):
        self.calls += 1
        yield routing_pb2.RoutingUpdate(snapshot=True, nodes=[routing_pb2.NodeRouting(
            node_id="a", address="10.0.0.1:8000", routable=self.state == "HEALTHY", state=self.state)])
        await asyncio.sleep(30)


async def test_feed_client_moves_to_the_next_replica_when_its_feed_ends():
    servers, feeds, targets = [], [OneSnapshot("HEALTHY"), OneSnapshot("UNHEALTHY")], []
    for f in feeds:
        s = grpc.aio.server()
        routing_pb2_grpc.add_RoutingFeedServicer_to_server(f, s)
        targets.append(f"127.0.0.1:{s.add_insecure_port('127.0.0.1:0')}")
        await s.start()
        servers.append(s)
    seen: list[tuple[str, bool]] = []
    client = FeedClient(targets, lambda n, snap: seen.append((n.state, snap)), reconnect_max_s=0.2)
    client.start()
    try:
        await wait_for(lambda: seen == [("HEALTHY", True)], timeout_s=5.0)
        assert client.target == targets[0] and feeds[1].calls == 0
        await servers[0].stop(0)  # the replica the feed is on goes away
        await wait_for(lambda: len(seen) == 2, timeout_s=5.0)
        assert seen[1] == ("UNHEALTHY", True) and client.target == targets[1]  # the other's snapshot
        assert client.nodes["a"].state == "UNHEALTHY"
    finally:
        await client.stop()
        for s in servers:
            await s.stop(0)
