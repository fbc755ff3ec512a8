"""Probe sessions: one long-lived gRPC stream per node_probe agent.

A :class:`ProbeSession` dials the agent, keeps one ``NodeProbe.Watch`` stream open and turns what
arrives into health-model observations, timed on the control plane's own monotonic clock
(``loop.time()``; the agent's clock is never used for timing):

- each Heartbeat -> :class:`HeartbeatObserved`; a timer armed at last arrival + interval + grace
  (and every interval after) delivers :class:`Tick`, so missed heartbeats are counted unpolled;
- Ping{seq} every ``rtt.ping_interval``, less often past the process's ``rtt.ping_budget``
  (:mod:`~xds_server.probing.rtt_pace`); its Pong gives the RTT -> :class:`PingObserved` (none
  across a heartbeat gap or a stall or queue of our own loop, and no ping sent while our loop runs
  late: counted in ``Counters.rtt_not_taken``);
- each InferenceResult -> :class:`ProbeObserved`;
- the stream ending, failing to open, or bringing no heartbeat for ``probe.channel.silent_stream_redial``
  -> :class:`StreamClosed`, then redial with exponential backoff
  (``heartbeat.reconnect_backoff_initial`` doubling up to ``heartbeat.reconnect_backoff_max``).

After a stall of our own event loop, verdicts on the node's silence (a Tick, a closed or silent
stream) wait until the node is heard again or the hold ends (:mod:`xds_server.probing.silence`).
Every message is checked field by field at the edge (:class:`~xds_server.probing.edge.AgentEdge`)
first; bad fields are counted per (field, reason) and logged rate-limited. A failure while
handling one message is counted and skipped: it never ends health checking.
:func:`grpc_probe_source` is the factory the wiring shell hands the control plane.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from time import monotonic

import grpc

from node_probe.proto import probe_pb2, probe_pb2_grpc
from xds_server.config import HealthConfig, NodeConfig, ProbeConfig
from xds_server.health.clocks import miss_after_s
from xds_server.health.outcome import is_refusal
from xds_server.health.records import Observation, PingObserved, ProbeResultKind, Tick
from xds_server.probing.edge import AgentEdge, BadField, CheckedHeartbeat, CheckedPong, CheckedResult, TelemetrySummary
from xds_server.probing.liveness import (
    ProbeCall,
    StreamState,
    call_metadata,
    hello,
    liveness_lost,
    reasserted,
    silent_after_s,
)
from xds_server.probing.rtt_pace import PingPace
from xds_server.probing.silence import SilenceGate, SilentStream
from xds_server.probing.sources import ObservationSink, ProbeSource, ProbeSourceContext
from xds_server.probing.timers import TickTimer
from xds_server.process.cancellation import cancel_and_wait, raise_if_cancelled
from xds_server.process.counters import Counters
from xds_server.process.tls import ClientTls, dial
from xds_server.process.untrusted import RateLimitedLog, clip, for_log

__all__ = ["ProbeSession", "SilentStream", "grpc_probe_source"]

log = logging.getLogger("xds_server.probing")  # the stage's name, as before the package

class ProbeSession:
    """Watches one node through its agent. ``sink(node_id, observation, now_s)`` gets every observation.

    ``tls``: dial the agent over TLS (:class:`~xds_server.process.tls.ClientTls`; None: plaintext).
    ``start()`` spawns the dial loop; ``stop()`` cancels it and closes the channel.
    ``last_telemetry`` holds the latest checked :class:`~xds_server.probing.edge.TelemetrySummary`.
    Bad messages and fields are counted in ``counters`` (``malformed`` per node, ``bad_fields``
    per (field, reason)) and in ``on_malformed(node_id, what)`` if given.
    """

    def __init__(
        self,
        node: NodeConfig,
        cfg: HealthConfig,
        sink: ObservationSink,
        control_plane_id: str = "xds-sentinel",
        on_malformed: Callable[[str, str], None] | None = None,
        *,
        probe: ProbeConfig | None = None,
        counters: Counters | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        self.node = node
        self.tls = tls  # None: plaintext; else how the agent is dialled (xds_server.process.tls.dial)
        self.cfg = cfg
        self.probe_cfg = probe if probe is not None else ProbeConfig()
        self.counters = counters if counters is not None else Counters()
        self.sink = sink
        self.control_plane_id = control_plane_id
        self.on_malformed = on_malformed
        self.edge = AgentEdge(cfg, self.probe_cfg)
        self.last_telemetry: TelemetrySummary | None = None
        self.connected = False
        self.connects = 0
        # The link to the agent, for /nodes: dials in a row that got no message from the agent,
        # the last error (clipped) and when it happened (loop time, s); the last failed probe.
        self.failed_dials = 0
        self.last_error = ""
        self.last_error_at_s: float | None = None
        self.last_probe_failure = ""
        self.handler_errors = 0
        self._task: asyncio.Task | None = None
        self._timer: TickTimer | None = None
        self._outq: asyncio.Queue[probe_pb2.ControlMessage] | None = None
        self._stalled = False
        self._rl = RateLimitedLog(log, self.probe_cfg.logs.malformed_interval.s, max_keys=256)
        self._unreachable_rl = RateLimitedLog(log, self.probe_cfg.logs.unreachable_interval.s, max_keys=1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stream: StreamState | None = None
        self._latest: StreamState | None = None  # the open stream, or the one that ended last
        self._gap_limit = miss_after_s(cfg)
        self.silence_gate = SilenceGate(cfg, self.probe_cfg)

    def start(self) -> None:
        """Begin dialing the agent (idempotent)."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self.silence_gate.start(self._loop)
            self._task = asyncio.create_task(self._run(), name=f"probe-{self.node.id}")

    def check_at(self, at_s: float | None) -> None:
        """Arm the detection timer at ``at_s`` (loop s; a worker's handed-over node): a Tick unless re-armed."""
        self._arm(at_s)

    async def stop(self) -> None:
        """Stop the session and wait for it to finish."""
        if self._timer:
            self._timer.cancel()
        try:
            if self._task:
                await cancel_and_wait(self._task)
        finally:  # also when our caller is cancelled meanwhile
            self._task = None
            self.silence_gate.stop()

    @property
    def finished(self) -> tuple[float, float] | None:
        """(arrival, loop s; count): the engine's finished requests at the last heartbeat (None: none)."""
        st, fin = self._latest, self.edge.load.finished
        return None if st is None or not st.had_hb or fin is None else (st.last_hb, fin)

    @property
    def alive(self) -> bool:
        """The dial loop is running (it only ends through :meth:`stop`)."""
        return self._task is not None and not self._task.done()

    # -- internals ---------------------------------------------------------------------------

    def _emit(self, obs: Observation) -> None:
        assert self._loop is not None
        self._arm(self.sink(self.node.id, obs, self._loop.time()))

    def _arm(self, at_s: float | None) -> None:
        """The next Tick is due at ``at_s`` (loop clock, s), None: none pending."""
        if self._timer is None:
            assert self._loop is not None
            self._timer = TickTimer(self._loop, self._tick, lag_tolerance_s=self.cfg.heartbeat.self_lag_tolerance.s,
                                    lag_recheck_s=self.probe_cfg.stalls.lag_recheck.s,
                                    stall_recheck_s=miss_after_s(self.cfg),
                                    retry_s=self.cfg.heartbeat.interval.s,
                                    on_error=lambda: self._handler_failed("tick"))
        self._timer.arm(at_s)

    def _tick(self) -> None:
        verdict: float | Observation = self.silence_gate.due(self._now(), self._heard_s())
        st = self._stream
        if type(verdict) is Tick and st is not None and st.transport and st.obs is not None:
            verdict = reasserted(st.obs, st.obs_s, self._now())  # transport liveness: still answering
        self._judge(verdict)

    def _judge(self, verdict: float | Observation) -> None:
        """Emit a verdict on the node's silence, or (a loop time) re-arm at the end of a hold."""
        if isinstance(verdict, float):
            self._arm(verdict)
        else:
            self._emit(verdict)

    def _heard_s(self) -> float | None:
        """Arrival (loop s) of the last heartbeat on the latest stream (open or ended); None: none."""
        st = self._latest
        return st.last_hb if st is not None and st.had_hb else None

    @property
    def lag_deferrals(self) -> int:
        """Ticks put off because our own event loop was late."""
        return self._timer.deferrals if self._timer is not None else 0

    def _probe_now(self, reason: str) -> None:
        """Ask the agent for an immediate micro-probe (the agent rate-limits these)."""
        if self._outq is not None:
            self._outq.put_nowait(probe_pb2.ControlMessage(
                probe_now=probe_pb2.ProbeNow(reason=clip(reason, self.probe_cfg.limits.max_text_chars))))

    async def _run(self) -> None:
        backoff = self.cfg.heartbeat.reconnect_backoff_initial.s
        pc = self.probe_cfg
        options = pc.channel_options(self.cfg.heartbeat.reconnect_backoff_max.ms)
        assert self.node.probe_address is not None  # (a node without one is a DialInSession's)
        while True:
            got_any = lost = False
            try:
                channel = dial(self.node.probe_address, options=options, tls=self.tls)
                try:
                    stub = probe_pb2_grpc.NodeProbeStub(channel)
                    got_any = await self._serve(stub.Watch(metadata=call_metadata(self.probe_cfg)))
                    detail = "stream ended by agent"
                except grpc.aio.AioRpcError as e:
                    got_any = self.connected
                    detail = f"{e.code().name}: {clip(e.details() or '', pc.limits.max_text_chars)}"
                    lost = self._latest is not None and self._latest.transport and liveness_lost(e)
                except SilentStream as e:
                    got_any = False  # back off: an agent that holds streams open silently is not well
                    detail = str(e)
                finally:
                    self.connected = False
                    await channel.close(grace=None)
            except Exception as e:  # never let one node's session die
                got_any = False
                detail = f"{type(e).__name__}: {clip(str(e), pc.limits.max_text_chars)}"
                self._rl.log(logging.ERROR, self._now(), "session", "probe session %s failed: %s",
                             for_log(self.node.id), for_log(detail, 256))
            raise_if_cancelled()  # a stop's cancel that the failed call swallowed: no verdict, no redial
            self._ended(detail, lost)
            extra = {"node": self.node.id, "reason": detail}
            if got_any:
                self.failed_dials = 0
                log.info("probe stream to %s (%s) closed: %s", for_log(self.node.id), self.node.probe_address,
                         for_log(detail, 256), extra=extra)
                backoff = self.cfg.heartbeat.reconnect_backoff_initial.s
            else:
                # One line when the agent first cannot be reached, then at most one per
                # probe.logs.unreachable_interval (with the count of dials suppressed).
                self.failed_dials += 1
                self.last_error, self.last_error_at_s = detail, self._now()
                if self.failed_dials == 1:
                    self._unreachable_rl.forget("unreachable")
                self._unreachable_rl.warning(
                    self._now(), "unreachable", "agent of %s at %s unreachable (%d dial(s) failed): %s",
                    for_log(self.node.id), for_log(self.node.probe_address), self.failed_dials,
                    for_log(detail, 256), extra=extra)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.cfg.heartbeat.reconnect_backoff_max.s)

    def _ended(self, detail: str, lost: bool, *, weighed: bool = False) -> None:
        """The stream ended (``detail``: why; ``lost``: its transport's liveness failed): judged now, or
        at the end of a hold after our own stall (none when ``weighed``: a dial-in drop, stalls weighed)."""
        try:
            g = self.silence_gate
            self._judge(g.lost(detail) if lost and weighed else g.closed(self._now(), detail, self._heard_s(), lost))
        except Exception:
            self._handler_failed("stream_closed")

    def _now(self) -> float:
        return self._loop.time() if self._loop is not None else 0.0

    async def _serve(self, call: ProbeCall) -> bool:
        """Run one open stream until it ends: True when the agent sent anything on it. Raises
        :class:`SilentStream` when it brought no heartbeat for too long (it is cancelled), and
        what ``call.read()`` raises."""
        outq: asyncio.Queue[probe_pb2.ControlMessage] = asyncio.Queue()
        self._outq = outq
        loop = asyncio.get_running_loop()
        self._stream = self._latest = st = StreamState(loop.time())
        self.edge.stream_started()
        pings = st.pings
        silent_s = silent_after_s(self.probe_cfg)

        async def writer() -> None:
            # The only writer of this stream: grpc.aio allows one write in flight at a time. A ping's
            # round trip starts when it is written, not while it waited in the queue behind others.
            while True:
                m = await outq.get()
                if m.HasField("ping") and m.ping.seq in pings:
                    pings[m.ping.seq] = monotonic()
                await call.write(m)

        async def pinger() -> None:
            outq.put_nowait(hello(self.control_plane_id, self.probe_cfg))
            # A (re)connected control plane has no probe result yet: ask for one now rather than
            # waiting up to the agent's busy cadence (3-5 s); keeps the warm-up gate short.
            outq.put_nowait(probe_pb2.ControlMessage(probe_now=probe_pb2.ProbeNow(reason="connected")))
            keep, pace = self.probe_cfg.channel.max_unanswered_pings, PingPace.acquire(loop)
            try:
                while True:
                    now = loop.time()
                    if self.silence_gate.measured_us(now, now, self.cfg.rtt.self_lag_max.s):
                        self.counters.rtt_not_taken["late"] += 1  # our loop runs late: its round trip would not count
                    else:
                        st.ping_seq += 1
                        pings[st.ping_seq] = monotonic()
                        if len(pings) > keep:  # unanswered pings: keep the map bounded
                            for k in sorted(pings)[:-keep]:
                                del pings[k]
                        outq.put_nowait(probe_pb2.ControlMessage(ping=probe_pb2.Ping(seq=st.ping_seq)))
                    await asyncio.sleep(pace.wait_s(self.cfg.rtt))
            finally:
                pace.release()

        silent = [False]
        async def watchdog() -> None:
            # A stream silent too long is cancelled here (unless that is ours); the read below then ends.
            while True:
                await self.silence_gate.silent_for(loop, silent_s, lambda: st.last_hb, self._heard_s,
                                                   self.cfg.heartbeat.self_lag_tolerance.s,
                                                   self.probe_cfg.stalls.lag_recheck.s)
                if not await self._silence_ours(silent_s, st.last_hb):
                    break
            silent[0] = True
            call.cancel()

        ping_task = asyncio.create_task(pinger())
        write_task = asyncio.create_task(writer())
        dog_task = asyncio.create_task(watchdog())
        try:
            while True:
                try:
                    msg = await call.read()
                except asyncio.CancelledError:
                    if silent[0]:
                        raise SilentStream(f"no heartbeat for {silent_s:g} s: redialling") from None
                    raise
                if msg is grpc.aio.EOF:  # type: ignore[attr-defined]  # grpc-stubs 1.53 lacks grpc.aio.EOF
                    if silent[0]:
                        raise SilentStream(f"no heartbeat for {silent_s:g} s: redialling")
                    return st.got_any
                self.on_message(msg, loop.time())
        finally:
            self._outq = None
            self._stream = None
            ping_task.cancel()
            write_task.cancel()
            dog_task.cancel()
            call.cancel()

    async def _silence_ours(self, silent_s: float, since_s: float) -> bool:
        """Whether the open stream's silence (since ``since_s``) is our fault: no (dial-in judges bursts)."""
        return False

    def on_message(self, msg: probe_pb2.AgentMessage, now: float) -> None:
        """Handle one message read from the open stream at loop time ``now`` (s): check it at the
        edge, count what is bad, hand the observation to the sink and re-arm the detection timer.
        A failure is counted and skipped (:meth:`_handler_failed`); nothing here raises."""
        st = self._stream
        if st is None:
            return
        try:
            if (not st.transport and self.probe_cfg.liveness == "transport"
                    and msg.heartbeat.liveness == probe_pb2.LIVENESS_TRANSPORT):
                st.transport = True  # the agent runs transport liveness on this stream (it echoes it)
            checked, bad = self.edge.check(msg, vouched=st.transport)
            if bad:
                self._bad_fields(bad, now)
            if checked is None:
                self._malformed("rejected message", now)
            elif type(checked) is CheckedHeartbeat:
                if not st.got_any:
                    st.got_any = True
                    self.connected = True
                    self.connects += 1
                if st.had_hb and now - st.last_hb > self._gap_limit and not st.transport:
                    # Pings outstanding across a heartbeat gap would measure the silence (a
                    # frozen host), which the heartbeat rules already judged, not the network.
                    self.counters.rtt_not_taken["gap"] += len(st.pings)
                    st.pings.clear()
                st.last_hb = st.obs_s = now
                st.had_hb = True
                st.obs = hb = checked.observation  # vouched on a transport stream: no miss until it ends
                self.last_telemetry = tel = checked.telemetry
                if tel.stalled and not self._stalled:
                    self._probe_now(f"engine stalled: {tel.stall_detail}")
                self._stalled = tel.stalled
                self._arm(self.sink(self.node.id, hb, now))
            elif isinstance(checked, CheckedPong):
                sent = st.pings.pop(checked.seq, None)
                if sent is None:
                    if not 0 < checked.seq <= st.ping_seq:  # never sent: the agent is wrong
                        self._bad_fields([BadField("pong.seq", "mismatch")], now)
                        self._malformed("pong for an unknown seq", now)
                    # else: a ping dropped after a heartbeat gap or past max_unanswered_pings: no fault
                    return
                rtt_s = monotonic() - sent
                if self.silence_gate.measured_us(now - rtt_s, now, self.cfg.rtt.self_lag_max.s):  # our stall or queue
                    self.counters.rtt_not_taken["ours"] += 1
                    return
                self._arm(self.sink(self.node.id, PingObserved(rtt_ms=rtt_s * 1000.0), now))
            elif isinstance(checked, CheckedResult):
                obs = checked.observation
                self.last_probe_failure = "" if obs.kind is ProbeResultKind.OK else clip(  # for /nodes
                    f"{obs.kind.value}{f' {obs.http_status}' if obs.http_status else ''}: {obs.detail}",
                    self.probe_cfg.limits.max_text_chars)
                if obs.kind is not ProbeResultKind.OK and not is_refusal(obs, self.cfg):  # a 429 is an answer
                    self._probe_now(f"confirm probe failure: {obs.kind.value}")
                self._arm(self.sink(self.node.id, obs, now))
        except Exception:  # one message must never end health checking
            self._handler_failed("message")

    def _bad_fields(self, bad: list[BadField], now: float) -> None:
        for b in bad:
            self.counters.bad_fields[(b.field, b.reason)] += 1
            self._rl.warning(now, f"{b.field}:{b.reason}", "agent %s sent a bad field %s (%s)",
                             for_log(self.node.id), b.field, b.reason)

    def _malformed(self, what: str, now: float) -> None:
        self.counters.malformed[self.node.id] += 1
        self._rl.warning(now, f"malformed:{what}", "malformed message from agent %s: %s",
                         for_log(self.node.id), what)
        if self.on_malformed:
            self.on_malformed(self.node.id, what)

    def _handler_failed(self, where: str) -> None:
        """Count and log (rate-limited, one line) an exception while handling ``where``
        ("message", "tick" or "stream_closed"); called from an ``except`` block."""
        self.handler_errors += 1
        self.counters.handler_errors[where] += 1
        exc = sys.exc_info()[1]
        self._rl.log(logging.ERROR, self._now(), f"handler:{where}",
                     "probe session %s: handling a %s failed, skipped (%s: %s)", for_log(self.node.id), where,
                     type(exc).__name__, for_log(str(exc), 200))
        log.debug("probe session %s: %s handler failed", for_log(self.node.id), where, exc_info=True)


def grpc_probe_source(node: NodeConfig, ctx: ProbeSourceContext) -> ProbeSource:
    """A :data:`~xds_server.probing.sources.ProbeSourceFactory`: a session dialled as ``ctx.tls`` says."""
    return ProbeSession(node, ctx.health, ctx.sink, ctx.control_plane_id, probe=ctx.probe,
                        counters=ctx.counters, tls=ctx.tls.client(node.id))
