"""Stall detection from the engine's ``/metrics`` (faster than the next micro-probe).

An engine whose requests are running but whose progress counter (vLLM: generated + prompt
tokens) has not moved for longer than the window is *stalled*: its scheduler or GPU is hung,
although ``/health`` may still answer 200. A busy engine whose counter advances is never
stalled, however slow its first tokens are (field case fc07 vs fc06).

The detector is pure: feed it each reading with its sample time (``observe``); it keeps, per
engine instance (the adapter's group label, e.g. vLLM's ``engine``), the last counter value and
when it last changed. While an instance runs nothing, its window restarts at every sample, so a
request that just arrived at an idle engine is not judged against the idle time before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from node_probe.engines.prometheus import EngineLoadReading

__all__ = ["StallDetector", "StallVerdict"]


@dataclass(frozen=True)
class StallVerdict:
    """Result of one observation.

    Attributes:
        stalled: some instance has running > 0 and a frozen progress counter beyond the window.
        detail: which instance, what runs and waits, which counter, frozen at what value and
            for how long (empty when not stalled).
        capable: the reading had a progress counter (stall detection covers this engine).
    """

    stalled: bool
    detail: str = ""
    capable: bool = False


@dataclass
class _Track:
    progress: float
    changed_at: float


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:g}"


class StallDetector:
    """Per-instance "running but no progress" detector.

    Args:
        window_s: how long the counter may stay frozen while requests run, in seconds.
    """

    def __init__(self, window_s: float = 1.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._tracks: dict[str, _Track] = {}

    def reset(self) -> None:
        """Forget all history (e.g. after the engine restarted)."""
        self._tracks.clear()

    def observe(self, reading: EngineLoadReading | None, now: float) -> StallVerdict:
        """Feed one scrape taken at ``now`` (monotonic seconds); ``None`` = failed scrape (no
        verdict can be given: not stalled, history kept)."""
        if reading is None:
            return StallVerdict(False)
        capable = False
        worst: tuple[float, str] | None = None
        seen = set()
        for key, group in reading.groups.items():
            if group.progress is None:
                continue
            capable = True
            seen.add(key)
            track = self._tracks.get(key)
            if track is None or group.progress != track.progress:
                # First sight, progress, or a counter reset (engine restarted): all count as change.
                self._tracks[key] = track = _Track(group.progress, now)
            running = group.running
            if running is None or running <= 0:
                track.changed_at = now  # idle: nothing is expected to progress
                continue
            frozen_for = now - track.changed_at
            if frozen_for > self.window_s and (worst is None or frozen_for > worst[0]):
                who = f"engine {key}" if key else "engine"
                waiting = "" if group.waiting is None else f", {_fmt(group.waiting)} waiting"
                metric = reading.progress_metric or "progress counter"
                worst = (frozen_for, f"{who}: {_fmt(running)} running{waiting}, {metric} frozen at "
                                     f"{_fmt(group.progress)} for {frozen_for:.1f} s")
        for key in list(self._tracks):
            if key not in seen:
                del self._tracks[key]
        if worst is None:
            return StallVerdict(False, "", capable)
        return StallVerdict(True, worst[1], capable)
