"""gRPC's completion wake-ups, taken in one go by the event loop.

grpc.aio (grpcio 1.85) hands its completions (a message read, a write done, a stream ended, a new
stream to serve) to the event loop through a socketpair: its poller thread queues each completion
and writes one byte per completion; the loop's reader reads **one** byte per call and then runs
every completion queued. When the loop turns more slowly than completions arrive (a publish
holding it, a fleet dialling in), the bytes pile up; at Linux's default socket buffer (208 KiB,
~768 bytes of accounting per one-byte write) the pair is full after ~277 of them, the poller thread
blocks in ``write()``, and from then on the loop gets **one completion per turn**: a stream's end
or a new agent's stream waits behind up to ~277 loop turns. Measured here (benchmarks/RESULTS.md,
"gRPC's wake-ups"): with 2,000 agents dialled in the pair held 100-278 bytes most of the time; a
loop busy in 5 ms steps took new streams at ~1 a second once full.

:func:`drain_wakeups` puts a reader of ours in front of gRPC's: it reads every waiting byte but
one, then calls gRPC's own handler, which reads the last and runs every completion queued. The
poller thread never blocks, and a turn runs what has arrived. What it relies on, checked at
install (else it changes nothing and says so): the process's ``PollerCompletionQueue`` (found by
type), its non-blocking read socket, and its handler ``_handle_events(loop)`` registered as the
loop's reader of that socket (grpcio's default on Linux).

Shape::

    await start_server(server)  # server.start(), then drain_wakeups(the running loop)
"""
from __future__ import annotations

import array
import asyncio
import fcntl
import gc
import logging
import os
import socket
import termios
from collections.abc import Callable

import grpc

__all__ = ["drain_wakeups", "read_all_but_one", "start_server"]

log = logging.getLogger("xds_server.process")

_QUEUE_TYPE = "PollerCompletionQueue"
_QUEUE_MODULE = "grpc._cython.cygrpc"


def read_all_but_one(fd: int) -> int:
    """Read every byte waiting on the socket ``fd`` but one; returns how many were read. The
    one left keeps gRPC's own ``recv(1)`` from failing (its socket is non-blocking). An OSError
    reads nothing (0): gRPC's handler still runs and reads its byte."""
    waiting = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, waiting)
        return len(os.read(fd, waiting[0] - 1)) if waiting[0] > 1 else 0
    except OSError:
        return 0


def _queue() -> object | None:
    """The process's grpc.aio completion queue (one per process, made at its first use)."""
    return next((o for o in gc.get_objects()
                 if type(o).__name__ == _QUEUE_TYPE and type(o).__module__ == _QUEUE_MODULE), None)


def _read_socket(queue: object) -> socket.socket | None:
    """The queue's read end of its wake-up pair: the non-blocking one of the two sockets it holds
    (its write end blocks)."""
    pair = [o for o in gc.get_referents(queue) if isinstance(o, socket.socket)]
    ends = [s for s in pair if s.fileno() >= 0 and s.gettimeout() == 0.0]
    return ends[0] if len(pair) == 2 and len(ends) == 1 else None


def drain_wakeups(loop: asyncio.AbstractEventLoop) -> bool:
    """Install the reader of the module docstring on ``loop`` (gRPC's queue must be bound to it:
    a grpc.aio server or channel made in it). Returns True when installed (again on a loop that
    has it: the same reader); False, logged at WARNING once per call, when gRPC's parts are not as
    described (another grpcio, no reader registered) and nothing was changed."""
    queue = _queue()
    sock = _read_socket(queue) if queue is not None else None
    handle: Callable[[asyncio.AbstractEventLoop], None] | None = getattr(queue, "_handle_events", None)
    if sock is None or handle is None or not loop.remove_reader(sock):
        log.warning("gRPC's completion wake-ups are read one per loop turn: its %s is not as expected "
                    "(grpcio changed?); completions may wait behind a slow loop", _QUEUE_TYPE)
        return False
    fd = sock.fileno()

    def drained() -> None:
        read_all_but_one(fd)
        handle(loop)

    loop.add_reader(sock, drained)
    return True


async def start_server(server: grpc.aio.Server) -> None:
    """``server.start()``, then :func:`drain_wakeups` on the running loop (which the server's
    creation bound gRPC's queue to). Raises what ``start()`` raises."""
    await server.start()
    drain_wakeups(asyncio.get_running_loop())
