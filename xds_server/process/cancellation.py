"""A stop's cancel that a gRPC call swallowed, raised again in the loop that dials.

``Task.cancel()`` on a task that awaits a grpc.aio stream-stream call, read before it is written
to, does not always reach the task as :class:`asyncio.CancelledError`. grpc.aio (1.85) starts
such a call in a task of its own, and the first read awaits that task. When the cancel lands
there and the call has already failed (a dial to a port where nothing listens), grpc.aio's
starting task catches the CancelledError, the call cannot be cancelled any more, and the read
raises the call's own error (``UNAVAILABLE``) instead. A loop that dials again after a failed
call then runs on, and whoever awaits it after ``cancel()`` waits for ever: a control plane's
stop hung this way in CI, its sessions dialling dead agents all along. Measured with grpcio
1.85.4: a task dialling a dead port again and again, cancelled at a random moment within 50 ms,
went on after 9 of 300 cancels. A unary-unary call, a unary-stream call and a stream-stream call
written to first swallowed none in 300 each.

The task still counts the request (``Task.cancelling()``, Python 3.11). A loop that retries
gRPC calls calls :func:`raise_if_cancelled` once per turn, after the call's end and before
it logs, judges or waits to dial again.

Stopping a task from another one has the opposite trap: ``task.cancel()`` then ``await task``
under ``suppress(CancelledError)`` also swallows a cancel aimed at the task that waits, which then
runs on as if nobody had asked it to stop. :func:`cancel_and_wait` passes that one on.
"""
from __future__ import annotations

import asyncio
from typing import TypeVar

__all__ = ["cancel_and_wait", "raise_if_cancelled"]

_T = TypeVar("_T")


def raise_if_cancelled() -> None:
    """Raise :class:`asyncio.CancelledError` when the running task was asked to stop
    (``Task.cancel()``) and the request did not arrive as that exception; nothing otherwise,
    and nothing in a loop callback outside any task. Raises RuntimeError with no running loop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(task: asyncio.Future[_T]) -> None:
    """Cancel ``task`` and wait until it has ended. Its own :class:`asyncio.CancelledError` ends the
    wait quietly; a cancel of the waiting task that arrives meanwhile is raised (``task`` is
    cancelled with it), also when ``task`` swallowed that one and returned; any other exception
    ``task`` ended with is raised. A cancel the waiting task was already handling when it called
    this is its own business, not raised again here."""
    waiting = asyncio.current_task()
    before = waiting.cancelling() if waiting is not None else 0
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if waiting is not None and waiting.cancelling() > before:
            raise
        return
    if waiting is not None and waiting.cancelling() > before:
        raise asyncio.CancelledError  # task swallowed the cancel forwarded to it, and returned
