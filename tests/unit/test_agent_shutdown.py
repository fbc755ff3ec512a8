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


async def test_an_agent_whose_grpc_server_never_stops_still_stops_and_says_which_step(monkeypatch, caplog):
    from node_probe.agent import AgentConfig, ProbeAgent
    from xds_server.testing import free_port

    monkeypatch.setattr(shutdown, "STEP_S", 0.3)
    caplog.set_level(logging.WARNING, logger="node_probe.agent")
    agent = ProbeAgent(AgentConfig(engine_url=f"http://127.0.0.1:{free_port()}", listen="127.0.0.1:0",
                                   node_id="node-a", probe_interval_s=30.0))
    await agent.start()
    server = agent._server
    assert server is not None
    real_stop = server.stop

    async def never_stops(grace: float | None) -> None:
        await asyncio.get_running_loop().create_future()

    monkeypatch.setattr(server, "stop", never_stops)
    t0 = time.monotonic()
    await agent.stop(grace_s=0.1)
    took = time.monotonic() - t0
    await real_stop(None)
    assert took < 2.0, took  # grace 0.1 + STEP_S 0.3, plus the other steps
    assert "stop: grpc server did not end within 0.4 s; going on" in caplog.text
