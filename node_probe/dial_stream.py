"""One dial-in stream from dial to end (:func:`run_stream`), for :mod:`node_probe.dialer`.

Shape::

    run_stream(address, hub=, register=, tls=, options=, ...)
      dial           a channel of its own (CHANNEL_OPTIONS: its own TCP connection)
      Connect        metadata x-sentinel-liveness: transport; the Register written first
      reader task    call.read() -> a queue the hub reads as the control plane's messages;
                     the first one calls on_open; EOF or an error ends the stream
      writer task    the hub's messages (StreamHub.serve) -> call.write, one write in flight,
                     each shielded so that stopping never cancels the call mid-write
      stop           done_writing, then up to grace_s for the control plane to end the call
      end            the call cancelled, the channel closed; returns why it ended
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from node_probe.proto import probe_pb2, probe_pb2_grpc
from node_probe.streams import LIVENESS_KEY, StreamHub
from xds_server.process.tls import ClientTls, dial

__all__ = ["CHANNEL_OPTIONS", "METADATA", "STOPPING", "run_stream"]

log = logging.getLogger("node_probe.dialer")

CHANNEL_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.keepalive_time_ms", 5_000),  # our PINGs: a slow back-up, the control plane pings every 100 ms
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per channel, no shared reconnect back-off
)
"""Options of every dial-in channel."""

METADATA = ((LIVENESS_KEY, "transport"),)
"""The Connect call's metadata: transport liveness from the first heartbeat."""

STOPPING = "agent stopping"
"""What :func:`run_stream` returns when ``stop`` ended the stream."""

_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # grpc-stubs 1.53 lacks grpc.aio.EOF


@dataclass(eq=False)
class _Call:
    call: Any  # grpc.aio.StreamStreamCall
    pending_write: asyncio.Future[None] | None = None


async def run_stream(address: str, *, hub: StreamHub, register: Callable[[], probe_pb2.Register],
                     tls: ClientTls | None, options: Sequence[tuple[str, object]], peer: str,
                     stop: asyncio.Event, grace_s: Callable[[], float],
                     on_open: Callable[[probe_pb2.ControlMessage], None]) -> str:
    """Dial ``address`` (``HOST:PORT``, TLS as ``tls`` says, None: plaintext) and hold one Connect
    stream: ``register()`` first, then ``hub`` serves it (as ``peer`` in its logs), until the stream
    ends or ``stop`` is set (then half-closed, cancelled after ``grace_s()`` seconds).
    ``on_open`` is called with the control plane's first message.

    Returns why the stream ended ("UNAVAILABLE: ...", "the control plane ended the stream",
    :data:`STOPPING`, ...). Raises nothing but CancelledError (the channel is closed either way).
    """
    loop = asyncio.get_running_loop()
    channel: grpc.aio.Channel | None = None
    c: _Call | None = None
    tasks: list[asyncio.Task[Any]] = []
    try:
        channel = dial(address, options=options, tls=tls)
        c = _Call(probe_pb2_grpc.ProbeHubStub(channel).Connect(metadata=METADATA))
        await c.call.write(probe_pb2.AgentMessage(register=register()))
        inbox: asyncio.Queue[probe_pb2.ControlMessage | None] = asyncio.Queue()
        reader = loop.create_task(_read(c, inbox, on_open), name=f"np-dial-{address}-reader")
        writer = loop.create_task(_write(c, hub.serve(_drain(inbox), peer, METADATA, quiet=True)),
                                  name=f"np-dial-{address}-writer")
        stopping = loop.create_task(stop.wait(), name=f"np-dial-{address}-stop")
        tasks = [writer, reader, stopping]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if stopping.done():
            await _half_close(c, writer, reader, grace_s())
            return STOPPING
        return await _why_ended(c, reader, writer)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        return await _call_error(c, exc)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if c is not None:
            c.call.cancel()
        if channel is not None:
            await channel.close(None)


async def _drain(inbox: asyncio.Queue[probe_pb2.ControlMessage | None]) -> AsyncIterator[probe_pb2.ControlMessage]:
    while (msg := await inbox.get()) is not None:
        yield msg


async def _read(c: _Call, inbox: asyncio.Queue[probe_pb2.ControlMessage | None],
                on_open: Callable[[probe_pb2.ControlMessage], None]) -> None:
    """The control plane's messages into ``inbox`` (None at its end); the first to ``on_open`` too.
    Raises the call's error."""
    first = True
    while True:
        msg = await c.call.read()
        if msg is _EOF:
            inbox.put_nowait(None)
            return
        if first:
            first = False
            on_open(msg)
        inbox.put_nowait(msg)


async def _write(c: _Call, messages: AsyncIterator[probe_pb2.AgentMessage]) -> None:
    """``messages`` to ``call.write``, one write in flight. Each write is shielded: cancelling this
    task (stop) never cancels the call in the middle of a write."""
    assert isinstance(messages, AsyncGenerator)
    try:
        async for msg in messages:
            c.pending_write = pending = asyncio.ensure_future(c.call.write(msg))
            pending.add_done_callback(_retrieve)  # a write left when the call is cancelled: no warning
            await asyncio.shield(pending)
    finally:
        await messages.aclose()  # the hub's stream closed now


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


async def _half_close(c: _Call, writer: asyncio.Task[None], reader: asyncio.Task[None], grace_s: float) -> None:
    """Stop writing (the write in flight finishes), half-close, and wait up to ``grace_s`` seconds
    (in all) for the control plane to end the stream."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(grace_s, 0.0)
    writer.cancel()
    await asyncio.gather(writer, return_exceptions=True)
    try:
        if c.pending_write is not None and not c.pending_write.done():
            await asyncio.wait([c.pending_write], timeout=max(deadline - loop.time(), 0.0))
        if c.pending_write is None or c.pending_write.done():
            await c.call.done_writing()
            await asyncio.wait([reader], timeout=max(deadline - loop.time(), 0.0))
    except Exception as exc:  # the call is cancelled after this anyway
        log.debug("half-close failed: %r", exc)


async def _why_ended(c: _Call, reader: asyncio.Task[None], writer: asyncio.Task[None]) -> str:
    """Why the stream ended (the reader or the writer finished)."""
    for task in (reader, writer):
        exc = task.exception() if task.done() and not task.cancelled() else None
        if exc is not None:
            return await _call_error(c, exc)
    if reader.done():
        code = await c.call.code()
        if code == grpc.StatusCode.OK:
            return "the control plane ended the stream"
        return f"{code.name}: {await c.call.details()}"
    return "the agent ended the stream"


def _rpc_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


async def _call_error(c: _Call | None, exc: BaseException) -> str:
    """The call's status when it has one (UNAVAILABLE: ...), else the exception."""
    if isinstance(exc, grpc.aio.AioRpcError) or c is None or not c.call.done():
        return _rpc_error(exc)
    try:
        code = await c.call.code()
        return f"{code.name}: {await c.call.details()}"
    except Exception:
        return _rpc_error(exc)
