"""Dial-in (:class:`ControlPlaneDialer`): the agent is the gRPC client. It dials every control-plane
replica and holds one ``ProbeHub.Connect`` stream to each; after its ``Register`` a stream carries
what a ``Watch`` stream carries, served by the same :class:`~node_probe.streams.StreamHub`.

Shape::

    ControlPlaneDialer(targets, hub, register, tls=None)
      start()                 one task per target HOST:PORT
        per target            an IP literal is one address; a DNS name is resolved (loop.getaddrinfo)
                              at start, before each re-dial and every resolve_interval_s, and each
                              address it resolves to gets a link of its own
          per address (link)  dial -> one stream -> it ends -> re-dial (back-off) -> dial ...
            per stream        :func:`~node_probe.dial_stream.run_stream`: a channel of its own (its
                              own TCP connection), Connect with ``x-sentinel-liveness: transport``,
                              the Register written first, then served by the hub
      stop(grace_s)           half-closes every stream (done_writing), waits up to grace_s for the
                              control plane to end it, then cancels it; closes the channels

Re-dial: at once after a stream that the control plane held :data:`~node_probe.targets.STABLE_S`
(10 s) ends; after consecutive ends of streams held less or never up, full-jitter exponential
back-off (:func:`~node_probe.targets.backoff_s`: uniform in [0, 50 ms], [0, 100 ms], ... up to
[0, 5 s]; :func:`~node_probe.targets.failures_after`). An overloaded control plane that drops
streams soon after it takes them is dialled back spread out, not by the whole fleet in step.
Nothing ends a link but :meth:`~ControlPlaneDialer.stop` and its address leaving the target's
resolution: every error is recorded and logged, never raised.

Logs per link, and per target for its resolution (:class:`~node_probe.targets.FailureLog`): one
warning at the first failure of a run, then at most one a minute with the count; one info line
when a stream opens (its first message from the control plane) and one when it closes.

Liveness: the control plane PINGs every connection (HTTP/2, answered in gRPC's C core), so the hub
runs transport liveness on these streams (heartbeats on change and refresh). The client's own
keepalive (:data:`~node_probe.dial_stream.CHANNEL_OPTIONS`: 5 s, 5 s timeout) is only a slow
back-up for a frozen control-plane host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from node_probe.dial_stream import CHANNEL_OPTIONS, run_stream
from node_probe.proto import probe_pb2
from node_probe.streams import StreamHub
from node_probe.targets import (
    STABLE_S,
    FailureLog,
    backoff_s,
    failures_after,
    is_ip_literal,
    join_host_port,
    split_target,
)
from xds_server.process.tls import ClientTls

__all__ = ["ControlPlaneDialer", "TargetState"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetState:
    """One target's dial-in state (:meth:`ControlPlaneDialer.states`).

    Attributes:
        target: the ``HOST:PORT`` given.
        addresses: the addresses it resolved to last (``HOST:PORT``; an IP literal: itself).
        streams: streams open to it (a message received and not ended).
        dials: streams opened or tried so far.
        last_error: why the latest stream or resolution failed or ended ("" before any).
    """

    target: str
    addresses: tuple[str, ...]
    streams: int
    dials: int
    last_error: str

    @property
    def connected(self) -> bool:
        """At least one stream open."""
        return self.streams > 0


@dataclass(eq=False)
class _Link:
    address: str  # HOST:PORT dialled, an IP literal
    what: str  # for logs: the target, and the address when it is a name's
    flog: FailureLog
    connected: bool = False  # the current stream received a message


@dataclass(eq=False)
class _Target:
    text: str
    host: str
    port: int
    literal: bool
    flog: FailureLog
    addresses: tuple[str, ...] = ()
    links: dict[str, _Link] = field(default_factory=dict)
    dials: int = 0
    last_error: str = ""


class ControlPlaneDialer:
    """One ``ProbeHub.Connect`` stream per control-plane address (see the module docstring).

    Args:
        targets: control planes, each ``HOST:PORT`` (an IP literal: one stream; a DNS name: one per
            address it resolves to).
        hub: serves every stream as it serves a ``Watch`` stream.
        register: returns the ``Register`` written first on each stream (called at each dial).
        tls: verify the control plane (and, with a client certificate, mutual TLS); the files are
            re-read at a dial when they changed. For a DNS name the certificate must name the host
            (unless ``tls.server_name`` says otherwise). None: plaintext.
        backoff_base_s, backoff_max_s: re-dial back-off bounds, s
            (:func:`~node_probe.targets.backoff_s`).
        stable_s: a stream held this long (s) starts the back-off over
            (:func:`~node_probe.targets.failures_after`).
        resolve_interval_s: a DNS name is resolved again this often (s), so new replicas are
            dialled while every stream stays up.

    Raises:
        ValueError: (on construction) a target is not ``HOST:PORT`` or is given twice.
    """

    def __init__(self, targets: Sequence[str], hub: StreamHub, register: Callable[[], probe_pb2.Register], *,
                 tls: ClientTls | None = None, backoff_base_s: float = 0.05, backoff_max_s: float = 5.0,
                 stable_s: float = STABLE_S, resolve_interval_s: float = 30.0) -> None:
        self._targets: list[_Target] = []
        for text in targets:
            host, port = split_target(text)
            if any(t.text == text for t in self._targets):
                raise ValueError(f"control plane given twice: {text!r}")
            self._targets.append(_Target(text, host, port, is_ip_literal(host), FailureLog(f"control plane {text}")))
        self._hub = hub
        self._register = register
        self._tls = tls
        self._backoff = (backoff_base_s, backoff_max_s)
        self._stable_s = stable_s
        self._resolve_interval_s = resolve_interval_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop_event = asyncio.Event()
        self._grace_s = 0.5
        self._started = False
        self._stopping = False

    # -- public state --------------------------------------------------------------------------

    @property
    def open_streams(self) -> int:
        """Streams open now (a message received from the control plane and not ended)."""
        return sum(link.connected for t in self._targets for link in t.links.values())

    def states(self) -> dict[str, TargetState]:
        """Per target (as given): its addresses, open streams, dials and last error."""
        return {t.text: TargetState(t.text, t.addresses, sum(lk.connected for lk in t.links.values()),
                                    t.dials, t.last_error) for t in self._targets}

    # -- start / stop --------------------------------------------------------------------------

    def start(self) -> None:
        """Start dialling every target (from the running event loop); returns at once.

        Raises:
            RuntimeError: already started, or no running event loop.
        """
        if self._started:
            raise RuntimeError("dialer already started")
        self._started = True
        for t in self._targets:
            self._spawn(self._target_loop(t), f"np-dial-{t.text}")

    async def stop(self, grace_s: float = 0.5) -> None:
        """Half-close every stream, wait up to ``grace_s`` seconds for the control planes to end
        them, then cancel what is left and close the channels. Idempotent; never raises."""
        if self._stopping:
            return
        self._stopping = True
        self._grace_s = max(grace_s, 0.0)
        self._stop_event.set()
        tasks = list(self._tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self._grace_s + 1.0)
        for task in pending:  # a dial stuck in its connect: its finally closes the channel
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    # -- per target ----------------------------------------------------------------------------

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sleep(self, delay_s: float) -> bool:
        """Wait ``delay_s`` seconds or until :meth:`stop`; True when stopping."""
        if delay_s > 0 and not self._stopping:
            try:
                await asyncio.wait_for(self._stop_event.wait(), delay_s)
            except TimeoutError:
                pass
        else:
            await asyncio.sleep(0)
        return self._stopping

    async def _target_loop(self, t: _Target) -> None:
        """Start the target's links: its one address (an IP literal), else its resolution now and
        every ``resolve_interval_s`` (a failed one retried with back-off)."""
        if t.literal:
            t.addresses = (join_host_port(t.host, t.port),)
            self._spawn_links(t)
            return
        failures = 0
        while not self._stopping:
            if await self._resolve(t):
                failures, delay = 0, self._resolve_interval_s
            else:
                failures += 1
                delay = backoff_s(failures + 1, *self._backoff)
            if await self._sleep(delay):
                return

    async def _resolve(self, t: _Target) -> bool:
        """Resolve a DNS target; on success its addresses are updated and new ones get a link.
        False (recorded, logged rate-limited) when it does not resolve."""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(t.host, t.port, type=socket.SOCK_STREAM)
            addresses = tuple(dict.fromkeys(join_host_port(str(i[4][0]), t.port) for i in infos))
        except (OSError, UnicodeError) as exc:
            addresses, error = (), f"{type(exc).__name__}: {exc}"
        else:
            error = "resolves to no address"
        if not addresses:
            t.last_error = f"cannot resolve {t.host}: {error}"
            t.flog.failed(t.last_error)
            return False
        if t.flog.recovered():
            log.info("control plane %s resolves again", t.text)
        if addresses != t.addresses:
            log.info("control plane %s resolves to %s", t.text, ", ".join(addresses))
        t.addresses = addresses
        self._spawn_links(t)
        return True

    def _spawn_links(self, t: _Target) -> None:
        for address in t.addresses:
            if address not in t.links and not self._stopping:
                what = t.text if t.literal else f"{t.text} ({address})"
                link = t.links[address] = _Link(address, what, FailureLog(f"control plane {what}"))
                self._spawn(self._link_loop(t, link), f"np-dial-{address}")

    # -- per address ---------------------------------------------------------------------------

    async def _link_loop(self, t: _Target, link: _Link) -> None:
        """Dial ``link``'s address again and again until :meth:`stop` or it leaves the target's
        resolution; never raises (but for cancellation)."""
        failures = 0
        try:
            while not self._stopping:
                try:
                    held_s = await self._session(t, link)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug of ours: the loop goes on
                    log.exception("control plane %s: dial failed unexpectedly", link.what)
                    held_s = None
                failures = failures_after(failures, held_s, self._stable_s)
                if await self._sleep(backoff_s(failures, *self._backoff)):
                    return
                if not t.literal and await self._resolve(t) and link.address not in t.addresses:
                    log.info("control plane %s: %s no longer resolved, not dialled again", t.text, link.address)
                    return
        finally:
            if t.links.get(link.address) is link:
                del t.links[link.address]

    def _tls_for(self, t: _Target) -> ClientTls | None:
        if self._tls is None or self._tls.server_name or t.literal:
            return self._tls
        return dataclasses.replace(self._tls, server_name=t.host)  # the name, not the address dialled

    async def _session(self, t: _Target, link: _Link) -> float | None:
        """One stream to ``link``'s address (:func:`~node_probe.dial_stream.run_stream`), until it ends
        or :meth:`stop`: the seconds from the control plane's first message on it to its end, None
        when it sent none (the stream was never up). Its error is recorded and logged, not raised."""
        t.dials += 1
        link.connected = False
        loop = asyncio.get_running_loop()
        opened_at: float | None = None

        def opened(first: probe_pb2.ControlMessage) -> None:
            nonlocal opened_at
            opened_at = loop.time()
            link.connected = True
            failed = link.flog.recovered()
            cp = f", control plane {first.hello.control_plane_id!r}" if first.WhichOneof("msg") == "hello" else ""
            log.info("control plane %s: stream open%s%s", link.what, cp,
                     f" after {failed} failed dial(s)" if failed else "")

        options = CHANNEL_OPTIONS if t.literal else (*CHANNEL_OPTIONS, ("grpc.default_authority", t.text))
        error = await run_stream(link.address, hub=self._hub, register=self._register, tls=self._tls_for(t),
                                 options=options, peer=link.what, stop=self._stop_event,
                                 grace_s=lambda: self._grace_s, on_open=opened)
        up, link.connected = link.connected, False
        t.last_error = error
        if up:
            log.info("control plane %s: stream closed: %s", link.what, error)
        elif not self._stopping:
            link.flog.failed(error)
        return None if opened_at is None else loop.time() - opened_at
