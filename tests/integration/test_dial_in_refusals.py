"""What the probe hub answers a dialling client that is not a well-behaved agent, on a real
control plane's xDS port: the status a grpcio client reads, the counts, and that the control plane
keeps serving the nodes that are fine."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from node_probe.proto import probe_pb2, probe_pb2_grpc
from xds_server.config import parse_config
from xds_server.server import ControlPlane
from xds_server.testing import free_port, wait_for


@pytest.fixture
async def cp() -> AsyncIterator[ControlPlane]:
    port = free_port()
    plane = ControlPlane(parse_config({
        "xds": {"listen": f"127.0.0.1:{port}"}, "admin": {"listen": "127.0.0.1:0"},
        "probe": {"dial_in": {"register_timeout": "300ms"}},
        "clusters": [{"name": "llm", "nodes": [{"id": "gpu-a", "address": "127.0.0.1:8001"},
                                               {"id": "old", "address": "127.0.0.1:8002",
                                                "probe_address": "127.0.0.1:9"}]}]}))
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()


async def _status(port: int, *first: probe_pb2.AgentMessage, linger_s: float = 0.0) -> tuple[grpc.StatusCode, str]:
    """Open a Connect stream, write ``first`` (then wait ``linger_s`` saying nothing), read to the end."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = probe_pb2_grpc.ProbeHubStub(ch).Connect()
        for m in first:
            await call.write(m)
        if linger_s:
            await asyncio.sleep(linger_s)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        return await call.code(), await call.details()


def _reg(**kw: object) -> probe_pb2.AgentMessage:
    return probe_pb2.AgentMessage(register=probe_pb2.Register(**kw))  # type: ignore[arg-type]  # kw: proto fields


async def test_a_client_that_says_nothing_or_not_a_register_first_is_ended_and_counted(cp: ControlPlane):
    code, details = await _status(cp.xds_port, linger_s=0.6)
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED and "no Register within 300ms" in details
    code, details = await _status(cp.xds_port, probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=1)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "must be a Register" in details
    code, details = await _status(cp.xds_port, _reg(node_id="bad id!"))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("register.node_id")
    assert cp.counters.malformed["(agent stream)"] == 3


async def test_claims_the_config_does_not_allow_are_refused_with_the_reason(cp: ControlPlane):
    code, details = await _status(cp.xds_port, _reg(node_id="gpu-a", address="127.0.0.1:9999"))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "the config wins" in details
    code, details = await _status(cp.xds_port, _reg(node_id="old"))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "probe_address" in details
    code, details = await _status(cp.xds_port, _reg(node_id="new-1", cluster="llm", address="127.0.0.1:8003"))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "takes no registrations" in details
    assert cp.refusals.counts[("xds", "agent_claim")] == 3 and cp.hub.refused == 3
    assert "new-1" not in cp.sessions and not cp.sessions["gpu-a"].connected


async def test_a_second_stream_from_the_same_agent_replaces_the_first_without_a_verdict(cp: ControlPlane):
    beat = probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(
        seq=1, interval_ms=100, node_id="gpu-a", liveness=probe_pb2.LIVENESS_TRANSPORT,
        telemetry=probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY)))
    session = cp.sessions["gpu-a"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as a, \
            grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as b:
        first = probe_pb2_grpc.ProbeHubStub(a).Connect()
        await first.write(_reg(node_id="gpu-a"))
        await first.write(beat)
        await wait_for(lambda: session.connected, timeout_s=5)
        second = probe_pb2_grpc.ProbeHubStub(b).Connect()
        await second.write(_reg(node_id="gpu-a"))
        await second.write(beat)
        async for _ in first:  # the first stream is ended by the control plane (status OK)
            pass
        assert await first.code() is grpc.StatusCode.OK
        await wait_for(lambda: session.connected, timeout_s=5)
        assert session.streams_replaced == 1
        hb = cp.core.health["gpu-a"].heartbeat
        assert hb.consecutive_misses == 0 and not hb.stream_closed and hb.vouched
        second.cancel()
