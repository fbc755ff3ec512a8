"""Scripted ADS clients for protocol tests: :class:`ScriptedAdsClient` (state of the world) and
:class:`ScriptedDeltaAdsClient` (delta), each driving one real gRPC stream."""
from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["ScriptedAdsClient", "ScriptedDeltaAdsClient"]


class ScriptedAdsClient:
    """A scripted SotW ADS client for protocol tests: send requests, read responses, expect silence.

    Example::

        c = ScriptedAdsClient("127.0.0.1:18000")
        await c.open()
        await c.send(type_url=CLUSTER_TYPE_URL, node_id="envoy-1")
        resp = await c.recv()
        await c.send(type_url=CLUSTER_TYPE_URL, version=resp.version_info, nonce=resp.nonce)  # ACK
        await c.expect_silence(0.3)
        await c.close()
    """

    def __init__(self, target: str) -> None:
        import grpc
        from envoy.service.discovery.v3 import ads_pb2_grpc

        self.channel = grpc.aio.insecure_channel(target)
        self.stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)
        self._q: asyncio.Queue[Any] = asyncio.Queue()
        self.call: Any = None

    def _rpc(self) -> Any:
        """The stub method this client drives (SotW here; delta in the subclass)."""
        return self.stub.StreamAggregatedResources

    async def open(self) -> None:
        """Open the stream; one task reads it so a timed-out wait never cancels the RPC itself."""
        import grpc

        async def requests():
            while True:
                item = await self._q.get()
                if item is None:
                    return
                yield item

        self.call = self._rpc()(requests())
        self._responses: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                while True:
                    msg = await self.call.read()
                    if msg is grpc.aio.EOF:  # type: ignore[attr-defined]  # grpc-stubs 1.53 lacks grpc.aio.EOF
                        await self._responses.put(EOFError("stream ended"))
                        return
                    await self._responses.put(msg)
            except grpc.aio.AioRpcError as e:
                await self._responses.put(e)

        self._pump = asyncio.create_task(pump())

    async def send(self, *, type_url: str, names: list[str] | None = None, version: str = "",
                   nonce: str = "", node_id: str | None = None, error: str | None = None) -> None:
        """Send one DiscoveryRequest (``error`` set makes it a NACK)."""
        from envoy.service.discovery.v3 import discovery_pb2
        from google.rpc import status_pb2

        req = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names or [],
                                             version_info=version, response_nonce=nonce)
        if node_id is not None:
            req.node.id = node_id
        if error is not None:
            req.error_detail.CopyFrom(status_pb2.Status(code=13, message=error))
        await self._q.put(req)

    async def recv(self, timeout_s: float = 2.0) -> Any:
        """Next DiscoveryResponse; raises asyncio.TimeoutError after ``timeout_s``, or the
        stream's AioRpcError / EOFError when it ended."""
        item = await asyncio.wait_for(self._responses.get(), timeout_s)
        if isinstance(item, BaseException):
            raise item
        return item

    async def expect_silence(self, duration_s: float) -> None:
        """Raise AssertionError if any response arrives within ``duration_s``."""
        try:
            resp = await asyncio.wait_for(self._responses.get(), duration_s)
        except TimeoutError:
            return
        raise AssertionError(f"expected no response, got {resp}")

    async def close(self) -> None:
        """Cancel the stream and close the channel."""
        await self._q.put(None)
        if self.call is not None:
            self.call.cancel()
            self._pump.cancel()
        await self.channel.close(None)


class ScriptedDeltaAdsClient(ScriptedAdsClient):
    """A scripted delta (incremental) ADS client: the same seam as :class:`ScriptedAdsClient`
    for ``DeltaAggregatedResources``.

    Example::

        c = ScriptedDeltaAdsClient("127.0.0.1:18000")
        await c.open()
        await c.send(type_url=CLUSTER_TYPE_URL, node_id="envoy-1")          # legacy wildcard
        resp = await c.recv()                                                # DeltaDiscoveryResponse
        await c.send(type_url=CLUSTER_TYPE_URL, nonce=resp.nonce)            # ACK
        await c.send(type_url=CLA_TYPE_URL, subscribe=["llm"])
        await c.expect_silence(0.3)
        await c.close()
    """

    def _rpc(self) -> Any:
        return self.stub.DeltaAggregatedResources

    async def send(  # type: ignore[override]  # delta's keywords (subscribe, ...) replace the SotW ones
            self, *, type_url: str, subscribe: list[str] | None = None,
            unsubscribe: list[str] | None = None, initial_versions: dict[str, str] | None = None,
            nonce: str = "", node_id: str | None = None, error: str | None = None) -> None:
        """Send one DeltaDiscoveryRequest (``nonce`` set: an ACK, plus ``error``: a NACK)."""
        from envoy.service.discovery.v3 import discovery_pb2
        from google.rpc import status_pb2

        req = discovery_pb2.DeltaDiscoveryRequest(
            type_url=type_url, resource_names_subscribe=subscribe or [],
            resource_names_unsubscribe=unsubscribe or [], initial_resource_versions=initial_versions or {},
            response_nonce=nonce)
        if node_id is not None:
            req.node.id = node_id
        if error is not None:
            req.error_detail.CopyFrom(status_pb2.Status(code=13, message=error))
        await self._q.put(req)

    async def send_raw(self, req: Any) -> None:
        """Send a prepared DeltaDiscoveryRequest as is."""
        await self._q.put(req)
