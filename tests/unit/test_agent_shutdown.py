"""The agent's stop waits on no cleanup step without end (node_probe.shutdown)."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest

from node_probe import shutdown


async def test_a_step_that_never_ends_is_left_after_its_grace_and_said(monkeypatch, caplog):
    monkeypatch.setattr(shutdown, "STEP_S", 0.2)
    caplog.set_level(logging.WARNING, logger="node_probe.agent")
    never = asyncio.get_running_loop().create_future()
    t0 = time.monotonic()
    await shutdown.bounded(never, "grpc server", 0.1)
    took = time.monotonic() - t0
    assert 0.3 <= took < 1.0, took
    assert never.cancelled()
    assert [r.getMessage() for r in caplog.records] == ["stop: grpc server did not end within 0.3 s; going on"]


async def test_a_step_that_fails_is_logged_and_the_stop_goes_on(caplog):
    caplog.set_level(logging.ERROR, logger="node_probe.agent")

    async def broken() -> None:
        raise OSError("socket already closed")

    await shutdown.bounded(broken(), "metrics endpoint")
    (rec,) = caplog.records
    assert rec.getMessage() == "stop: metrics endpoint failed" and "socket already closed" in caplog.text


async def test_a_step_that_ends_is_awaited_to_its_end():
    done = []

    async def step() -> None:
        await asyncio.sleep(0.05)
        done.append(True)

    await shutdown.bounded(step(), "served streams")
    assert done == [True]


async def test_the_stop_itself_can_still_be_cancelled():
    never = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(shutdown.bounded(never, "background tasks"))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
