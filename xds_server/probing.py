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
    EngineState,
    HeartbeatObserved,
    Observation,
    PingObserved,
    ProbeObserved,
    ProbeResultKind,
    StreamClosed,
    Tick,
    miss_after_s,
)

__all__ = ["ProbeSession", "engine_state_name", "failure_kind", "heartbeat_observation"]

log = logging.getLogger(__name__)

_FAILURE = {
    probe_pb2.FAILURE_KIND_UNSPECIFIED: ProbeResultKind.OK,
    probe_pb2.FAILURE_KIND_TIMEOUT: ProbeResultKind.TIMEOUT,
    probe_pb2.FAILURE_KIND_CONNECT: ProbeResultKind.CONNECT,
    probe_pb2.FAILURE_KIND_HTTP_STATUS: ProbeResultKind.HTTP_STATUS,
    probe_pb2.FAILURE_KIND_ENGINE_FATAL: ProbeResultKind.ENGINE_FATAL,
    probe_pb2.FAILURE_KIND_BAD_OUTPUT: ProbeResultKind.BAD_OUTPUT,
}
_ENGINE_STATE = {
    probe_pb2.ENGINE_STATE_UNSPECIFIED: EngineState.COLD,
    probe_pb2.ENGINE_STATE_COLD: EngineState.COLD,
    probe_pb2.ENGINE_STATE_WARMING: EngineState.WARMING,
    probe_pb2.ENGINE_STATE_READY: EngineState.READY,
    probe_pb2.ENGINE_STATE_FAILED: EngineState.FAILED,
}


def failure_kind(result: probe_pb2.InferenceResult) -> ProbeResultKind:
    """Map an InferenceResult to the health model's outcome class (unknown enum -> BAD_OUTPUT)."""
    if result.ok:
        return ProbeResultKind.OK
    kind = _FAILURE.get(result.failure, ProbeResultKind.BAD_OUTPUT)
    return ProbeResultKind.BAD_OUTPUT if kind is ProbeResultKind.OK else kind


def engine_state_name(state: int) -> EngineState:
    """The health model's EngineState for a probe_pb2.EngineState value (unknown values read as COLD)."""
    return _ENGINE_STATE.get(state, EngineState.COLD)


ObservationSink = Callable[[str, Observation, float], "float | None"]
"""``sink(node_id, observation, now_s) -> next_check_s``: when the next Tick is due, or None."""


def heartbeat_observation(hb: probe_pb2.Heartbeat, fatal_xids: frozenset[int] = frozenset()) -> HeartbeatObserved:
    """Summarize a Heartbeat's telemetry for the health model.

    GPU free ratio is that of the least free GPU with both memory fields known (None if none);
    ``gpu_fatal`` names the first fatal Xid reported, or "GPU lost" when NVML reports it.
    """
    tel = hb.telemetry
    load = tel.engine_load
    free: float | None = None
    fatal = ""
    for g in tel.gpu.gpus:
        if g.HasField("memory_total_bytes") and g.HasField("memory_used_bytes") and g.memory_total_bytes > 0:
            r = max(0.0, 1.0 - g.memory_used_bytes / g.memory_total_bytes)
            free = r if free is None else min(free, r)
        if not fatal:
            bad = [x for x in g.xid_events if x in fatal_xids]
            if bad:
                fatal = f"GPU {g.index} Xid {bad[0]}"
            elif any("GpuIsLost" in e for e in g.errors):
                fatal = f"GPU {g.index} lost (NVML GpuIsLost)"
    return HeartbeatObserved(
        engine_state=engine_state_name(tel.engine_state),
        stalled=tel.stalled,
        stall_detail=tel.stall_detail,
        requests_running=load.requests_running if load.HasField("requests_running") else None,
        requests_waiting=load.requests_waiting if load.HasField("requests_waiting") else None,
        gpu_free_ratio=free,
        gpu_fatal=fatal,
    )


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
        self._timer_at = 0.0
        self._deferred = False
        self.lag_deferrals = 0
        self._outq: asyncio.Queue[probe_pb2.ControlMessage] | None = None
        self.probe_now_sent = 0
        self.rtt_samples_dropped = 0
        self._stalled = False
        self._fatal_xids = frozenset(cfg.fatal_xids)
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
        self._arm(self.sink(self.node.id, obs, self._loop.time()))

    def _arm(self, at_s: float | None) -> None:
        """Arm the single detection timer at ``at_s`` (loop clock), replacing any earlier one."""
        if self._timer:
            self._timer.cancel()
            self._timer = None
        if at_s is None:
            return
        assert self._loop is not None
        self._timer_at = at_s
        self._timer = self._loop.call_at(at_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        assert self._loop is not None
        late_ms = (self._loop.time() - self._timer_at) * 1000.0
        if late_ms > self.cfg.self_lag_tolerance_ms and not self._deferred:
            # Our own event loop stalled: heartbeats may be waiting unread. Let it drain first.
            self._deferred = True
            self.lag_deferrals += 1
            self._timer_at = self._loop.time()
            self._timer = self._loop.call_later(0.005, self._on_timer)
            return
        self._deferred = False
        self._emit(Tick())

    def _probe_now(self, reason: str) -> None:
        """Ask the agent for an immediate micro-probe (the agent rate-limits these)."""
        if self._outq is not None:
            self.probe_now_sent += 1
            self._outq.put_nowait(probe_pb2.ControlMessage(probe_now=probe_pb2.ProbeNow(reason=reason)))

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
        outq: asyncio.Queue[probe_pb2.ControlMessage] = asyncio.Queue()
        self._outq = outq
        loop = asyncio.get_running_loop()
        pings: dict[int, float] = {}
        got_any = False
        last_hb = 0.0
        gap_limit = miss_after_s(self.cfg)

        async def writer() -> None:
            # The only writer of this stream: grpc.aio allows one write in flight at a time.
            while True:
                await call.write(await outq.get())

        async def pinger() -> None:
            outq.put_nowait(probe_pb2.ControlMessage(
                hello=probe_pb2.Hello(control_plane_id=self.control_plane_id)))
            # A (re)connected control plane has no probe result yet: ask for one now rather than
            # waiting up to the agent's busy cadence (3-5 s); keeps the warm-up gate short.
            outq.put_nowait(probe_pb2.ControlMessage(probe_now=probe_pb2.ProbeNow(reason="connected")))
            seq = 0
            interval = self.cfg.ping_interval_ms / 1000.0
            while True:
                seq += 1
                pings[seq] = loop.time()
                if len(pings) > 64:  # unanswered pings: keep the map bounded
                    for k in sorted(pings)[:-64]:
                        del pings[k]
                outq.put_nowait(probe_pb2.ControlMessage(ping=probe_pb2.Ping(seq=seq)))
                await asyncio.sleep(interval)

        ping_task = asyncio.create_task(pinger())
        write_task = asyncio.create_task(writer())
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
                    if last_hb and now - last_hb > gap_limit:
                        # Pings outstanding across a heartbeat gap would measure the silence (a
                        # frozen host), which the heartbeat rules already judged, not the network.
                        self.rtt_samples_dropped += len(pings)
                        pings.clear()
                    last_hb = now
                    self.last_telemetry = hb.telemetry
                    if hb.telemetry.stalled and not self._stalled:
                        self._probe_now(f"engine stalled: {hb.telemetry.stall_detail}")
                    self._stalled = hb.telemetry.stalled
                    self._arm(self.sink(self.node.id, heartbeat_observation(hb, self._fatal_xids), now))
                elif which == "pong":
                    sent = pings.pop(msg.pong.seq, None)
                    if sent is None:
                        self._malformed(f"pong for unknown seq {msg.pong.seq}")
                        continue
                    self._arm(self.sink(self.node.id, PingObserved(rtt_ms=(now - sent) * 1000.0), now))
                elif which == "inference_result":
                    r = msg.inference_result
                    if r.ok and not (r.ttft_ms >= 0):
                        self._malformed(f"inference result with ttft_ms={r.ttft_ms}")
                        continue
                    if not r.ok:
                        self._probe_now(f"confirm probe failure: {failure_kind(r).value}")
                    self._arm(self.sink(self.node.id, ProbeObserved(
                        kind=failure_kind(r), ttft_ms=r.ttft_ms, http_status=r.http_status,
                        detail=r.detail), now))
                else:
                    self._malformed("agent message with no payload")
        finally:
            self._outq = None
            ping_task.cancel()
            write_task.cancel()
            call.cancel()

    def _malformed(self, what: str) -> None:
        log.warning("malformed message from agent %s: %s", self.node.id, what)
        if self.on_malformed:
            self.on_malformed(self.node.id, what)
