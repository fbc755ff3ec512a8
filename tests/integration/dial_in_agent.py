"""A minimal dial-in agent for tests of the control plane's side: real gRPC, the messages a
node_probe agent sends (a Register, one good probe result, a heartbeat every refresh), nothing it
answers. :class:`DialInAgent` runs on the caller's event loop; the message builders serve agents
written on other threads."""
from __future__ import annotations

import asyncio
import contextlib

import grpc

from node_probe.dial_stream import METADATA
from node_probe.proto import probe_pb2, probe_pb2_grpc


def register(node_id: str) -> probe_pb2.AgentMessage:
    return probe_pb2.AgentMessage(register=probe_pb2.Register(node_id=node_id))


def heartbeat(node_id: str, seq: int) -> probe_pb2.AgentMessage:
    """A transport-liveness heartbeat of a READY engine."""
    return probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(
        seq=seq, interval_ms=100, node_id=node_id, liveness=probe_pb2.LIVENESS_TRANSPORT,
        telemetry=probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY)))


def probe_ok() -> probe_pb2.AgentMessage:
    """A good micro-probe result (TTFT 10 ms)."""
    return probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(
        seq=1, ok=True, ttft_ms=10.0, trigger="scheduled"))


class DialInAgent:
    """One agent's stream to 127.0.0.1:``port``: a Register, then a heartbeat every ``refresh_ms``
    while ``talking`` (a good probe result after the first). :meth:`cut` ends it from the agent's
    side (its channel closed: the call ends under the server), :meth:`dial` opens a new one."""

    def __init__(self, node_id: str, port: int, refresh_ms: int) -> None:
        self.node_id, self.port, self.refresh_s = node_id, port, refresh_ms / 1000.0
        self.talking = True
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None

    def dial(self) -> None:
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self._task = asyncio.create_task(self._run(self._channel))

    async def _run(self, channel: grpc.aio.Channel) -> None:
        call = probe_pb2_grpc.ProbeHubStub(channel).Connect(metadata=METADATA)
        await call.write(register(self.node_id))
        reader = asyncio.create_task(self._drain(call))
        seq = 0
        try:
            while True:
                if self.talking:
                    seq += 1
                    await call.write(heartbeat(self.node_id, seq))
                    if seq == 1:
                        await call.write(probe_ok())
                await asyncio.sleep(self.refresh_s)
        finally:
            reader.cancel()

    @staticmethod
    async def _drain(call: grpc.aio.StreamStreamCall) -> None:
        async for _ in call:  # Hello, ProbeNow, pings: read, not answered
            pass

    async def cut(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._channel is not None:
            await self._channel.close(None)
        self._task = self._channel = None
