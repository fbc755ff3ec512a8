"""Probe sessions: one long-lived gRPC stream per node_probe agent.

A :class:`ProbeSession` dials the agent, keeps one ``NodeProbe.Watch`` stream open and turns what
arrives into health-model observations, timed on the control plane's own monotonic clock
(``loop.time()``; the agent's clock is never used for timing):

- each Heartbeat -> :class:`HeartbeatObserved`; a timer armed at last arrival + interval + grace
  (and every interval after) delivers :class:`Tick` so missed heartbeats are counted without
  polling;
- Ping{seq} every ``ping_interval_ms``; the matching Pong gives the RTT -> :class:`PingObserved`;
- each InferenceResult -> :class:`ProbeObserved`;
- the stream ending or failing to open -> :class:`StreamClosed`, then redial with exponential
  backoff (``reconnect_backoff_initial_ms`` doubling up to ``reconnect_backoff_max_ms``).

Malformed messages from an agent are logged and counted (``on_malformed``), never fatal.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from node_probe.proto import probe_pb2, probe_pb2_grpc
from xds_server.config import HealthConfig, NodeConfig
from xds_server.health.model import (
    EngineFatalKind,
    HeartbeatObserved,
    Observation,
    PingObserved,
    ProbeObserved,
    StreamClosed,
    Tick,
)

__all__ = ["ProbeSession", "engine_state_name", "failure_kind"]

log = logging.getLogger(__name__)

_FAILURE = {
    probe_pb2.FAILURE_KIND_UNSPECIFIED: EngineFatalKind.OK,
    probe_pb2.FAILURE_KIND_TIMEOUT: EngineFatalKind.TIMEOUT,
    probe_pb2.FAILURE_KIND_CONNECT: EngineFatalKind.CONNECT,
    probe_pb2.FAILURE_KIND_HTTP_STATUS: EngineFatalKind.HTTP_STATUS,
    probe_pb2.FAILURE_KIND_ENGINE_FATAL: EngineFatalKind.ENGINE_FATAL,
    probe_pb2.FAILURE_KIND_BAD_OUTPUT: EngineFatalKind.BAD_OUTPUT,
}
_ENGINE_STATE = {
    probe_pb2.ENGINE_STATE_UNSPECIFIED: "COLD",
    probe_pb2.ENGINE_STATE_COLD: "COLD",
    probe_pb2.ENGINE_STATE_WARMING: "WARMING",
    probe_pb2.ENGINE_STATE_READY: "READY",
    probe_pb2.ENGINE_STATE_FAILED: "FAILED",
}


def failure_kind(result: probe_pb2.InferenceResult) -> EngineFatalKind:
    """Map an InferenceResult to the health model's outcome class (unknown enum -> BAD_OUTPUT)."""
    if result.ok:
        return EngineFatalKind.OK
    kind = _FAILURE.get(result.failure, EngineFatalKind.BAD_OUTPUT)
    return EngineFatalKind.BAD_OUTPUT if kind is EngineFatalKind.OK else kind


def engine_state_name(state: int) -> str:
    """Name of a probe_pb2.EngineState value (unknown values read as COLD)."""
    return _ENGINE_STATE.get(state, "COLD")


ObservationSink = Callable[[str, Observation, float], None]


class ProbeSession:
    """Watches one node through its agent. ``sink(node_id, observation, now_s)`` gets every observation.

    ``start()`` spawns the dial loop; ``stop()`` cancels it and closes the channel.
    ``last_telemetry`` holds the latest Telemetry message (for the admin endpoint).
    """

    def __init__(
        self,
        node: NodeConfig,
        cfg: HealthConfig,
        sink: ObservationSink,
        control_plane_id: str = "xds-sentinel",
        on_malformed: Callable[[str, str], None] | None = None,
    ) -> None:
        self.node = node
        self.cfg = cfg
        self.sink = sink
        self.control_plane_id = control_plane_id
        self.on_malformed = on_malformed
        self.last_telemetry: probe_pb2.Telemetry | None = None
        self.connected = False
        self.connects = 0
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Begin dialing the agent (idempotent)."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.create_task(self._run(), name=f"probe-{self.node.id}")

    async def stop(self) -> None:
        """Stop the session and wait for it to finish."""
        if self._timer:
            self._timer.cancel()
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # -- internals ---------------------------------------------------------------------------

    def _emit(self, obs: Observation) -> None:
        assert self._loop is not None
        self.sink(self.node.id, obs, self._loop.time())

    def _arm_timer(self, delay_s: float) -> None:
        if self._timer:
            self._timer.cancel()
        assert self._loop is not None
        self._timer = self._loop.call_later(delay_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._emit(Tick())
        self._arm_timer(self.cfg.heartbeat_interval_ms / 1000.0)

    async def _run(self) -> None:
        backoff = self.cfg.reconnect_backoff_initial_ms / 1000.0
        options = [
            ("grpc.keepalive_time_ms", 1000),
            ("grpc.keepalive_timeout_ms", 1000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(self.cfg.reconnect_backoff_max_ms)),
        ]
        while True:
            channel = grpc.aio.insecure_channel(self.node.probe_address, options=options)
            try:
                got_any = await self._watch(channel)
                detail = "stream ended by agent"
            except asyncio.CancelledError:
                await channel.close(grace=None)
                raise
            except grpc.aio.AioRpcError as e:
                got_any = self.connected
                detail = f"{e.code().name}: {e.details()}"
            except Exception as e:  # never let one node's session die
                got_any = self.connected
                detail = f"{type(e).__name__}: {e}"
                log.exception("probe session %s failed", self.node.id)
            self.connected = False
            await channel.close(grace=None)
            self._emit(StreamClosed(detail))
            log.info("probe stream to %s (%s) closed: %s", self.node.id, self.node.probe_address, detail)
            if got_any:
                backoff = self.cfg.reconnect_backoff_initial_ms / 1000.0
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.cfg.reconnect_backoff_max_ms / 1000.0)

    async def _watch(self, channel: grpc.aio.Channel) -> bool:
        stub = probe_pb2_grpc.NodeProbeStub(channel)
        call = stub.Watch()
        loop = asyncio.get_running_loop()
        pings: dict[int, float] = {}
        got_any = False

        async def pinger() -> None:
            await call.write(probe_pb2.ControlMessage(
                hello=probe_pb2.Hello(control_plane_id=self.control_plane_id)))
            seq = 0
            interval = self.cfg.ping_interval_ms / 1000.0
            while True:
                seq += 1
                pings[seq] = loop.time()
                if len(pings) > 64:  # unanswered pings: keep the map bounded
                    for k in sorted(pings)[:-64]:
                        del pings[k]
                await call.write(probe_pb2.ControlMessage(ping=probe_pb2.Ping(seq=seq)))
                await asyncio.sleep(interval)

        ping_task = asyncio.create_task(pinger())
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    return got_any
                now = loop.time()
                which = msg.WhichOneof("msg")
                if which == "heartbeat":
                    if not got_any:
                        got_any = True
                        self.connected = True
                        self.connects += 1
                    hb = msg.heartbeat
                    self.last_telemetry = hb.telemetry
                    self.sink(self.node.id, HeartbeatObserved(
                        engine_state=engine_state_name(hb.telemetry.engine_state)), now)
                    self._arm_timer((self.cfg.heartbeat_interval_ms + self.cfg.heartbeat_grace_ms) / 1000.0)
                elif which == "pong":
                    sent = pings.pop(msg.pong.seq, None)
                    if sent is None:
                        self._malformed(f"pong for unknown seq {msg.pong.seq}")
                        continue
                    self.sink(self.node.id, PingObserved(rtt_ms=(now - sent) * 1000.0), now)
                elif which == "inference_result":
                    r = msg.inference_result
                    if r.ok and not (r.ttft_ms >= 0):
                        self._malformed(f"inference result with ttft_ms={r.ttft_ms}")
                        continue
                    self.sink(self.node.id, ProbeObserved(
                        kind=failure_kind(r), ttft_ms=r.ttft_ms, http_status=r.http_status,
                        detail=r.detail), now)
                else:
                    self._malformed("agent message with no payload")
        finally:
            ping_task.cancel()
            call.cancel()

    def _malformed(self, what: str) -> None:
        log.warning("malformed message from agent %s: %s", self.node.id, what)
        if self.on_malformed:
            self.on_malformed(self.node.id, what)
