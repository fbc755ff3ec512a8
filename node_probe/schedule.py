"""The agent's probe schedule, as a pure object: which micro-probe to start when, from the
engine's load, requested probes and the time passed in (no clock, no I/O, no sleeping).

Rules (the agent's loop asks :meth:`ProbeScheduler.decide` and sleeps for the answer's
``wait_s``, waking early when a probe is requested or the load class changes):

* the first probe starts at once; each next one ``interval x jitter`` seconds after the
  previous one *ended*, where the interval is ``busy_interval_s`` while the engine is busy and
  stall detection can watch it (:func:`load_is_busy`), else ``idle_interval_s``; after a probe
  that timed out or answered slowly (the agent's ``probe_recheck_ms``) the next one comes at
  ``idle_interval_s`` even while busy (an HTTP status such as 429 is an answer: the busy
  cadence holds), so a node that was only busy is seen back within ~0.5 s of its load easing
  (soft states recover in seconds, not at the 3-5 s busy cadence); the jitter
  factor is drawn uniform in ``[1 - jitter_ratio, 1 + jitter_ratio]`` once per probe, so a load
  change re-plans the wait with the same factor;
* a requested probe (``ProbeNow`` or stall detection, :meth:`request`) starts at once, but
  requested probes start at least ``min_request_gap_s`` apart; requests inside that window
  are coalesced into one probe at its end. A ``ProbeNow`` request names the probe even when
  a stall request is already pending;
* a scheduled probe is a deep check when ``deep_interval_s`` has passed since the last one
  (the first scheduled probe is one); ``deep_interval_s`` ``None`` or 0: never.

Times are seconds on the caller's monotonic clock.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from node_probe.engines import EngineLoadReading

__all__ = ["Decision", "ProbeScheduler", "ScheduleSettings", "Trigger", "load_is_busy"]


class Trigger(enum.StrEnum):
    """Why a probe ran (``InferenceResult.trigger`` on the wire)."""

    SCHEDULED = "scheduled"
    PROBE_NOW = "probe_now"
    STALL = "stall"
    DEEP = "deep"


def load_is_busy(reading: EngineLoadReading | None, stalled: bool) -> bool:
    """True when the engine runs or queues requests *and* stall detection can watch it (a
    progress counter, not stalled now); False when idle, its load unknown (no reading) or its
    progress unobservable, or when stalled (probe it often)."""
    if reading is None or stalled or not reading.stall_capable:
        return False
    return (reading.requests_running or 0) > 0 or (reading.requests_waiting or 0) > 0


@dataclass(frozen=True)
class ScheduleSettings:
    """Inputs of the schedule that do not change (from :class:`~node_probe.config.AgentConfig`).

    Attributes:
        busy_interval_s: mean seconds between scheduled probes while busy.
        idle_interval_s: mean seconds between scheduled probes otherwise (<= busy_interval_s).
        jitter_ratio: jitter of each interval, 0 <= ratio < 1.
        min_request_gap_s: least seconds between two requested probes.
        deep_interval_s: seconds between deep checks; ``None`` or 0: no deep checks.

    Raises:
        ValueError: (on construction) an interval <= 0, a gap < 0 or a ratio outside [0, 1).
    """

    busy_interval_s: float
    idle_interval_s: float
    jitter_ratio: float = 0.25
    min_request_gap_s: float = 1.0
    deep_interval_s: float | None = None

    def __post_init__(self) -> None:
        if self.busy_interval_s <= 0 or self.idle_interval_s <= 0:
            raise ValueError("busy_interval_s and idle_interval_s must be > 0")
        if not 0 <= self.jitter_ratio < 1:
            raise ValueError("jitter_ratio must be in [0, 1)")
        if self.min_request_gap_s < 0:
            raise ValueError("min_request_gap_s must be >= 0")
        if self.deep_interval_s is not None and self.deep_interval_s < 0:
            raise ValueError("deep_interval_s must be >= 0")


@dataclass(frozen=True)
class Decision:
    """What to do now: start a probe (``trigger`` set, ``wait_s`` 0) or wait ``wait_s`` seconds
    (``trigger`` ``None``) and ask again."""

    trigger: Trigger | None
    wait_s: float = 0.0


class ProbeScheduler:
    """The schedule's state and its decision (see the module docstring for the rules).

    Args:
        settings: the fixed inputs.
        rng: source of the jitter draws (seed it for a reproducible schedule).
    """

    def __init__(self, settings: ScheduleSettings, rng: random.Random | None = None) -> None:
        self.settings = settings
        self._rng = rng or random.Random()
        self.busy = False
        self._last_end: float | None = None  # None: the first probe starts at once
        self._jitter = 1.0
        self._pending: Trigger | None = None
        self._last_request_at: float | None = None
        self._last_deep_at: float | None = None
        self._recheck = False  # the last probe got no answer: next one at the idle cadence

    @property
    def pending(self) -> Trigger | None:
        """The trigger of the requested probe not started yet, ``None`` when none is."""
        return self._pending

    def interval_s(self) -> float:
        """The mean interval under the current load, in seconds (before jitter)."""
        s = self.settings
        return s.busy_interval_s if self.busy and not self._recheck else s.idle_interval_s

    def set_busy(self, busy: bool) -> bool:
        """Feed the load class (:func:`load_is_busy`); True when it changed (re-plan now)."""
        changed = busy != self.busy
        self.busy = busy
        return changed

    def request(self, trigger: Trigger = Trigger.PROBE_NOW) -> None:
        """Ask for a probe as soon as the request gap allows (``PROBE_NOW`` or ``STALL``)."""
        if self._pending is None or trigger == Trigger.PROBE_NOW:
            self._pending = trigger

    def decide(self, now: float) -> Decision:
        """The decision at ``now``. Starting a probe is recorded (a request is consumed, a deep
        check dated); call :meth:`probe_done` when it ends."""
        s = self.settings
        due = now if self._last_end is None else self._last_end + self.interval_s() * self._jitter
        request_ok_at: float | None = None
        if self._pending is not None:
            request_ok_at = (now if self._last_request_at is None
                             else max(now, self._last_request_at + s.min_request_gap_s))
            due = min(due, request_ok_at)
        if now < due:
            return Decision(None, due - now)
        if request_ok_at is not None and now >= request_ok_at:
            trigger, self._pending = self._pending, None
            self._last_request_at = now
            assert trigger is not None
            return Decision(trigger)
        if s.deep_interval_s and (self._last_deep_at is None or now - self._last_deep_at >= s.deep_interval_s):
            self._last_deep_at = now
            return Decision(Trigger.DEEP)
        return Decision(Trigger.SCHEDULED)

    def probe_done(self, now: float, answered: bool = True) -> None:
        """The probe started by the last decision ended at ``now`` (``answered`` False: it timed
        out or answered slowly, re-check at the idle cadence); draws the next jitter."""
        self._last_end = now
        self._recheck = not answered
        j = self.settings.jitter_ratio
        self._jitter = self._rng.uniform(1 - j, 1 + j)
