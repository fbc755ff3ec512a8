"""The probe hub: where agents dial in (``node_probe.v1.ProbeHub.Connect``), on the control
plane's gRPC port beside ADS and LRS (or ``probe.dial_in.listen``), with its TLS.

Per stream: the agent's first message must be a ``Register`` within
``probe.dial_in.register_timeout``; it is checked (:func:`~xds_server.probing.claims.claim_from`)
and judged against the serving config and the agent's certificate
(:func:`~xds_server.probing.claims.judge_claim`). Accepted: a registration is recorded
(``register``, the discovery registry: the node joins its cluster through the reload path), the
node's :class:`~xds_server.probing.dial_in.DialInSession` is awaited and the stream handed to it
until it ends. Refused: counted (``<prefix>_access_refused_total{port="xds",reason}``,
``agent_identity`` or ``agent_claim``), logged once per identity and interval, and answered with
PERMISSION_DENIED or FAILED_PRECONDITION naming the reason; a Register that is missing or bad is
INVALID_ARGUMENT, counted in ``malformed``.

Shape::

    hub = ProbeHub(config=lambda: cfg, session_of=sessions.get, registry=discovery.agents,
                   refusals=refusals, counters=counters, identity_checked=lambda: True, now=loop.time)
    hub.add_to_server(grpc_server)
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc

from node_probe.proto import probe_pb2, probe_pb2_grpc
from xds_server.config import NodeConfig, SentinelConfig
from xds_server.config.duration import Duration
from xds_server.probing.claims import Claim, claim_from, judge_claim
from xds_server.probing.dial_in import DialInSession, InboundCall
from xds_server.process.counters import Counters
from xds_server.process.grpc_wakeups import start_server
from xds_server.process.identity import PeerIdentity
from xds_server.process.refusals import Refusals
from xds_server.process.stream_refusal import refuse
from xds_server.process.tls import add_port
from xds_server.process.untrusted import RateLimitedLog, for_log

__all__ = ["ProbeHub", "RegisterReader", "Registry", "serve_hub"]

log = logging.getLogger("xds_server.probing")

_SESSION_WAIT_STEP_S = 0.01
"""How often a registered node's session is looked for while the registration is applied (s)."""


class Registry(Protocol):
    """What the hub needs of the nodes that registered themselves
    (:class:`~xds_server.discovery.agent_registry.AgentRegistry`)."""

    def __contains__(self, node_id: object) -> bool: ...

    def register(self, cluster: str, node: NodeConfig, now_s: float) -> bool: ...

    def stream(self, node_id: str, opened: bool, now_s: float) -> None: ...


class ProbeHub(probe_pb2_grpc.ProbeHubServicer):
    """Accepts agents' streams (see the module docstring). ``session_of(node_id)``: the node's
    probe source, if any; ``identity_checked()``: the port verifies client certificates (mTLS);
    ``now()``: the loop's clock (s). ``accepted``/``refused``: streams so far."""

    def __init__(self, *, config: Callable[[], SentinelConfig], session_of: Callable[[str], object | None],
                 registry: Registry, refusals: Refusals, counters: Counters,
                 identity_checked: Callable[[], bool], now: Callable[[], float]) -> None:
        self._config = config
        self._session_of = session_of
        self._registry = registry
        self._refusals = refusals
        self._identity_checked = identity_checked
        self._now = now
        self.accepted = self.refused = 0
        self._reader = RegisterReader(counters, now)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        probe_pb2_grpc.add_ProbeHubServicer_to_server(self, server)

    async def serve(self, listen: str, creds: grpc.ServerCredentials | None,
                    cfg: SentinelConfig) -> tuple[grpc.aio.Server, int]:
        """Serve the hub alone on ``listen`` (``probe.dial_in.listen``) with the xDS port's
        credentials and the agents' keepalive; returns the server and its bound port. Raises
        OSError when the address cannot be bound."""
        return await serve_hub(self, listen, creds, [
            ("grpc.max_receive_message_length", cfg.xds.limits.max_receive_message_bytes),
            ("grpc.so_reuseport", 0), *cfg.probe.dial_in_options()])

    async def Connect(  # gRPC method name
        self, request_iterator: AsyncIterator[probe_pb2.AgentMessage], context: grpc.aio.ServicerContext,
    ) -> None:
        claim = await self._reader.claim(request_iterator, context, self._config().probe.dial_in.register_timeout)
        if claim is None:
            return
        ident = PeerIdentity.from_auth_context(context.auth_context())
        session, code, why = await self.admit(claim, ident, context.peer() or "?", DialInSession)
        if not isinstance(session, DialInSession):
            await refuse(context, request_iterator, code, why)
        nid = claim.node.id
        self.streamed(nid, True)
        try:
            await session.attach(InboundCall(request_iterator, context))
        finally:
            self.streamed(nid, False)

    async def admit(self, claim: Claim, ident: PeerIdentity, peer: str,
                    kind: type) -> tuple[object | None, grpc.StatusCode, str]:
        """Judge ``claim`` (from ``peer``, whose certificate says ``ident``): refused (counted,
        logged), or registered when the cluster takes it; then the node's probe source of type
        ``kind``, waited for up to ``register_timeout`` while a registration is applied.
        Returns (the source, OK, "") or (None, the status to end the stream with, why)."""
        cfg = self._config()
        verdict = judge_claim(claim, cfg, ident, identity_checked=self._identity_checked(),
                              registered=self._registry)
        nid = claim.node.id
        if verdict.action == "refuse":
            self.refused += 1
            reason = "agent_identity" if verdict.refusal == "permission" else "agent_claim"
            self._refusals.refuse("xds", reason, peer, ", ".join(ident.names()), verdict.reason)
            code = grpc.StatusCode.PERMISSION_DENIED if verdict.refusal == "permission" \
                else grpc.StatusCode.FAILED_PRECONDITION
            return None, code, verdict.reason
        if verdict.action == "register":
            assert verdict.node is not None
            if self._registry.register(verdict.cluster, verdict.node, self._now()):
                log.info("node %s registered by its agent in cluster %s (%s, identity %s)", for_log(nid),
                         verdict.cluster, verdict.node.address, for_log(ident.describe(), 200),
                         extra={"node": nid, "reason": "registered"})
        session = await self._session(nid, cfg.probe.dial_in.register_timeout.s, kind)
        if session is None:
            return None, grpc.StatusCode.UNAVAILABLE, f"node {nid!r} is not watched yet: dial again"
        self.accepted += 1
        return session, grpc.StatusCode.OK, ""

    def streamed(self, node_id: str, opened: bool) -> None:
        """An admitted stream of ``node_id`` began (``opened``) or ended: a registered node is
        forgotten only ``forget_after`` after its last stream ended."""
        if node_id in self._registry:
            self._registry.stream(node_id, opened, self._now())

    async def _session(self, node_id: str, wait_s: float, kind: type) -> object | None:
        """The node's probe source if it is a ``kind``, waiting up to ``wait_s`` for a
        registration to be applied."""
        deadline = self._now() + wait_s
        while True:
            s = self._session_of(node_id)
            if isinstance(s, kind):
                return s
            if self._now() >= deadline:
                return None
            await asyncio.sleep(_SESSION_WAIT_STEP_S)


async def serve_hub(servicer: probe_pb2_grpc.ProbeHubServicer, listen: str, creds: grpc.ServerCredentials | None,
                    options: list[tuple[str, int]]) -> tuple[grpc.aio.Server, int]:
    """A gRPC server of ``servicer`` alone on ``listen`` with ``options`` (plaintext when
    ``creds`` is None), started; returns it and its bound port. Raises OSError when the address
    cannot be bound."""
    server = grpc.aio.server(options=options)
    probe_pb2_grpc.add_ProbeHubServicer_to_server(servicer, server)
    try:
        port = add_port(server, listen, creds)
    except RuntimeError as exc:  # grpc raises RuntimeError when the bind fails
        raise OSError(f"cannot bind probe.dial_in.listen {listen}: in use or not permitted ({exc})") from exc
    if not port:
        raise OSError(f"cannot bind probe.dial_in.listen {listen}: in use or not permitted")
    await start_server(server)
    return server, port


class RegisterReader:
    """Reads the Register that opens an agent's stream (the in-process hub's and the probe
    workers'): a stream that brings none in time, something else first, or a Register that does
    not check is ended (INVALID_ARGUMENT, DEADLINE_EXCEEDED), counted in ``malformed`` and
    logged at most once per kind and 10 s."""

    def __init__(self, counters: Counters, now: Callable[[], float]) -> None:
        self._counters = counters
        self._now = now
        self._rl = RateLimitedLog(log, 10.0, max_keys=256)

    async def claim(self, requests: AsyncIterator[probe_pb2.AgentMessage], context: grpc.aio.ServicerContext,
                    timeout: Duration) -> Claim | None:
        """The stream's checked Register (:func:`~xds_server.probing.claims.claim_from`), or
        None: the agent went away first, or the stream was ended as bad."""
        peer = context.peer() or "?"
        try:
            first = await asyncio.wait_for(anext(requests, None), timeout.s)
        except TimeoutError:
            await self._bad(context, peer, grpc.StatusCode.DEADLINE_EXCEEDED, f"no Register within {timeout}")
            return None
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            return None  # the agent went away before saying anything
        if first is None:
            return None
        if first.WhichOneof("msg") != "register":
            await self._bad(context, peer, grpc.StatusCode.INVALID_ARGUMENT,
                            "the first message of a Connect stream must be a Register")
            return None
        try:
            return claim_from(first.register)
        except ValueError as e:
            await self._bad(context, peer, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return None

    async def _bad(self, context: grpc.aio.ServicerContext, peer: str, code: grpc.StatusCode, why: str) -> None:
        self._counters.malformed["(agent stream)"] += 1
        self._rl.warning(self._now(), f"bad:{why[:40]}", "agent stream from %s ended: %s", for_log(peer, 80),
                         for_log(why, 300))
        await context.abort(code, why)
