"""The outlier wake-up timers: one per cluster, at the earliest end of its outlier ejections, so
the cluster is decided again when an ejection ends (nothing else may change meanwhile).

Shape::

    wakes = OutlierWakes(clock, on_wake=lambda cluster: core.mark_dirty(cluster))
    wakes.arm("llm", 40.001)    # re-armed only when the time changes; None cancels
    len(wakes)                  # timers armed
    wakes.cancel_all()
"""
from __future__ import annotations

from collections.abc import Callable

from xds_server.process.clock import Clock, Timer

__all__ = ["OutlierWakes"]


class OutlierWakes:
    """One timer per cluster (module docstring); ``on_wake(cluster)`` when it fires."""

    def __init__(self, clock: Clock, on_wake: Callable[[str], None]) -> None:
        self._clock, self._on_wake = clock, on_wake
        self._timers: dict[str, tuple[float, Timer]] = {}

    def arm(self, cluster: str, at_s: float | None) -> None:
        """Wake ``cluster`` at ``at_s`` (the clock's monotonic s; None: no ejection pending)."""
        cur = self._timers.get(cluster)
        if cur is not None and cur[0] == at_s:
            return
        if cur is not None:
            cur[1].cancel()
            del self._timers[cluster]
        if at_s is not None:
            self._timers[cluster] = (at_s, self._clock.call_at(at_s, self._fire, cluster))

    def _fire(self, cluster: str) -> None:
        self._timers.pop(cluster, None)
        self._on_wake(cluster)

    def cancel_all(self) -> None:
        for _, t in self._timers.values():
            t.cancel()
        self._timers.clear()

    def __len__(self) -> int:
        return len(self._timers)
