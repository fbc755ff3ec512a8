"""Stopping a task from another one: :func:`cancel_and_wait` ends the stopped task and waits for
it, and passes on a cancel aimed at the task that waits (``suppress(CancelledError)`` around the
wait swallowed that one too)."""
from __future__ import annotations

import asyncio

import pytest

from xds_server.config import parse_config
from xds_server.probing.session import ProbeSession
from xds_server.probing.silence import LoopStallWatch
from xds_server.process.cancellation import cancel_and_wait
from xds_server.testing import free_port


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


async def test_a_probe_session_stopped_by_a_task_that_is_cancelled_meanwhile_still_ends_its_stall_watch():
    # the session's stop cleans up after the wait in a finally: its caller's cancel skips nothing
    cfg = parse_config({"clusters": [{"name": "llm", "nodes": [
        {"id": "n0", "address": "127.0.0.1:8001", "probe_address": f"127.0.0.1:{free_port()}"}]}]})
    s = ProbeSession(cfg.clusters[0].nodes[0], cfg.health, lambda *_: None, probe=cfg.probe)
    s.start()
    await asyncio.sleep(0.05)  # dialling its dead agent
    watch = LoopStallWatch.acquire(asyncio.get_running_loop(), cfg.probe.stalls.loop_watch_interval.s)
    watch.release()  # (only to read the loop's watch: the session holds it)
    stopper = asyncio.ensure_future(s.stop())
    await asyncio.sleep(0)  # the stop is waiting for the session's task
    stopper.cancel()
    done, _ = await asyncio.wait({stopper}, timeout=2.0)
    assert done and stopper.cancelled() and not s.alive
    sampled = watch.history.alive_s
    await asyncio.sleep(cfg.probe.stalls.loop_watch_interval.s * 3)
    assert watch.history.alive_s == sampled  # nobody holds the watch: it samples no more
