"""The agent's GPU telemetry loop (:class:`GpuPoller`): a blocking collector (NVML, see
:mod:`node_probe.telemetry`) called every period in its own worker thread, so a hung driver
call never blocks the event loop; a collect stuck for ``max(5 s, 5 periods)`` is reported as
``NVML_STATE_ERROR`` while the last reading is kept."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from node_probe.proto import probe_pb2
from node_probe.ticks import sleep_until_tick

__all__ = ["GpuPoller"]

log = logging.getLogger(__name__)


class GpuPoller:
    """Polls ``collector.collect() -> probe_pb2.GpuTelemetry`` every ``period_s`` seconds.

    Args:
        collector: blocking ``collect()``, optionally ``close()`` (called in the worker thread
            at :meth:`close`, after any stuck collect).
        period_s: seconds between collections (fixed rate, > 0).
        on_reading: called on the event loop with each new telemetry (also a stuck report).
    """

    def __init__(self, collector: Any, period_s: float,
                 on_reading: Callable[[probe_pb2.GpuTelemetry], None]) -> None:
        self._collector = collector
        self._period_s = period_s
        self._on_reading = on_reading
        self._last = probe_pb2.GpuTelemetry()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="np-nvml")

    def _publish(self, tel: probe_pb2.GpuTelemetry) -> None:
        self._last = tel
        self._on_reading(tel)

    async def run(self) -> None:
        """Collect forever (until cancelled); never raises for collector failures."""
        loop = asyncio.get_running_loop()
        period = self._period_s
        stuck_after = max(5.0, 5 * period)
        next_t = loop.time()
        while True:
            started = loop.time()
            fut = loop.run_in_executor(self._executor, self._collector.collect)
            while True:
                done, _ = await asyncio.wait({fut}, timeout=stuck_after)
                if done:
                    break
                stuck = probe_pb2.GpuTelemetry()
                stuck.CopyFrom(self._last)
                stuck.state = probe_pb2.NVML_STATE_ERROR
                stuck.error = f"NVML collect stuck for {loop.time() - started:.0f} s"
                self._publish(stuck)
                log.warning("GPU telemetry: %s", stuck.error)
            try:
                tel = fut.result()
            except Exception as exc:
                log.exception("GPU collect failed unexpectedly")
                tel = probe_pb2.GpuTelemetry(
                    state=probe_pb2.NVML_STATE_ERROR, error=f"collector: {type(exc).__name__}: {exc}"
                )
            self._publish(tel)
            next_t = await sleep_until_tick(loop, next_t + period, period)

    def close(self) -> None:
        """Close the collector in its thread (after a stuck collect, never blocking the caller)
        and let the thread end."""
        close = getattr(self._collector, "close", None)
        if close is not None:
            self._executor.submit(close)
        self._executor.shutdown(wait=False, cancel_futures=False)
