"""Sessions of agents that dial in: the same per-node session, fed by the agent's own stream.

A node without ``probe_address`` is watched by a :class:`DialInSession`. It dials nothing: the
probe hub (:mod:`xds_server.probing.hub`) accepts the agent's ``ProbeHub.Connect`` stream, checks
its Register and hands the stream over (:meth:`DialInSession.attach`), which returns when the
stream ends. Everything on the stream is what a dialled ``Watch`` stream carries and is handled by
the same code (:class:`~xds_server.probing.session.ProbeSession`): Hello, RTT pings, ProbeNow,
replays, the edge checks, the detection timers, the stall hold.

Liveness is the transport's, always: the server sends HTTP/2 PINGs every
``probe.dial_in.keepalive`` and ends a connection whose PING is not answered within
``probe.dial_in.ping_timeout`` (gRPC's C core; no Python per PING). A stream that ends that way
(:meth:`InboundCall.transport_lost`: the call was cancelled under us, not half-closed) is the whole
miss threshold at once (``StreamClosed(liveness_lost=True)``, with no further hold), unless, judged
``probe.dial_in.drop_confirm`` later, the agent dialled again meanwhile, our process had stopped or
starved (its loop's thread not running at all) at least ``ping_timeout`` (or the agent's own PING
deadline, if shorter: :func:`ours_after_s`) within a hold before it
(the node's heartbeats queued during our stall are read before the cut; a loop busy with its own
work does not count: gRPC's threads answer PINGs) or the drop was one of a burst
(:mod:`~xds_server.probing.drop_burst`): then it is a plain end, and the nodes not heard since are
held (longer while agents keep dialling in, back or for the first time: ``probe.dial_in.burst_recovery``).
The agent's heartbeats (on change, and every ``probe.transport.telemetry_refresh``)
prove its own event loop alive: a stream without one for ``silent_after_s`` is ended, and the
agent dials again, unless many streams fell silent at once (the same burst rule: ours, kept open).
A new stream from the same agent replaces the open one (it re-dialled before we saw the old one
end).

Shape::

    s = DialInSession(node, health_cfg, sink, "cp-1", probe=probe_cfg, counters=counters)
    s.start()
    await s.attach(InboundCall(request_iterator, context))   # in the hub's handler; until it ends
    await s.stop()
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from node_probe.proto import probe_pb2
from xds_server.config import HealthConfig, NodeConfig, ProbeConfig, SentinelConfig
from xds_server.probing.drop_burst import (
    DropWatch,
    burst_size,
    chain_holds,
    dropped,
    is_burst,
    returns_hold,
    silent_with,
)
from xds_server.probing.session import ProbeSession, SilentStream
from xds_server.probing.sources import ObservationSink, ProbeSource, ProbeSourceContext, ProbeSourceFactory
from xds_server.process.counters import Counters
from xds_server.process.untrusted import clip, for_log

__all__ = ["AGENT_PING_TIMEOUT_S", "DialInSession", "InboundCall", "dial_in_source", "dial_in_used", "ours_after_s",
           "probe_source"]

log = logging.getLogger("xds_server.probing")
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # grpc-stubs 1.53 lacks grpc.aio.EOF
AGENT_PING_TIMEOUT_S = 5.0
"""The agent's own PING deadline on its dial-in channel (s; node_probe's ``CHANNEL_OPTIONS``,
``grpc.keepalive_timeout_ms``): a stop of ours this long can cut a stream from the agent's side,
so it makes a drop ours even where ``probe.dial_in.ping_timeout`` is set longer."""
_HALF_CLOSE_WAIT_S = 0.02
"""After a read's EOF, how long the call's end is waited for before the EOF counts as the agent's
half-close (s; ours: the end of a dead transport follows its EOF within 1 ms, measured)."""


def ours_after_s(ping_timeout_s: float) -> float:
    """How long our loop's thread must not have run before a drop is ours (s): our PING deadline,
    or the agent's (:data:`AGENT_PING_TIMEOUT_S`) where that is the shorter, as either cuts."""
    return min(ping_timeout_s, AGENT_PING_TIMEOUT_S)


class InboundCall:
    """An agent's ``ProbeHub.Connect`` stream on our side, as a session drives it (the
    :class:`~xds_server.probing.session.ProbeCall` shape: ``read``, ``write``, ``cancel``).
    ``finished`` is set once the session is done with it (the hub's handler then returns);
    ``ended_by``: why we ended it ("" when the agent or the transport did)."""

    __slots__ = ("_ctx", "_done", "_it", "_lost", "_reader", "_stop", "ended_by", "finished")

    def __init__(self, requests: AsyncIterator[probe_pb2.AgentMessage], context: grpc.aio.ServicerContext) -> None:
        loop = asyncio.get_running_loop()
        self._it = requests
        self._ctx = context
        self._stop: asyncio.Future[None] = loop.create_future()
        self.finished: asyncio.Future[None] = loop.create_future()
        self.ended_by = ""
        self._lost = False
        self._reader: asyncio.Task[Any] | None = None  # the task reading now, if any (cancel() interrupts it)
        self._done: asyncio.Future[None] = loop.create_future()  # the RPC ended (gRPC's done callback)
        context.add_done_callback(self._ended)  # type: ignore[arg-type]  # grpc-stubs 1.53 wants its DoneCallback class; grpc calls any callable

    def _ended(self, _: object) -> None:
        if not self._done.done():
            self._done.set_result(None)

    async def read(self) -> Any:
        """The next message, or ``grpc.aio.EOF`` when the agent half-closed, the transport ended
        or :meth:`cancel` was called. Read in the calling task itself (no task per message):
        :meth:`cancel` interrupts a read in progress by cancelling that task, and the read
        swallows exactly that cancellation (``Task.uncancel``), any other it passes on."""
        if self._stop.done():
            return _EOF
        task = asyncio.current_task()
        self._reader = task
        try:
            msg = await anext(self._it, _EOF)
        except asyncio.CancelledError:
            if self._stop.done() and task is not None and task.uncancel() == 0:
                return _EOF  # our own cancel() of this read: the stream ends here
            raise
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, grpc.aio.AbortError):
            msg = _EOF
        finally:
            self._reader = None
        if msg is _EOF:
            # A half-close leaves the call open; a transport that died ends it within a fraction of
            # a ms of the EOF (measured on grpcio 1.85: done callback 0.3 ms later, cancelled() False).
            if not self._done.done():
                await asyncio.wait((self._done,), timeout=_HALF_CLOSE_WAIT_S)
            self._lost = self._done.done()
        return msg

    async def write(self, message: probe_pb2.ControlMessage) -> None:
        """Send ``message``; nothing when the call already ended (its end is read by :meth:`read`)."""
        with contextlib.suppress(grpc.aio.UsageError, grpc.aio.AioRpcError, grpc.aio.AbortError):
            await self._ctx.write(message)

    def cancel(self, why: str = "") -> bool:
        """End the stream from our side (the hub's handler returns, the agent reads the end);
        ``why`` is kept in ``ended_by`` (the first one said). False: it was ended already."""
        if why and not self.ended_by:
            self.ended_by = why
        if self._stop.done():
            return False
        self._stop.set_result(None)
        if self._reader is not None:  # a read in progress: interrupted (it returns EOF)
            self._reader.cancel()
        return True

    def transport_lost(self) -> bool:
        """The stream's end, when read, was the call ending under us (a PING unanswered in time,
        the connection reset, the agent cancelling), not a half-close."""
        return self._lost

    def finish(self) -> None:
        if not self.finished.done():
            self.finished.set_result(None)


class DialInSession(ProbeSession):
    """Watches one node whose agent dials in (see the module docstring)."""

    def __init__(self, node: NodeConfig, cfg: HealthConfig, sink: ObservationSink,
                 control_plane_id: str = "xds-sentinel", *, probe: ProbeConfig | None = None,
                 counters: Counters | None = None) -> None:
        probe = (probe or ProbeConfig()).model_copy(update={"liveness": "transport"})
        super().__init__(node, cfg, sink, control_plane_id, probe=probe, counters=counters)
        self._calls: asyncio.Queue[InboundCall] = asyncio.Queue()
        self._current: InboundCall | None = None
        self.streams_replaced = 0
        self._redial = asyncio.Event()  # a stream was attached (the agent dialled)
        self._drops = DropWatch()  # the loop's, from start()
        self._lost_s: float | None = None  # the last stream's transport lost under us (loop s), until a new one
        self._returned_s = float("-inf")  # the agent's last dial in counted (loop s): one per node per hold
        self._dialled = False  # the agent has dialled in since we started
        self.replay_max_prompts = 0  # the agent's last heartbeat's (0: none yet, or it does not replay)
        self._replays: dict[str, asyncio.Future[probe_pb2.ReplayResult]] = {}

    def on_message(self, msg: probe_pb2.AgentMessage, now: float) -> None:
        kind = msg.WhichOneof("msg")
        if kind == "heartbeat":
            self.replay_max_prompts = msg.heartbeat.replay_max_prompts
        elif kind == "replay_result":
            fut = self._replays.pop(msg.replay_result.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.replay_result)
            return
        super().on_message(msg, now)

    async def replay(self, req: probe_pb2.ReplayRequest, timeout_s: float) -> probe_pb2.ReplayResult | str:
        """Ask the agent, on its open stream, to replay ``req``: its result, or why there is
        none within ``timeout_s`` (no stream open, or no answer in time)."""
        if self._outq is None:
            return "its agent has no stream open"
        fut: asyncio.Future[probe_pb2.ReplayResult] = asyncio.get_running_loop().create_future()
        self._replays[req.request_id] = fut
        self._outq.put_nowait(probe_pb2.ControlMessage(replay=req))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return "no replay result before the deadline"
        finally:
            self._replays.pop(req.request_id, None)

    async def attach(self, call: InboundCall) -> None:
        """Serve ``call`` as this node's stream and return once it ended. An open stream is
        ended first: the agent dialled again."""
        if self._current is not None and self._current.cancel("replaced by a new stream from the agent"):
            self.streams_replaced += 1
        if self._lost_s is not None or not self._dialled:
            self._came_in(self._now(), returned=self._lost_s is not None)
        self._dialled = True
        self._calls.put_nowait(call)
        self._redial.set()
        await call.finished

    def _came_in(self, now_s: float, *, returned: bool) -> None:
        """The agent dialled in at ``now_s``: back after its stream was lost under us
        (``returned``), or for the first time. While agents keep coming in after a verdict of ours
        (:func:`~xds_server.probing.drop_burst.returns_hold`), every node not heard since is held
        again, as after the burst (a return counted: ``returned``). First dials count as well: a
        fleet still dialling in (a started control plane takes a few dozen streams a second) is a
        queue that the agents of streams cut meanwhile wait behind, for tens of seconds."""
        d, w = self.probe_cfg.dial_in, self._drops
        self._lost_s = None
        hold_s = self.silence_gate.hold_s
        if now_s - self._returned_s >= hold_s:  # an agent that drops and returns again is counted once
            self._returned_s = now_s
            w.returns = dropped(w.returns, now_s, hold_s)
        if returns_hold(w.returns, now_s, hold_s, d.burst_min, w.stretch, d.burst_recovery.s):
            w.held_again(now_s)  # the stretch goes on from its own start: its bound is not renewed
            self.silence_gate.ours(now_s)  # every node not heard since is held again
            if returned:
                self.counters.transport_drops["returned"] += 1

    def _ours_gap_s(self) -> float:
        """How close verdicts of ours follow each other to form one stretch, and how far back a
        stall of ours makes a drop ours: a PING's span (``keepalive`` + ``ping_timeout``) and one hold."""
        d = self.probe_cfg.dial_in
        return d.keepalive.s + d.ping_timeout.s + self.silence_gate.hold_s

    def _judged_ours(self, at_s: float) -> None:
        """A verdict of ours at ``at_s`` (a burst of drops or silences, a drop after our stall, a
        return that holds the rest again): it joins the loop's stretch of such verdicts, and every
        node not heard since is held as after a stall of ours."""
        self._drops.ours(at_s, self._ours_gap_s())
        self.silence_gate.ours(at_s)

    async def _confirm_lost(self, detail: str) -> tuple[bool, str]:
        """A stream's transport ended under us: after ``dial_in.drop_confirm``, (still lost?,
        detail). Not lost when the agent dialled again meanwhile, when our loop stalled at least
        ``dial_in.ping_timeout`` (at most the agent's own deadline: :func:`ours_after_s`) within a
        PING's span (``keepalive`` + ``ping_timeout``) and one hold before the drop (the loop's
        thread not running at all that long, always: a stopped or starved process,
        :meth:`~xds_server.probing.silence.SilenceGate.unscheduled_since`, not a loop busy with its
        own work while gRPC's threads answered the PINGs; any stall, one noted
        for a burst included, while a stretch of verdicts of ours runs, younger than
        ``dial_in.burst_recovery``: :func:`~xds_server.probing.drop_burst.chain_holds`), or when
        the drop is one of a burst (:mod:`~xds_server.probing.drop_burst`)."""
        d = self.probe_cfg.dial_in
        w, at = self._drops, self._now()
        streams = w.dropped(at, max(d.burst_window.s * 2, d.drop_confirm.s + d.burst_window.s))
        if d.drop_confirm.s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._redial.wait(), d.drop_confirm.s)
        if not self._calls.empty():
            self.counters.transport_drops["redialled"] += 1
            return False, f"{detail}; the agent dialled again at once"
        span, gate = self._ours_gap_s(), self.silence_gate
        # (up to now, not the drop's read: the sampler's run that records a stop may come after it)
        if (gate.unscheduled_since(at - span, self._now(), ours_after_s(d.ping_timeout.s))  # stopped, starved
                or (chain_holds(w.stretch, at, span, d.burst_recovery.s)  # a stall noted for a burst of ours
                    and gate.stalled_since(at - span, at, d.ping_timeout.s))):
            # a PING deadline that ran out while our whole process was stopped, read after the
            # node's heartbeats queued meanwhile: its agent is heard after our stall, and cut by it
            self._judged_ours(at)
            self.counters.transport_drops["stall"] += 1
            return False, f"{detail}; cut within a hold after a stall of ours: ours, not the node's"
        if is_burst(w.drops, at, d.burst_window.s, streams, d.burst_min, d.burst_share):
            self._judged_ours(at)
            self.counters.transport_drops["burst"] += 1
            self._rl.warning(self._now(), "burst", "agent stream of %s dropped with %d others within %g ms: "
                             "judged ours (a starved control plane), not the node's death", for_log(self.node.id),
                             sum(1 for t in w.drops.times if abs(t - at) <= d.burst_window.s) - 1,
                             d.burst_window.ms)
            return False, f"{detail}; one of a burst of agent streams dropped at once: ours, not the node's"
        self.counters.transport_drops["node"] += 1
        return True, detail

    async def _silence_ours(self, silent_s: float, since_s: float) -> bool:
        """The open stream brought no heartbeat since ``since_s`` (loop s; ``silent_s`` or more ago):
        ours when as many open streams as make a burst (``burst_min``, ``burst_share``) have heard
        nothing for one and a half telemetry refreshes (:func:`~xds_server.probing.drop_burst.silent_with`:
        a starved control plane reads every stream late; one read in time hears a refresh a
        refresh). Then it is kept open, every node not heard since is held as after a stall of
        ours, and it is looked at again one bound later (counted, said); else the stream is ended
        (counted)."""
        d, w, at = self.probe_cfg.dial_in, self._drops, self._now()
        late = at - 1.5 * self.probe_cfg.transport.telemetry_refresh.s
        quiet = silent_with(late, (s.last_heard() for s in w.serving))
        if quiet < burst_size(w.open, d.burst_min, d.burst_share):
            self.counters.silent_streams["node"] += 1
            return False
        self.counters.silent_streams["burst"] += 1
        self._judged_ours(at)
        self._rl.warning(at, "silent", "agent stream of %s silent %.1f s with %d of %d others past their refresh: "
                         "judged ours (a starved control plane reads them late), kept open", for_log(self.node.id),
                         at - since_s, quiet - 1, w.open - 1)
        await asyncio.sleep(silent_s)  # a full bound more for its heartbeats to be read
        return True

    def last_heard(self) -> float | None:
        """The open stream's last heartbeat's arrival (or its opening), loop s; None: no stream."""
        st = self._stream
        return st.last_hb if st is not None else None

    def start(self) -> None:
        super().start()
        assert self._loop is not None
        self._drops = DropWatch.of(self._loop)

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:  # also when our caller is cancelled meanwhile: the agents' streams end
            for call in [self._current, *self._drain()]:
                if call is not None:
                    call.cancel("node no longer watched")
                    call.finish()

    def _drain(self) -> list[InboundCall]:
        out = []
        while not self._calls.empty():
            out.append(self._calls.get_nowait())
        return out

    async def _run(self) -> None:
        while True:
            call = await self._calls.get()
            self._redial.clear()
            if call.finished.done():
                continue
            self._current = call
            lost = False
            self._drops.serving.add(self)
            try:
                await self._serve(call)
                lost = call.transport_lost()
                detail = call.ended_by or ("transport lost (keepalive PING unanswered or connection reset)"
                                           if lost else "stream ended by agent")
            except SilentStream as e:
                detail = str(e)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let one node's session die
                detail = f"{type(e).__name__}: {clip(str(e), self.probe_cfg.limits.max_text_chars)}"
                self._rl.log(logging.ERROR, self._now(), "session", "probe session %s failed: %s",
                             for_log(self.node.id), for_log(detail, 256))
            finally:
                self._drops.serving.discard(self)
                self.connected = False
                self._current = None
                call.finish()
            if lost:
                lost_s = self._now()
                lost, detail = await self._confirm_lost(detail)
                if self._calls.empty():  # (not dialled again within drop_confirm: a return is still to come)
                    self._lost_s = lost_s
            if call.ended_by.startswith("replaced"):
                continue  # the agent's new stream follows at once: no verdict on this one
            self._ended(detail, lost, weighed=True)
            log.info("agent stream of %s closed: %s", for_log(self.node.id), for_log(detail, 256),
                     extra={"node": self.node.id, "reason": detail})


def dial_in_source(node: NodeConfig, ctx: ProbeSourceContext) -> DialInSession:
    """A :data:`~xds_server.probing.sources.ProbeSourceFactory` for a node whose agent dials in."""
    return DialInSession(node, ctx.health, ctx.sink, ctx.control_plane_id, probe=ctx.probe, counters=ctx.counters)


def probe_source(dialled: ProbeSourceFactory, dialling_in: ProbeSourceFactory | None = None) -> ProbeSourceFactory:
    """The factory of every node: ``dialled`` (a session dialling the agent, in this process or a
    worker's) for a node with ``probe_address``; for the others ``dialling_in`` (the probe workers,
    when they accept agents), by default a :class:`DialInSession` in this process."""
    inbound = dialling_in or dial_in_source

    def make(node: NodeConfig, ctx: ProbeSourceContext) -> ProbeSource:
        return inbound(node, ctx) if node.probe_address is None else dialled(node, ctx)
    return make


def dial_in_used(cfg: SentinelConfig) -> bool:
    """Whether ``cfg`` has a node whose agent dials in, or a cluster that takes registrations."""
    return any(n.probe_address is None for c in cfg.clusters for n in c.nodes) or any(
        c.discovery is not None and c.discovery.agents is not None for c in cfg.clusters)
