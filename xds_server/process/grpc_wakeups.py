"""gRPC's completion wake-ups, taken in one go by the event loop.

grpc.aio (grpcio 1.85) hands its completions (a message read, a write done, a stream ended, a new
stream to serve) to the event loop through a socketpair: its poller thread queues each completion
and writes one byte per completion; the loop's reader reads **one** byte per call and then runs
every completion queued. When the loop turns more slowly than completions arrive (a publish
holding it, a fleet dialling in), the bytes pile up; at Linux's default socket buffer (208 KiB,
~768 bytes of accounting per one-byte write) the pair is full after ~277 of them, the poller thread
blocks in ``write()``, and from then on the loop gets **one completion per turn**: a stream's end
or a new agent's stream waits behind up to ~277 loop turns. Measured here (benchmarks/RESULTS.md,
"gRPC's wake-ups"): ``ss`` on the control plane with 2,000 agents dialled in saw 100-278 bytes
waiting most of the time; a loop busy in 5 ms steps took 500 agents' new streams at ~1 a second
once the pair was full.

:func:`drain_wakeups` puts a reader of ours in front of gRPC's: it reads every waiting byte but
one, then calls gRPC's own handler, which reads the last and runs every completion queued. The
poller thread then blocks at most until the next loop turn (only a hold of the loop through more
than ~277 completions still fills the pair), and a turn runs what has arrived. What it relies on,
checked at install (else it changes nothing and says which part was missing): a
``PollerCompletionQueue`` of the process (found by type; one whose sockets are closed, left from
an earlier queue, is passed over), its non-blocking read socket, its map of the
loops it is bound to, and its handler
``_handle_events(loop)``, which it registers as each bound loop's reader of that socket (grpcio's
default on Linux).

Shape::

    await start_server(server)  # server.start(), then drain_wakeups(the running loop): True
"""
from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import gc
import logging
import os
import socket
import termios
from collections.abc import Callable

import grpc

__all__ = ["drain_wakeups", "read_all_but_one", "start_server", "waiting_bytes", "wakeup_socket"]

log = logging.getLogger("xds_server.process")

_QUEUE_TYPE = "PollerCompletionQueue"
_QUEUE_MODULE = "grpc._cython.cygrpc"


def waiting_bytes(fd: int) -> int:
    """Bytes waiting to be read on the socket ``fd`` (FIONREAD). Raises OSError for an fd that
    cannot say (closed, not a socket or pipe)."""
    waiting = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, waiting)
    return waiting[0]


def read_all_but_one(fd: int) -> int:
    """Read every byte waiting on the socket ``fd`` but one; returns how many were read. The
    one left is for gRPC's own ``recv(1)`` (its socket is non-blocking). An OSError reads
    nothing (0): gRPC's handler still runs and reads its byte."""
    try:
        waiting = waiting_bytes(fd)
        return len(os.read(fd, waiting - 1)) if waiting > 1 else 0
    except OSError:
        return 0


def _queues() -> list[object]:
    """The process's grpc.aio completion queues: the one in use (made at grpc.aio's first use
    after the last was shut down) and any earlier one not yet collected."""
    return [o for o in gc.get_objects() if type(o).__name__ == _QUEUE_TYPE and type(o).__module__ == _QUEUE_MODULE]


def _read_socket(queue: object) -> socket.socket | None:
    """The queue's read end of its wake-up pair: the non-blocking one of the two sockets it holds
    (its write end blocks)."""
    pair = [o for o in gc.get_referents(queue) if isinstance(o, socket.socket)]
    ends = [s for s in pair if s.fileno() >= 0 and s.gettimeout() == 0.0]
    return ends[0] if len(pair) == 2 and len(ends) == 1 else None


def _bound(queue: object, loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``queue`` serves ``loop``: its map of the loops it is bound to (each with gRPC's
    reader of the queue's socket) holds it."""
    return any(isinstance(o, dict) and any(k is loop for k in o) for o in gc.get_referents(queue))


_Handler = Callable[[asyncio.AbstractEventLoop], None]


def _bound_queue(loop: asyncio.AbstractEventLoop) -> tuple[socket.socket, _Handler] | str:
    """The read socket and the handler of gRPC's queue bound to ``loop``, or what is missing."""
    queues = _queues()
    missing = f"no {_QUEUE_TYPE}" if not queues else f"gRPC is not bound to this loop ({len(queues)} queue(s))"
    for queue in queues:
        sock = _read_socket(queue)
        handle: _Handler | None = getattr(queue, "_handle_events", None)
        if sock is None or handle is None:
            missing = f"its {_QUEUE_TYPE} has no open non-blocking read socket or no _handle_events"
        elif _bound(queue, loop):
            return sock, handle
    return missing


def wakeup_socket(loop: asyncio.AbstractEventLoop) -> socket.socket | None:
    """The read end of the wake-up pair of gRPC's queue bound to ``loop`` (None: none found), for
    watching its backlog with :func:`waiting_bytes`."""
    found = _bound_queue(loop)
    return None if isinstance(found, str) else found[0]


def drain_wakeups(loop: asyncio.AbstractEventLoop) -> bool:
    """Install the reader of the module docstring on ``loop`` (gRPC's queue must be bound to it:
    a grpc.aio server or channel made in it). Returns True when installed (again on a loop that
    has it: the same reader); False, logged at WARNING with the part missing, when gRPC's parts
    are not as described (another grpcio, a loop gRPC has no reader on) and nothing was changed."""
    found = _bound_queue(loop)
    if isinstance(found, str):
        log.warning("gRPC's completion wake-ups stay one per loop turn: %s (grpcio changed?); completions "
                    "may wait behind a slow loop", found)
        return False
    sock, handle = found
    loop.remove_reader(sock)  # gRPC's reader (uvloop's remove_reader says None whether there was one or not)
    loop.add_reader(sock, _drained, sock.fileno(), handle, loop)
    return True


def _drained(fd: int, handle: _Handler, loop: asyncio.AbstractEventLoop) -> None:
    """The installed reader: the socket read down to one byte, then gRPC's handler. Another loop
    of the process bound to the same queue (an agent's loop in a test thread) reads the same socket
    and may take the last byte first: gRPC's ``recv(1)`` then finds none, and that loop's handler
    has run (or will run) the queue, so nothing is lost."""
    read_all_but_one(fd)
    with contextlib.suppress(BlockingIOError):
        handle(loop)


async def start_server(server: grpc.aio.Server) -> bool:
    """``server.start()``, then :func:`drain_wakeups` on the running loop (which the server's
    creation bound gRPC's queue to); returns whether the drain is installed. Raises what
    ``start()`` raises."""
    await server.start()
    return drain_wakeups(asyncio.get_running_loop())
