"""One switch-back replay exchange with one agent, on a stream of its own.

The control plane opens a separate, short-lived ``NodeProbe.Watch`` stream to each agent of a
validation (the candidate and two peers), so the probe sessions' streams and their per-node
health model are untouched (and it works whichever process holds them). The agent's first
heartbeat on that stream says whether it replays (``Heartbeat.replay_max_prompts``; 0: an older
agent, or ``--no-replay``): only then is the ``ReplayRequest`` sent. An older agent ignores the
request (an unknown oneof field: ``WhichOneof`` gives nothing), so nothing depends on it.

What comes back is checked (:func:`check_result`): a ``ReplayResult`` for another request id,
from another node, or larger than asked (more answers than prompts, more ids than
``max_tokens``, more text than ``max_chars``) is counted in
``counters.bad_fields[("replay_result", reason)]`` and ignored; the exchange keeps waiting for
the real answer until its deadline, and nothing else changes.

Shape::

    ex = ReplayExchange("gpu-a", "10.0.0.5:50051", tls=None, counters=c)
    cap = await ex.open(timeout_s=2.0)             # replay_max_prompts, or 0
    res = await ex.ask(request, max_chars, deadline)   # ReplayResult | str (why none)
    await ex.close()
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from node_probe.proto import probe_pb2, probe_pb2_grpc
from xds_server.process.cancellation import cancel_and_wait
from xds_server.process.counters import Counters
from xds_server.process.tls import ClientTls, dial

__all__ = ["ReplayExchange", "StreamReplay", "check_result"]

log = logging.getLogger("xds_server.probing")


def check_result(res: probe_pb2.ReplayResult, req: probe_pb2.ReplayRequest, node_id: str,
                 max_chars: int) -> str:
    """Why ``res`` is not the answer to ``req`` from ``node_id`` ("" when it is):
    "unknown_request_id", "wrong_node" or "larger_than_asked"."""
    if res.request_id != req.request_id:
        return "unknown_request_id"
    if res.node_id != node_id:
        return "wrong_node"
    if len(res.answers) > len(req.prompts) or (not res.error and len(res.answers) != len(req.prompts)):
        return "larger_than_asked" if len(res.answers) > len(req.prompts) else "wrong_answer_count"
    for a in res.answers:
        if len(a.token_ids) > req.max_tokens or len(a.text) > max_chars:
            return "larger_than_asked"
    return ""


class ReplayExchange:
    """A replay stream to one agent. Never raises for the agent's behaviour: :meth:`open` gives
    0 and :meth:`ask` a reason string when nothing usable came."""

    def __init__(self, node_id: str, target: str, *, tls: ClientTls | None, counters: Counters,
                 control_plane_id: str = "xds-sentinel") -> None:
        self.node_id = node_id
        self.target = target
        self._tls = tls
        self._counters = counters
        self._cp_id = control_plane_id
        self._out: asyncio.Queue[probe_pb2.ControlMessage | None] = asyncio.Queue()
        self._results: asyncio.Queue[probe_pb2.ReplayResult] = asyncio.Queue()
        self._capability: asyncio.Future[int] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._reader: asyncio.Task[None] | None = None
        self.error = ""

    async def _requests(self) -> AsyncIterator[probe_pb2.ControlMessage]:
        yield probe_pb2.ControlMessage(hello=probe_pb2.Hello(control_plane_id=f"{self._cp_id}/replay"))
        while (msg := await self._out.get()) is not None:
            yield msg

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        assert self._capability is not None
        try:
            async for msg in call:
                kind = msg.WhichOneof("msg")
                if kind == "heartbeat" and not self._capability.done():
                    self._capability.set_result(msg.heartbeat.replay_max_prompts)
                elif kind == "replay_result":
                    self._results.put_nowait(msg.replay_result)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            self.error = f"{e.code().name}: {(e.details() or '')[:200]}"
        finally:
            if not self._capability.done():
                self._capability.set_result(0)

    async def open(self, timeout_s: float) -> int:
        """Open the stream; the agent's ``replay_max_prompts`` from its first heartbeat, or 0
        (no replay, or no heartbeat within ``timeout_s``: ``error`` says which)."""
        self._capability = asyncio.get_running_loop().create_future()
        try:
            self._channel = dial(self.target, tls=self._tls)
            call = probe_pb2_grpc.NodeProbeStub(self._channel).Watch(self._requests())
        except Exception as e:  # TLS files, bad target: this agent cannot be asked
            self.error = f"{type(e).__name__}: {str(e)[:200]}"
            return 0
        self._reader = asyncio.get_running_loop().create_task(self._read(call), name=f"replay-{self.node_id}")
        try:
            return await asyncio.wait_for(asyncio.shield(self._capability), timeout_s)
        except TimeoutError:
            self.error = self.error or f"no heartbeat within {timeout_s:g} s"
            return 0

    async def ask(self, req: probe_pb2.ReplayRequest, max_chars: int,
                  deadline_s: float) -> probe_pb2.ReplayResult | str:
        """Send ``req``; the checked result, or why there is none by ``deadline_s`` (loop time)."""
        loop = asyncio.get_running_loop()
        self._out.put_nowait(probe_pb2.ControlMessage(replay=req))
        while True:
            left = deadline_s - loop.time()
            if left <= 0:
                return self.error or "no replay result before the deadline"
            try:
                res = await asyncio.wait_for(self._results.get(), left)
            except TimeoutError:
                continue
            bad = check_result(res, req, self.node_id, max_chars)
            if not bad:
                return res
            self._counters.bad_fields[("replay_result", bad)] += 1
            log.warning("replay result from the agent of %s ignored: %s", self.node_id, bad)

    async def close(self) -> None:
        """End the stream and close the channel (idempotent)."""
        self._out.put_nowait(None)
        reader, self._reader = self._reader, None
        try:
            if reader is not None:
                with contextlib.suppress(Exception):  # the reader's own failure: closing anyway
                    await cancel_and_wait(reader)
        finally:  # also when our caller is cancelled meanwhile
            channel, self._channel = self._channel, None
            if channel is not None:
                await channel.close(grace=None)


class _StreamReplayer(Protocol):
    connected: bool
    replay_max_prompts: int

    async def replay(self, req: probe_pb2.ReplayRequest, timeout_s: float) -> probe_pb2.ReplayResult | str: ...


class StreamReplay:
    """A replay over the node's own probe stream (an agent that dials in: nothing to dial), with
    :class:`ReplayExchange`'s interface. ``session``: its
    :class:`~xds_server.probing.dial_in.DialInSession`."""

    def __init__(self, node_id: str, session: _StreamReplayer, *, counters: Counters) -> None:
        self.node_id = node_id
        self._session = session
        self._counters = counters
        self.error = ""

    async def open(self, timeout_s: float) -> int:
        """The agent's ``replay_max_prompts`` from its last heartbeat; 0 without an open stream."""
        if not self._session.connected:
            self.error = "its agent has no stream open"
            return 0
        return self._session.replay_max_prompts

    async def ask(self, req: probe_pb2.ReplayRequest, max_chars: int,
                  deadline_s: float) -> probe_pb2.ReplayResult | str:
        """As :meth:`ReplayExchange.ask`, on the open stream."""
        res = await self._session.replay(req, deadline_s - asyncio.get_running_loop().time())
        if isinstance(res, str):
            return res
        bad = check_result(res, req, self.node_id, max_chars)
        if bad:
            self._counters.bad_fields[("replay_result", bad)] += 1
            log.warning("replay result from the agent of %s ignored: %s", self.node_id, bad)
            return f"replay result ignored: {bad}"
        return res

    async def close(self) -> None:
        """Nothing to close: the stream is the session's."""
