"""Simulated dial-in agents that speak HTTP/2 and gRPC's framing by hand: a load generator cheap
enough to put thousands of nodes beside the control plane on one machine.

Each simulated agent is its own TCP connection to the control plane's ``ProbeHub/Connect`` (what
the control plane sees is what a real agent's stream brings): the HTTP/2 preface and SETTINGS, one
HEADERS frame that opens the Connect stream (``x-sentinel-liveness: transport``, as
``node_probe.dial_stream.METADATA``), then DATA frames, each one length-prefixed gRPC message: the
``Register``, a first ``Heartbeat`` and one good ``InferenceResult``, then a heartbeat every
``refresh_s`` (random phase per agent) and a ``Pong`` for each ``Ping``. Every HTTP/2 PING is
answered with its ACK at once, every SETTINGS acknowledged. The agent advertises windows of 2^31 - 1
(it never has to return flow-control credit) and honours the control plane's (a message that does
not fit waits for its WINDOW_UPDATE). A stream the control plane ends (trailers, RST_STREAM, GOAWAY,
a closed connection) is dialled again with a jittered back-off, as a real agent does.

Why not grpcio here: grpcio agents cost ~0.47 cores per 1,000 on this machine (their C-core
threads answer ~11 PINGs a second per connection at ``dial_in.keepalive`` 90 ms), which with the
control plane's own ~0.5 leaves no room for 2,000 nodes on 2 cores. Here an agent is a protocol
object on one event loop (the caller's; dial_in.py runs it on ``event_loop.run(..., "auto")``, uvloop's
when installed): a PING costs one read and one write of 17
bytes, ~0.28 cores per 1,000 agents measured beside the same control plane (whose CPU was the
same with either kind). ``benchmarks/dial_in.py --agent-kind h2`` uses it.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import struct
from collections import deque
from collections.abc import Callable

from node_probe.dial_stream import METADATA
from node_probe.proto import probe_pb2
from node_probe.targets import STABLE_S, backoff_s, failures_after

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST, _SETTINGS, _PING, _GOAWAY, _WINDOW = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_MAX_WINDOW = 2 ** 31 - 1
_INITIAL_WINDOW = 65_535  # RFC 9113 section 6.9.2
_SETTINGS_INITIAL_WINDOW = 0x4
_STREAM = 1
_CONNECT_SPREAD_S = 1.0
_PING_ACK = b"\x00\x00\x08\x06\x01\x00\x00\x00\x00"  # the header of a PING ACK frame (8 bytes)


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    """An HPACK integer (RFC 7541 section 5.1) with an ``prefix_bits`` prefix, first byte's flags 0."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out, value = bytearray((limit,)), value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """A header as a literal field without indexing, new name, no Huffman (RFC 7541 section 6.2.2)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v


def _grpc(msg: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def open_stream(authority: str, path: str) -> bytes:
    """What the agent writes first: the preface, its SETTINGS (2^31 - 1 stream window), the
    connection's window to 2^31 - 1, and the HEADERS that open stream 1 for ``path``."""
    headers = b"".join(_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
        ("content-type", "application/grpc"), ("te", "trailers"), *METADATA))
    return (_PREFACE + _frame(_SETTINGS, 0, 0, struct.pack(">HI", _SETTINGS_INITIAL_WINDOW, _MAX_WINDOW))
            + _frame(_WINDOW, 0, 0, struct.pack(">I", _MAX_WINDOW - _INITIAL_WINDOW))
            + _frame(_HEADERS, _END_HEADERS, _STREAM, headers))


class H2Agent(asyncio.Protocol):
    """One node's simulated agent on one connection (see the module docstring). ``on_open``
    is called when a connection's stream is open (counts dials); ``on_end`` when it ended."""

    def __init__(self, first: list[bytes], beat: Callable[[int], bytes], refresh_s: float, authority: str,
                 on_end: Callable[[], None]) -> None:
        self._first = first
        self._beat = beat
        self._refresh_s = refresh_s
        self._authority = authority
        self._on_end = on_end
        self._buf = bytearray()
        self._data = bytearray()  # stream 1's DATA payload not yet parsed into gRPC messages
        self._tr: asyncio.Transport | None = None
        self._send_conn = _INITIAL_WINDOW
        self._send_stream = _INITIAL_WINDOW
        self._initial_stream = _INITIAL_WINDOW
        self._pending: deque[bytes] = deque()  # gRPC-framed messages waiting for window
        self._seq = 1
        self._timer: asyncio.TimerHandle | None = None
        self.ended = False

    # -- connection ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._tr = transport  # type: ignore[assignment]  # uvloop's TCPTransport is no asyncio.Transport subclass
        transport.write(open_stream(self._authority, "/node_probe.v1.ProbeHub/Connect"))
        for m in self._first:
            self._send(m)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(random.random() * self._refresh_s, self._tick)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()

    def cut(self) -> None:
        """Reset the connection (the control plane reads its stream's transport lost)."""
        if self._tr is not None:
            self._tr.abort()

    def _end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self._timer is not None:
            self._timer.cancel()
        if self._tr is not None:
            self._tr.close()
        self._on_end()

    def _tick(self) -> None:
        self._seq += 1
        self._send(self._beat(self._seq))
        self._timer = asyncio.get_running_loop().call_later(self._refresh_s, self._tick)

    # -- writing ---------------------------------------------------------------------------------
    def _send(self, msg: bytes) -> None:
        self._pending.append(_grpc(msg))
        self._flush()

    def _flush(self) -> None:
        tr = self._tr
        while self._pending and tr is not None:
            body = self._pending[0]
            if len(body) > min(self._send_conn, self._send_stream):
                return  # waits for the control plane's WINDOW_UPDATE
            self._pending.popleft()
            self._send_conn -= len(body)
            self._send_stream -= len(body)
            tr.write(_frame(_DATA, 0, _STREAM, body))

    # -- reading ---------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if len(data) == 17 and data[3] == _PING and not data[4] and not self._buf:
            self._tr.write(_PING_ACK + data[9:])  # type: ignore[union-attr]  # most reads: one PING alone
            return
        buf = self._buf
        buf += data
        at = 0
        tr = self._tr
        while len(buf) - at >= 9:
            length = int.from_bytes(buf[at:at + 3], "big")
            if len(buf) - at < 9 + length:
                break
            kind, flags = buf[at + 3], buf[at + 4]
            stream = int.from_bytes(buf[at + 5:at + 9], "big") & 0x7FFFFFFF
            payload = bytes(buf[at + 9:at + 9 + length])
            at += 9 + length
            if kind == _PING:
                if not flags & _ACK and tr is not None:
                    tr.write(_frame(_PING, _ACK, 0, payload))
            elif kind == _DATA:
                if stream == _STREAM:
                    self._data += payload
                    self._messages()
                if flags & _END_STREAM:
                    self._end()
            elif kind == _WINDOW:
                inc = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
                if stream == 0:
                    self._send_conn += inc
                else:
                    self._send_stream += inc
                self._flush()
            elif kind == _SETTINGS:
                if not flags & _ACK and tr is not None:
                    for k in range(0, len(payload) - 5, 6):
                        ident, value = struct.unpack_from(">HI", payload, k)
                        if ident == _SETTINGS_INITIAL_WINDOW:
                            self._send_stream += value - self._initial_stream
                            self._initial_stream = value
                    tr.write(_frame(_SETTINGS, _ACK, 0, b""))
                    self._flush()
            elif kind == _HEADERS:
                if flags & _END_STREAM:  # trailers: the control plane ended the stream
                    self._end()
            elif kind in (_RST, _GOAWAY):
                self._end()
        del buf[:at]

    def _messages(self) -> None:
        d = self._data
        at = 0
        while len(d) - at >= 5:
            n = int.from_bytes(d[at + 1:at + 5], "big")
            if len(d) - at < 5 + n:
                break
            raw = bytes(d[at + 5:at + 5 + n])
            at += 5 + n
            m = probe_pb2.ControlMessage.FromString(raw)
            if m.WhichOneof("msg") == "ping":
                self._send(probe_pb2.AgentMessage(pong=probe_pb2.Pong(seq=m.ping.seq, processing_us=5))
                           .SerializeToString())
        del d[:at]


async def run_agents(port: int, nodes: list[tuple[str, str]], first: Callable[[str, str], list[bytes]],
                     beat: Callable[[str, int], bytes], refresh_s: float, dialled: Callable[[], None],
                     alive: Callable[[], bool], stable_s: float = STABLE_S,
                     spread_s: float = _CONNECT_SPREAD_S) -> None:
    """Run one simulated agent per ``(node_id, address)`` against 127.0.0.1:``port`` until
    ``alive()`` is False (checked every 0.5 s). ``first(node_id, address)``: the messages a stream
    starts with; ``beat(node_id, seq)``: a heartbeat; ``dialled()`` is called per connection made. A closed
    connection is dialled again as node_probe's dialer does (``stable_s``:
    :func:`~node_probe.targets.failures_after`); each agent first dials at a random moment within
    ``spread_s`` seconds. SIGUSR1 resets every connection at once (each agent dials again as
    after any lost stream), where the loop is the main thread's."""
    loop = asyncio.get_running_loop()
    authority = f"127.0.0.1:{port}"
    live: set[H2Agent] = set()

    def cut_all() -> None:
        for a in list(live):
            a.cut()

    with contextlib.suppress(ValueError, RuntimeError):  # (a loop of another thread takes no signals)
        loop.add_signal_handler(signal.SIGUSR1, cut_all)

    async def agent(nid: str, addr: str) -> None:
        await asyncio.sleep(random.random() * spread_s)
        fails = 0
        while True:
            ended = loop.create_future()

            def on_end(f: asyncio.Future[None] = ended) -> None:
                if not f.done():
                    f.set_result(None)

            try:
                _, proto = await loop.create_connection(
                    lambda: H2Agent(first(nid, addr), lambda seq: beat(nid, seq), refresh_s, authority, on_end),
                    "127.0.0.1", port)
                dialled()
                opened = loop.time()
                live.add(proto)
                await ended  # the agent closed its transport
                live.discard(proto)
                fails = failures_after(fails, loop.time() - opened, stable_s)
            except OSError:
                fails = failures_after(fails, None, stable_s)
            await asyncio.sleep(backoff_s(fails))  # as node_probe's dialer

    tasks = [asyncio.create_task(agent(nid, addr)) for nid, addr in nodes]
    try:
        while alive():
            await asyncio.sleep(0.5)
    finally:
        with contextlib.suppress(ValueError, RuntimeError):
            loop.remove_signal_handler(signal.SIGUSR1)
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
