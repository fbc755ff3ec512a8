"""The loop's stall watch on a real event loop: a loop busy with its own work (a collection, a
publish) is late, but its thread ran; a thread that did not run at all (a SIGSTOP, a starved CPU:
here a blocking sleep in the loop thread, which takes it off the CPU the same way) is
unscheduled. A dial-in drop is judged ours only on the second (:mod:`xds_server.probing.dial_in`).

A spinning thread may itself be starved by other processes (three test workers on two cores): the
busy case asserts against the off-CPU time measured around its own spin."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from xds_server.config import HealthConfig, ProbeConfig
from xds_server.health.records import StreamClosed
from xds_server.probing.silence import SilenceGate

_PERIOD_S = 0.05  # probe.stalls.loop_watch_interval's default
_BLOCK_S = 0.25
_SLACK_S = _PERIOD_S  # the sampler's period around the block (and the thread kept off the CPU outside it)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _off_cpu_s(block: Callable[[float], None]) -> float:
    """Run ``block(_BLOCK_S)`` in this thread; the wall time it took that the thread did not run (s)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    block(_BLOCK_S)
    return (time.perf_counter() - wall) - (time.thread_time() - cpu)


@pytest.fixture
async def gate() -> AsyncIterator[SilenceGate]:
    g = SilenceGate(HealthConfig(), ProbeConfig())
    g.start(asyncio.get_running_loop())
    await asyncio.sleep(_PERIOD_S * 1.5)  # the sampler is running
    try:
        yield g
    finally:
        g.stop()


async def test_a_loop_busy_with_its_own_work_stalled_but_its_thread_ran(gate: SilenceGate):
    loop = asyncio.get_running_loop()
    before = loop.time()
    off = _off_cpu_s(_spin)
    await asyncio.sleep(_PERIOD_S * 2)  # the sampler runs (late), then once more on time
    after = loop.time()
    assert gate.stalled_since(before, after, 0.08)
    assert not gate.unscheduled_since(before, after, off + _SLACK_S), f"spun {_BLOCK_S} s, {off:.3f} s of it off-CPU"


async def test_a_thread_that_did_not_run_is_unscheduled_for_as_long(gate: SilenceGate):
    loop = asyncio.get_running_loop()
    before = loop.time()
    _off_cpu_s(time.sleep)
    await asyncio.sleep(_PERIOD_S * 2)
    after = loop.time()
    assert gate.stalled_since(before, after, 0.08)
    assert gate.unscheduled_since(before, after, _BLOCK_S - _PERIOD_S - _SLACK_S)
    await asyncio.sleep(_PERIOD_S * 2)
    assert not gate.unscheduled_since(after + _PERIOD_S, loop.time(), 0.08)  # nothing since


async def test_the_stall_we_are_waking_from_counts_before_the_sampler_runs(gate: SilenceGate):
    """A drop read in the first callback after a stop: the sampler, overdue, has not run yet."""
    loop = asyncio.get_running_loop()
    before = loop.time()
    _off_cpu_s(time.sleep)
    assert gate.unscheduled_since(before, loop.time(), _BLOCK_S - _PERIOD_S - _SLACK_S)


async def test_the_busy_loop_we_are_waking_from_is_not_unscheduled(gate: SilenceGate):
    loop = asyncio.get_running_loop()
    before = loop.time()
    off = _off_cpu_s(_spin)
    assert gate.stalled_since(before, loop.time(), 0.08)
    assert not gate.unscheduled_since(before, loop.time(), off + _SLACK_S), f"{off:.3f} s off-CPU"


async def test_a_lost_transport_is_the_whole_threshold_unless_a_hold_keeps_it_as_a_plain_close(gate: SilenceGate):
    loop = asyncio.get_running_loop()
    now = loop.time()
    assert gate.closed(now, "eof", None) == StreamClosed("eof")
    assert gate.closed(now, "ping timeout", None, lost=True) == StreamClosed("ping timeout", liveness_lost=True)
    gate.ours(now)  # a burst judged ours: every node not heard since is held
    held = gate.closed(now, "ping timeout", None, lost=True)
    assert isinstance(held, float) and held > now, held
    await asyncio.sleep(held - loop.time() + 0.01)
    # Kept through the hold and said at its end as a plain close: no longer the whole threshold.
    assert gate.due(loop.time(), None) == StreamClosed("ping timeout")
    assert gate.closed(loop.time(), "x", None, lost=True) == StreamClosed("x", liveness_lost=True)
