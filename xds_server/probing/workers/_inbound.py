"""Agents that dial in, accepted by the probe workers themselves.

With ``probe.workers`` >= 1 and ``probe.dial_in.listen`` set, every worker serves
``ProbeHub.Connect`` on that address with ``SO_REUSEPORT``: the kernel spreads the agents'
connections over the workers, so more cores hold more streams and run more per-node models. A
worker reads the stream's Register (:class:`~xds_server.probing.hub.RegisterReader`) and asks the
main process for the verdict (``("claim", token, claim, identity, peer)``): the main process
judges it as its own hub would (identity, config, registration) and makes the accepting worker the
node's owner (the node moves, with its current health, from the worker that watched it before),
then answers ``("verdict", token, status name, why)``. The stream is then served by the worker's
:class:`~xds_server.probing.dial_in.DialInSession` for that node, exactly as in one process.
Streams opened and ended are told to the main process (``("stream", node_id, opened)``) for the
registry of self-registered nodes.

Shape::

    hub = WorkerHub(ask=worker.ask, session_of=worker.sessions.get, tell=worker.send,
                    probe=lambda: worker.probe, counters=worker.counters, now=loop.time)
    server, port = await hub.serve("0.0.0.0:18001", accept)   # accept: AcceptSpec from the main process
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple

import grpc

from node_probe.proto import probe_pb2, probe_pb2_grpc
from xds_server.config import ProbeConfig
from xds_server.config.tls import ListenerTls
from xds_server.probing.claims import Claim
from xds_server.probing.dial_in import DialInSession, InboundCall
from xds_server.probing.hub import RegisterReader, serve_hub
from xds_server.process.counters import Counters
from xds_server.process.identity import PeerIdentity
from xds_server.process.stream_refusal import refuse
from xds_server.process.tls import listener_credentials

__all__ = ["AcceptSpec", "WorkerHub"]

_VERDICT_SLACK_S = 1.0
"""The main process's verdict is waited for ``register_timeout`` plus this (s): it may wait that
long itself for a registration to be applied."""


class AcceptSpec(NamedTuple):
    """What a worker needs to accept agents (sent in its init message): the address, the xDS
    port's TLS (``tls.listener()``), the largest message taken (bytes) and the keepalive
    options (``probe.dial_in_options()``)."""

    listen: str
    tls: ListenerTls
    max_receive_bytes: int
    options: list[tuple[str, int]]


class WorkerHub(probe_pb2_grpc.ProbeHubServicer):
    """One worker's side of ``ProbeHub.Connect`` (see the module docstring). ``ask(claim,
    identity, peer)``: the main process's verdict, (status, why); ``session_of(node_id)``: this
    worker's session of the node, if any; ``tell(message)``: a message to the main process;
    ``probe()``: the thresholds in force."""

    def __init__(self, *, ask: Callable[[Claim, PeerIdentity, str], Awaitable[tuple[grpc.StatusCode, str]]],
                 session_of: Callable[[str], object | None], tell: Callable[[tuple], None],
                 probe: Callable[[], ProbeConfig], counters: Counters, now: Callable[[], float]) -> None:
        self._ask = ask
        self._session_of = session_of
        self._tell = tell
        self._probe = probe
        self._reader = RegisterReader(counters, now)
        self.accepted = 0

    async def serve(self, accept: AcceptSpec) -> tuple[grpc.aio.Server, int]:
        """Serve on ``accept.listen`` beside the other workers (``SO_REUSEPORT``); returns the
        server and its port. Raises OSError when the address cannot be bound or the TLS files
        do not load."""
        creds, _ = listener_credentials(**accept.tls)
        return await serve_hub(self, accept.listen, creds, [
            ("grpc.max_receive_message_length", accept.max_receive_bytes), ("grpc.so_reuseport", 1), *accept.options])

    async def Connect(  # gRPC method name
        self, request_iterator: AsyncIterator[probe_pb2.AgentMessage], context: grpc.aio.ServicerContext,
    ) -> None:
        timeout = self._probe().dial_in.register_timeout
        claim = await self._reader.claim(request_iterator, context, timeout)
        if claim is None:
            return
        ident = PeerIdentity.from_auth_context(context.auth_context())
        try:
            code, why = await asyncio.wait_for(self._ask(claim, ident, context.peer() or "?"),
                                               timeout.s + _VERDICT_SLACK_S)
        except TimeoutError:
            code, why = grpc.StatusCode.UNAVAILABLE, "the control plane did not answer in time: dial again"
        nid = claim.node.id
        session = self._session_of(nid) if code is grpc.StatusCode.OK else None
        if not isinstance(session, DialInSession):
            await refuse(context, request_iterator, code if code is not grpc.StatusCode.OK
                         else grpc.StatusCode.UNAVAILABLE, why or f"node {nid!r} is not watched here: dial again")
        self.accepted += 1
        self._tell(("stream", nid, True))
        try:
            await session.attach(InboundCall(request_iterator, context))
        finally:
            self._tell(("stream", nid, False))
