"""Clients that connect and never read, for the bounded-ports tests (test_bounded_ports.py,
tests/relay/test_relay_bounds.py) and benchmarks/bounded_ports.py, plus what they look at on the
server side (RSS, open fds of a process).

- :func:`stuck_http_get`: a TCP connection with a 4 KiB receive buffer that sends one GET and
  never reads (the ``/live`` attack).
- :func:`stuck_h2_watch`: a hand-written HTTP/2 client that opens ``RoutingFeed/Watch`` with a
  stream window of 0 bytes and never opens it, so not one byte of a response can be sent: a
  subscriber whose application stopped reading once its window is used up. :class:`H2Keeper`
  keeps such connections valid meanwhile (ACKs the server's SETTINGS and PINGs, as a live
  client's transport does; no WINDOW_UPDATE ever), so gRPC's keepalive does not end them.
- :func:`slowloris`: a TCP connection that sends the first bytes of a request head and then
  nothing (``drip`` sends one more byte).
"""
from __future__ import annotations

import selectors
import socket
import struct
import threading
from pathlib import Path
from typing import cast

from xds_server.proto import routing_pb2

__all__ = ["H2Keeper", "closed_by_peer", "open_fds", "prometheus_value", "rss_mb", "slowloris", "stuck_h2_watch",
           "stuck_http_get"]

RCVBUF = 4096


def _sock(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)  # before connect: the window offered
    s.connect(("127.0.0.1", port))
    return s


def stuck_http_get(port: int, path: str = "/live") -> socket.socket:
    """Connected, the GET sent, never read."""
    s = _sock(port)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: text/event-stream\r\n\r\n".encode())
    return s


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """HPACK literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def stuck_h2_watch(port: int, subscriber_id: str = "stuck", clusters: tuple[str, ...] = ()) -> socket.socket:
    """Connected, ``RoutingFeed/Watch`` requested with a 0-byte stream window, never read."""
    s = _sock(port)
    settings = _frame(0x4, 0, 0, struct.pack(">HI", 0x4, 0))  # SETTINGS_INITIAL_WINDOW_SIZE = 0
    block = b"".join(_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", "/sentinel.routing.v1.RoutingFeed/Watch"),
        (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"), ("te", "trailers")))
    msg = routing_pb2.WatchRequest(subscriber_id=subscriber_id, clusters=list(clusters)).SerializeToString()
    data = b"\x00" + struct.pack(">I", len(msg)) + msg
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings
              + _frame(0x1, 0x4, 1, block) + _frame(0x0, 0x1, 1, data))
    return s


class H2Keeper(threading.Thread):
    """Reads the :func:`stuck_h2_watch` sockets it is given and answers only the server's
    SETTINGS (ACK) and PINGs (ACK): their streams stay stuck, their connections alive.
    ``closed``: sockets the server closed. Stop with :meth:`stop`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sel = selectors.DefaultSelector()
        self.closed: set[socket.socket] = set()
        self._buf: dict[socket.socket, bytes] = {}
        self._lock = threading.Lock()
        self._halt = threading.Event()

    def add(self, s: socket.socket) -> socket.socket:
        with self._lock:
            self._buf[s] = b""
            self.sel.register(s, selectors.EVENT_READ)
        return s

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def run(self) -> None:
        while not self._halt.is_set():
            with self._lock:
                ready = self.sel.select(0.05) if self._buf else []
                for key, _ in ready:
                    self._read(cast(socket.socket, key.fileobj))

    def _read(self, s: socket.socket) -> None:
        try:
            data = s.recv(65536)
        except OSError:
            data = b""
        if not data:
            self.closed.add(s)
            self.sel.unregister(s)
            self._buf.pop(s, None)
            return
        buf = self._buf[s] + data
        out = b""
        while len(buf) >= 9:
            n = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + n:
                break
            kind, flags, payload = buf[3], buf[4], buf[9:9 + n]
            if kind == 0x4 and not flags & 0x1:
                out += _frame(0x4, 0x1, 0, b"")
            elif kind == 0x6 and not flags & 0x1:
                out += _frame(0x6, 0x1, 0, payload)
            buf = buf[9 + n:]
        self._buf[s] = buf
        if out:
            try:
                s.sendall(out)
            except OSError:
                pass


def slowloris(port: int, head: bytes = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") -> socket.socket:
    """Connected, an unfinished request head sent (no blank line), then nothing."""
    s = _sock(port)
    s.sendall(head)
    return s


def closed_by_peer(s: socket.socket, timeout_s: float = 5.0) -> bool:
    """Whether the server closed ``s`` (EOF or reset after whatever it had sent): reads it out."""
    s.settimeout(timeout_s)
    try:
        while True:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid``, MB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    """Open file descriptors of ``pid``."""
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def prometheus_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` in a text exposition."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and want <= set(head.partition("{")[2].rstrip("}").split(",")):
            total += float(value)
    return total
