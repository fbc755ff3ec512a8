"""A stop's cancel that an awaited task swallowed is raised again by :func:`raise_if_cancelled`
(grpc.aio's call-starting task does this: :mod:`xds_server.process.cancellation`)."""
from __future__ import annotations

import asyncio

import pytest

from xds_server.process.cancellation import raise_if_cancelled


async def _swallows_a_cancel(swallowed: list[bool]) -> str:
    """Swallow the first cancel of all (as grpc.aio's call start does), end at once afterwards."""
    if swallowed:
        return "ended"
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        swallowed.append(True)
        return "the call's own end"
    return "slept"


async def test_a_cancel_swallowed_below_is_raised_again_and_a_loop_that_checks_ends():
    turns: list[str] = []
    swallowed: list[bool] = []

    async def redial_loop() -> None:
        for _ in range(1000):  # bounded: without the check it runs on, and the test fails, not hangs
            turns.append(await asyncio.ensure_future(_swallows_a_cancel(swallowed)))  # as a failed call ends
            raise_if_cancelled()
            await asyncio.sleep(0.001)

    task = asyncio.ensure_future(redial_loop())
    await asyncio.sleep(0.01)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2.0)
    assert done and task.cancelled(), turns
    assert turns == ["the call's own end"]


async def test_nothing_is_raised_without_a_cancel_or_after_one_taken_back():
    async def check() -> str:
        raise_if_cancelled()
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        task.uncancel()  # as asyncio.timeout() takes back its own cancel
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            pass  # the cancel still arrives once; taken back, it is not pending any more
        raise_if_cancelled()
        return "ran on"

    assert await asyncio.ensure_future(check()) == "ran on"


async def test_in_a_loop_callback_outside_any_task_nothing_happens():
    loop = asyncio.get_running_loop()
    ran = loop.create_future()
    loop.call_soon(lambda: (raise_if_cancelled(), ran.set_result(True)))
    assert await ran


async def test_a_pending_cancel_is_raised_before_it_is_delivered():
    ran_on: list[bool] = []

    async def check() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        raise_if_cancelled()  # before the cancel has been delivered at an await
        ran_on.append(True)

    with pytest.raises(asyncio.CancelledError):
        await asyncio.ensure_future(check())
    assert not ran_on
