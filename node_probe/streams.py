"""The agent's streams (:class:`StreamHub`): the ``Watch`` streams control planes open, and the
dial-in ``ProbeHub.Connect`` streams (:mod:`node_probe.dialer`), served alike: per stream, a
bounded outbound queue, a fixed-rate heartbeat loop and a reader of the control plane's messages;
probe results are fanned out to every open stream.

Liveness per stream (the control plane's ``Hello.liveness``): heartbeat (the default, and what a
control plane that does not ask gets) sends a heartbeat every interval; transport (when this agent
takes it, ``transport_liveness``) leaves liveness to HTTP/2 PINGs and sends a heartbeat only when
what the control plane judges by changes (:func:`change_key`: engine state, stall flag, GPU
faults) or ``telemetry_refresh_ms`` passed since the last one; each says ``liveness`` TRANSPORT.

A heartbeat or pong is queued as a placeholder and turned into its message only when the stream
writes it, so a heartbeat carries the telemetry of the moment it leaves (never waits on a scrape,
a probe or NVML) and a pong's ``processing_us`` covers the time it waited in the queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from node_probe.proto import probe_pb2
from node_probe.replay import Replayer
from node_probe.ticks import sleep_until_tick

__all__ = ["LIVENESS_KEY", "REFRESH_KEY", "StreamHub", "change_key"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _HeartbeatTick:
    seq: int


@dataclass(frozen=True)
class _PendingPong:
    seq: int
    received_ns: int


_CLOSE = object()
_LIVENESS = {False: probe_pb2.LIVENESS_UNSPECIFIED, True: probe_pb2.LIVENESS_TRANSPORT}
_DEFAULT_REFRESH_MS = 1000
LIVENESS_KEY = "x-sentinel-liveness"
"""Call metadata a control plane asks for a liveness mode with ("transport"; else heartbeat)."""
REFRESH_KEY = "x-sentinel-telemetry-refresh-ms"
"""Call metadata: the transport-liveness refresh (ms, decimal)."""
"""A transport-liveness refresh when the Hello names none (ms; the control plane's default)."""


def change_key(tel: probe_pb2.Telemetry) -> tuple[Any, ...]:
    """What a transport-liveness heartbeat is sent at once for when it changes: the engine state,
    the stall flag, and the GPU faults (NVML state, per GPU its Xid events and uncorrected ECC
    count). Load, progress and GPU memory ride on the next refresh."""
    g = tel.gpu
    return (tel.engine_state, tel.stalled, g.state,
            tuple((r.index, tuple(r.xid_events), r.ecc_uncorrected) for r in g.gpus))


@dataclass(eq=False)
class _Stream:
    id: int
    peer: str
    queue: asyncio.Queue[Any]
    control_plane_id: str = ""
    transport: bool = False  # liveness by HTTP/2 PINGs: heartbeats on change and refresh only
    refresh_s: float = _DEFAULT_REFRESH_MS / 1000.0
    hb_seq: int = 0
    dropped: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    log_level: int = logging.INFO  # of the open, hello and close lines


class StreamHub:
    """The open ``Watch`` streams of one agent.

    Args:
        node_id: sent in every heartbeat.
        heartbeat_interval_ms: heartbeat period per stream, in ms.
        queue_max: outbound messages buffered per stream; beyond it messages for that stream
            are dropped (and counted) rather than growing memory for a stuck client.
        telemetry: returns the telemetry a heartbeat sent now carries (must not block).
        on_probe_now: called with the reason of each ``ProbeNow`` received.
        transport_liveness: take a control plane's request for transport liveness (False: behave
            as an agent before it, heartbeats every interval whatever the Hello asks).
        replayer: runs each ``ReplayRequest`` (:class:`~node_probe.replay.Replayer`; its result goes
            back on the stream that asked); None: requests are ignored, as an agent without replay
            does, and heartbeats say ``replay_max_prompts`` 0.
    """

    def __init__(self, *, node_id: str, heartbeat_interval_ms: int, queue_max: int,
                 telemetry: Callable[[], probe_pb2.Telemetry],
                 on_probe_now: Callable[[str], None], transport_liveness: bool = True,
                 replayer: Replayer | None = None) -> None:
        self._transport_ok = transport_liveness
        self._replayer = replayer
        self._node_id = node_id
        self._interval_ms = heartbeat_interval_ms
        self._queue_max = queue_max
        self._telemetry = telemetry
        self._on_probe_now = on_probe_now
        self._streams: set[_Stream] = set()
        self._ids = itertools.count(1)
        self._closed = False

    def __len__(self) -> int:
        """Number of open streams."""
        return len(self._streams)

    def broadcast(self, msg: probe_pb2.AgentMessage) -> None:
        """Queue ``msg`` on every open stream (dropped, and counted, where a queue is full)."""
        for st in list(self._streams):
            self._enqueue(st, msg)

    async def serve(self, requests: AsyncIterator[probe_pb2.ControlMessage], peer: str,
                    metadata: Iterable[tuple[str, Any]] | None = None, *,
                    quiet: bool = False) -> AsyncIterator[probe_pb2.AgentMessage]:
        """The outbound messages of one stream, until the client cancels or :meth:`close`;
        its tasks and queue are cleaned up either way. Yields nothing after :meth:`close`.
        ``metadata``: the call's invocation metadata; ``x-sentinel-liveness: transport`` (and
        ``x-sentinel-telemetry-refresh-ms``) asks for transport liveness before the first
        heartbeat, as the Hello does once read. ``quiet``: the stream's open, hello and close
        lines at DEBUG (a caller that logs its own, rate-limited: the dial-in streams)."""
        loop = asyncio.get_running_loop()
        st = _Stream(id=next(self._ids), peer=peer, queue=asyncio.Queue(maxsize=self._queue_max),
                     log_level=logging.DEBUG if quiet else logging.INFO)
        md = dict(metadata or ())
        if self._transport_ok and md.get(LIVENESS_KEY) == "transport":
            st.transport = True
            refresh = str(md.get(REFRESH_KEY, ""))
            st.refresh_s = (int(refresh) if refresh.isdigit() and 0 < int(refresh) <= 3_600_000
                            else _DEFAULT_REFRESH_MS) / 1000.0
        if self._closed:
            return
        self._streams.add(st)
        log.log(st.log_level, "stream %d opened by %s", st.id, st.peer)
        st.tasks.append(loop.create_task(self._heartbeat_loop(st), name=f"np-stream-{st.id}-heartbeat"))
        st.tasks.append(loop.create_task(self._read_loop(st, requests), name=f"np-stream-{st.id}-reader"))
        try:
            while True:
                item = await st.queue.get()
                if item is _CLOSE:
                    return
                yield self._materialize(item, st)
        finally:
            await self._close_stream(st)

    def end_all(self) -> None:
        """Ask every stream to end cleanly (after what is queued); refuse new ones."""
        self._closed = True
        for st in list(self._streams):
            try:
                st.queue.put_nowait(_CLOSE)
            except asyncio.QueueFull:
                pass  # the gRPC server stop cancels it

    async def close(self) -> None:
        """Refuse new streams and cancel every open one's tasks."""
        self._closed = True
        for st in list(self._streams):
            await self._close_stream(st)

    # -- per stream ------------------------------------------------------------------------------

    def _enqueue(self, st: _Stream, item: Any) -> None:
        try:
            st.queue.put_nowait(item)
        except asyncio.QueueFull:
            st.dropped += 1
            if st.dropped == 1 or st.dropped % 100 == 0:
                log.warning("stream %d (%s): outbound queue full, %d message(s) dropped",
                            st.id, st.peer, st.dropped)

    async def _heartbeat_loop(self, st: _Stream) -> None:
        loop = asyncio.get_running_loop()
        period = self._interval_ms / 1000.0
        next_t = loop.time()  # first heartbeat as soon as the stream opens
        sent_key: tuple[Any, ...] | None = None
        sent_at = next_t
        while True:
            if st.transport:  # a heartbeat only on change or refresh, the change seen within a period
                key = change_key(self._telemetry())
                if key != sent_key or loop.time() - sent_at >= st.refresh_s - period / 2:
                    sent_key, sent_at = key, loop.time()
                    st.hb_seq += 1
                    self._enqueue(st, _HeartbeatTick(st.hb_seq))
            else:
                sent_key = None  # the first heartbeat in transport mode is sent at once
                st.hb_seq += 1
                self._enqueue(st, _HeartbeatTick(st.hb_seq))
            next_t = await sleep_until_tick(loop, next_t + period, period)

    async def _read_loop(self, st: _Stream, requests: AsyncIterator[probe_pb2.ControlMessage]) -> None:
        try:
            async for msg in requests:
                kind = msg.WhichOneof("msg")
                if kind == "ping":
                    self._enqueue(st, _PendingPong(msg.ping.seq, time.perf_counter_ns()))
                elif kind == "probe_now":
                    self._on_probe_now(msg.probe_now.reason or f"stream {st.id}")
                elif kind == "replay" and self._replayer is not None:
                    st.tasks.append(asyncio.get_running_loop().create_task(
                        self._replay(st, msg.replay), name=f"np-stream-{st.id}-replay"))
                elif kind == "hello":
                    st.control_plane_id = msg.hello.control_plane_id
                    if msg.hello.liveness != probe_pb2.LIVENESS_UNSPECIFIED:  # (else: as the metadata said)
                        st.transport = self._transport_ok and msg.hello.liveness == probe_pb2.LIVENESS_TRANSPORT
                    if msg.hello.telemetry_refresh_ms:
                        st.refresh_s = msg.hello.telemetry_refresh_ms / 1000.0
                    log.log(st.log_level, "stream %d: hello from control plane %r (%s), liveness %s",
                             st.id, st.control_plane_id, st.peer, "transport" if st.transport else "heartbeat")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the client went away; the writer ends too
            log.debug("stream %d: read side ended: %r", st.id, exc)
        # Half-closed by the client: keep sending heartbeats until it cancels.

    async def _replay(self, st: _Stream, req: probe_pb2.ReplayRequest) -> None:
        assert self._replayer is not None
        result = await self._replayer.run(req)
        self._enqueue(st, probe_pb2.AgentMessage(replay_result=result))

    def _materialize(self, item: Any, st: _Stream) -> probe_pb2.AgentMessage:
        if isinstance(item, _HeartbeatTick):
            return probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(
                seq=item.seq, interval_ms=self._interval_ms, node_id=self._node_id,
                telemetry=self._telemetry(), liveness=_LIVENESS[st.transport],
                replay_max_prompts=self._replayer.advertised if self._replayer is not None else 0))
        if isinstance(item, _PendingPong):
            processing_us = (time.perf_counter_ns() - item.received_ns) // 1000
            return probe_pb2.AgentMessage(pong=probe_pb2.Pong(seq=item.seq, processing_us=processing_us))
        return item

    async def _close_stream(self, st: _Stream) -> None:
        if st not in self._streams:
            return
        self._streams.discard(st)
        for task in st.tasks:
            task.cancel()
        await asyncio.gather(*st.tasks, return_exceptions=True)
        st.tasks.clear()
        log.log(st.log_level, "stream %d closed (%s, control plane %r, %d dropped)",
                 st.id, st.peer, st.control_plane_id, st.dropped)
