"""Stall detection and progress evidence from the engine's ``/metrics`` (faster than the next
micro-probe).

An engine whose requests are running but whose *every* progress signal has not moved for longer
than the window is *stalled*: its scheduler or GPU is hung, although ``/health`` may still answer
200. The progress signals of one engine instance (the adapter's group label, e.g. vLLM's
``engine``) are its step counter (vLLM generated + prompt tokens, TGI batch forwards,
TensorRT-LLM iterations) and its KV-cache usage: vLLM v1 counts prompt tokens only when a
prefill *completes*, so during a long chunked prefill both token counters stay frozen for
seconds while KV usage grows every step (measured on vLLM 0.32: 5.5 s, 0.008 -> 0.086). A busy
engine with any advancing signal is never stalled, however slow its first tokens are (field
case fc07 vs fc06).

Besides the verdict, each observation gives the *evidence of progress*: how long ago a signal of
a busy instance last moved, and which one (``StallVerdict.progress_age_s`` and
``progress_detail``). The control plane calls a slow or timed-out probe "busy" only on that
evidence.

The detector is pure: feed it each reading with its sample time (``observe``). While an
instance runs nothing, its window restarts at every sample, so a request that just arrived at an
idle engine is not judged against the idle time before it. Stall detection needs a step counter
(``capable``); KV usage alone only adds evidence (SGLang updates it once per log interval, too
rarely to prove a freeze).
"""

from __future__ import annotations

from dataclasses import dataclass

from node_probe.engines.prometheus import EngineLoadReading

__all__ = ["StallDetector", "StallVerdict"]


@dataclass(frozen=True)
class StallVerdict:
    """Result of one observation.

    Attributes:
        stalled: some instance has running > 0 and every progress signal frozen beyond the window.
        detail: which instance, what runs and waits, which signals, frozen at what value and
            for how long (empty when not stalled).
        capable: the reading had a progress counter (stall detection covers this engine).
        progress_age_s: seconds since a progress signal of an instance with requests running
            last moved (the freshest such instance); ``None`` when nothing runs or no signal
            moved since the detector first saw the instance.
        progress_detail: what moved, e.g. ``"engine 0: vllm:kv_cache_usage_perc 0.08 -> 0.086
            0.1 s ago, 1 running, 1 waiting"`` (empty when ``progress_age_s`` is None).
    """

    stalled: bool
    detail: str = ""
    capable: bool = False
    progress_age_s: float | None = None
    progress_detail: str = ""


@dataclass
class _Signal:
    value: float
    changed_at: float
    moved: str = ""   # "old -> new" of the last change, "" before the first one


@dataclass
class _Track:
    signals: dict[str, _Signal]
    window_at: float  # start of the current frozen window (restarts while idle)


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:.4g}"


class StallDetector:
    """Per-instance "running but no progress" detector.

    Args:
        window_s: how long every progress signal may stay frozen while requests run, in seconds.

    Raises:
        ValueError: ``window_s`` <= 0.
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
        fresh: tuple[float, str] | None = None
        seen = set()
        counter_name = reading.progress_metric or "progress counter"
        kv_name = reading.kv_cache_metric or "KV-cache usage"
        for key, group in reading.groups.items():
            values = {}
            if group.progress is not None:
                values[counter_name] = group.progress
            if group.kv is not None:
                values[kv_name] = group.kv
            if not values:
                continue
            capable = capable or group.progress is not None
            seen.add(key)
            track = self._tracks.get(key)
            if track is None:
                track = self._tracks[key] = _Track({}, now)
            for name, value in values.items():
                sig = track.signals.get(name)
                if sig is None:
                    track.signals[name] = _Signal(value, now)
                elif value != sig.value:
                    # Progress, or a counter reset (engine restarted): both count as change.
                    track.signals[name] = _Signal(value, now, f"{_fmt(sig.value)} -> {_fmt(value)}")
            for name in [n for n in track.signals if n not in values]:
                del track.signals[name]
            last_change = max(s.changed_at for s in track.signals.values())
            running = group.running
            if running is None or running <= 0:
                track.window_at = now  # idle: nothing is expected to progress
                continue
            who = f"engine {key}" if key else "engine"
            waiting = "" if group.waiting is None else f", {_fmt(group.waiting)} waiting"
            moved = [(s.changed_at, n, s.moved) for n, s in track.signals.items() if s.moved]
            if moved:
                at, name, what = max(moved)
                age = now - at
                if fresh is None or age < fresh[0]:
                    fresh = (age, f"{who}: {name} {what} {age:.1f} s ago, {_fmt(running)} running{waiting}")
            if group.progress is None:
                continue  # KV alone never declares a stall
            frozen_for = now - max(last_change, track.window_at)
            if frozen_for > self.window_s and (worst is None or frozen_for > worst[0]):
                also = "".join(f"; {n} frozen at {_fmt(s.value)} too" for n, s in track.signals.items()
                               if n != counter_name)
                worst = (frozen_for, f"{who}: {_fmt(running)} running{waiting}, {counter_name} frozen at "
                                     f"{_fmt(group.progress)} for {frozen_for:.1f} s{also}")
        for key in list(self._tracks):
            if key not in seen:
                del self._tracks[key]
        progress_age, pdetail = (None, "") if fresh is None else fresh
        if worst is None:
            return StallVerdict(False, "", capable, progress_age, pdetail)
        return StallVerdict(True, worst[1], capable, progress_age, pdetail)
