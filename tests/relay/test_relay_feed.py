"""The relay's routing-feed client against a real grpc.aio server: snapshot, changes, and a
reconnect (with a fresh snapshot) after the server drops the stream."""
from __future__ import annotations

import asyncio

import grpc

from sentinel_relay.feed import FeedClient
from xds_server.proto import routing_pb2, routing_pb2_grpc


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
