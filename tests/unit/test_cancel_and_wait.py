"""Stopping a task from another one: :func:`cancel_and_wait` ends the stopped task and waits for
it, and passes on a cancel aimed at the task that waits (``suppress(CancelledError)`` around the
wait swallowed that one too)."""
from __future__ import annotations

import asyncio

import pytest

from xds_server.process.cancellation import cancel_and_wait


async def test_the_stopped_task_ends_and_its_own_cancel_is_not_passed_on():
    task = asyncio.ensure_future(asyncio.sleep(10))
    await cancel_and_wait(task)
    assert task.cancelled()


async def test_a_task_that_already_ended_is_waited_for_without_error():
    task = asyncio.ensure_future(asyncio.sleep(0, "done"))
    await task
    await cancel_and_wait(task)
    assert task.result() == "done"


async def test_another_exception_of_the_stopped_task_is_raised():
    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise ValueError("cleanup failed") from None

    task = asyncio.ensure_future(fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="cleanup failed"):
        await cancel_and_wait(task)


async def test_a_cancel_of_the_waiting_task_reaches_it_and_the_stopped_task_ends_too():
    stopping = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            stopping.set()
            await asyncio.sleep(10)  # its cleanup takes long: the waiter is cancelled meanwhile

    inner = asyncio.ensure_future(slow_to_stop())
    await asyncio.sleep(0)
    after: list[str] = []

    async def stopper() -> None:
        await cancel_and_wait(inner)
        after.append("ran on after its own cancel")

    outer = asyncio.ensure_future(stopper())
    await stopping.wait()
    outer.cancel()
    done, _ = await asyncio.wait({outer}, timeout=2.0)
    assert done and outer.cancelled()
    assert after == []
    assert inner.cancelled()  # the waiter's cancel reached the task it waited on


async def test_a_cancel_of_the_waiting_task_is_raised_when_the_stopped_task_swallows_it_and_returns():
    started = asyncio.Event()

    async def swallows_every_cancel() -> str:
        started.set()
        for _ in range(2):  # the stop's cancel, then the one forwarded from the waiter
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass
        return "returned"

    inner = asyncio.ensure_future(swallows_every_cancel())
    await started.wait()
    after: list[str] = []

    async def stopper() -> None:
        await cancel_and_wait(inner)
        after.append("ran on after its own cancel")

    outer = asyncio.ensure_future(stopper())
    await asyncio.sleep(0.01)
    outer.cancel()
    done, _ = await asyncio.wait({outer}, timeout=2.0)
    assert done and outer.cancelled()
    assert after == [] and inner.result() == "returned"


async def test_a_task_already_handling_a_cancel_stops_another_one_quietly():
    async def cleanup_in_a_cancelled_task() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            helper = asyncio.ensure_future(asyncio.sleep(10))
            await cancel_and_wait(helper)  # its own cancel: not the one this task is handling
            assert helper.cancelled()
            return "cleaned up"
        return "slept"

    task = asyncio.ensure_future(cleanup_in_a_cancelled_task())
    await asyncio.sleep(0)
    task.cancel()
    assert await asyncio.wait_for(task, 2.0) == "cleaned up"
