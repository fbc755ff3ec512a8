"""A fake node_probe agent for hostile-input tests: a real grpc.aio NodeProbe server whose
stream sends what the test scripts (plus regular heartbeats and pong answers unless turned off).

Shape::

    agent = await ScriptedAgent.start()          # 127.0.0.1, free port: agent.port
    agent.send(AgentMessage(...), ...)            # queued, sent in order on the open stream
    agent.end_stream()                            # the agent ends the current stream (cp redials)
    agent.heartbeats = False                      # stream stays open, nothing sent
    await agent.stop()
"""
from __future__ import annotations

import asyncio

import grpc

from node_probe.proto import probe_pb2, probe_pb2_grpc

_END = object()


def heartbeat(seq: int = 0, **telemetry) -> probe_pb2.AgentMessage:
    tel = probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY)
    for k, v in telemetry.items():
        setattr(tel, k, v)
    return probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=seq, telemetry=tel))


def result(ok: bool = True, ttft_ms: float = 12.0, **fields) -> probe_pb2.AgentMessage:
    return probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(ok=ok, ttft_ms=ttft_ms, **fields))


class ScriptedAgent(probe_pb2_grpc.NodeProbeServicer):
    def __init__(self) -> None:
        self.heartbeats = True
        self.answer_pings = True
        self.pong_delay_s = 0.0  # each pong waits this long before it is sent
        self.interval_s = 0.1
        self.streams = 0
        self.received: list[probe_pb2.ControlMessage] = []
        self.sent = 0
        self._script: asyncio.Queue = asyncio.Queue()
        self._server: grpc.aio.Server | None = None
        self.port = 0
        self._seq = 0

    @classmethod
    async def start(cls, port: int = 0) -> ScriptedAgent:
        a = cls()
        a._server = grpc.aio.server()
        probe_pb2_grpc.add_NodeProbeServicer_to_server(a, a._server)
        a.port = a._server.add_insecure_port(f"127.0.0.1:{port}")
        await a._server.start()
        return a

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None

    def send(self, *msgs: probe_pb2.AgentMessage) -> None:
        for m in msgs:
            self._script.put_nowait(m)

    def end_stream(self) -> None:
        self._script.put_nowait(_END)

    def probe_now_reasons(self) -> list[str]:
        return [m.probe_now.reason for m in self.received if m.HasField("probe_now")]

    async def Watch(self, request_iterator, context):
        self.streams += 1
        pongs: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            async for m in request_iterator:
                self.received.append(m)
                if m.HasField("ping") and self.answer_pings:
                    pong = probe_pb2.AgentMessage(pong=probe_pb2.Pong(seq=m.ping.seq))
                    if self.pong_delay_s > 0:
                        asyncio.get_running_loop().call_later(self.pong_delay_s, pongs.put_nowait, pong)
                    else:
                        pongs.put_nowait(pong)

        reader = asyncio.ensure_future(read())
        loop = asyncio.get_running_loop()
        next_hb = loop.time()
        try:
            while True:
                while not self._script.empty():
                    m = self._script.get_nowait()
                    if m is _END:
                        return
                    self.sent += 1
                    yield m
                while not pongs.empty():
                    yield pongs.get_nowait()
                if loop.time() >= next_hb:
                    next_hb += self.interval_s
                    if self.heartbeats:
                        self._seq += 1
                        yield heartbeat(self._seq)
                await asyncio.sleep(0.005)
        finally:
            reader.cancel()
