"""Gated traffic shifts: the gates and the step scheduler, as a table-driven state machine.

Pure: no clock reads, no I/O. Times are wall-clock seconds passed in by the caller (wall time, so
a schedule survives a restart and two replicas given the same ``anchor_s`` decide at the same
instants); shares are percent of the cluster's traffic sent to the target (0..100).

Shape::

    st = start(spec, now_s)                               # PENDING -> STEPPING (hard: DONE)
    if now_s >= st.next_decision_s:
        st, events = decide(st, judge(reading, cfg), now_s, cfg)
    st, events = command(st, "pause" | "resume" | "cancel", now_s)   # ValueError when not allowed

Gates (:func:`judge`), over one step's window:

- error: the target's completed requests ``n`` and errors ``e`` (LRS). Fewer than
  ``min_requests`` holds. Otherwise the Wilson score interval (z = ``wilson_z``) decides: upper
  bound < ``max_error_ratio`` passes, lower bound > it fails, in between holds (the sample cannot
  tell). 3 requests prove nothing either way.
- latency: the target's probe TTFT over the source's, minus 1, must be < ``max_latency_increase``
  plus the noise among the source's own nodes (their slowest over their fastest, minus 1: equal
  engines on a busy machine differ by that much without any change, as the replay judge's peers'
  noise); either side missing holds.

:func:`requests_needed` is the window arithmetic: with 0 errors the Wilson bound needs ~765
completed requests to prove a ratio under 0.5 %; a hold says how many a window needs at the ratio
seen.

A window passes when both pass, fails when either fails, else holds; it holds whatever the gates
say while target nodes wait unrouted for their switch-back verdicts (a region coming back is
judged only once its nodes are validated). A hold never rolls back; a
step rolls back after ``fail_windows`` consecutive failed windows (a hold neither counts nor
clears the run), and the shift pauses for the operator after ``max_rollbacks`` rollbacks or when
rolled back to 0 % (no traffic at 0 % could ever pass a gate).
"""
from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from xds_server.config import ShiftConfig

__all__ = ["GateReading", "GateResult", "Phase", "ShiftSpec", "ShiftState", "Verdict", "command",
           "decide", "judge", "requests_needed", "start", "wilson_interval"]


class Phase(enum.StrEnum):
    PENDING = "pending"
    STEPPING = "stepping"        # at a step, its window running, the last window passed (or none yet)
    HOLDING = "holding"          # the last window had too little data, or could not tell
    ROLLED_BACK = "rolled_back"  # the last decision rolled one step back
    PAUSED = "paused"            # operator pause, or too many rollbacks: no decisions until resume
    DONE = "done"                # 100 % on the target (terminal)
    CANCELLED = "cancelled"      # back to the weights before the shift (terminal)


TERMINAL = frozenset({Phase.DONE, Phase.CANCELLED})
ACTIVE = frozenset({Phase.STEPPING, Phase.HOLDING, Phase.ROLLED_BACK})


class Verdict(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"
    HOLD = "hold"


@dataclass(frozen=True, slots=True)
class GateReading:
    """One window's evidence: the target's completed and errored real requests (LRS counts) and
    the probe TTFT (ms) of the target and of the source (None: no reading)."""

    completed: int
    errored: int
    target_ttft_ms: float | None
    source_ttft_ms: float | None
    source_noise: float = 0.0  # the source nodes' slowest TTFT over their fastest, minus 1 (ratio)
    awaiting_validation: tuple[str, ...] = ()  # target nodes waiting unrouted for a switch-back verdict


@dataclass(frozen=True, slots=True)
class GateResult:
    """The verdict of a window and each gate's values (ratios 0..1; None: not measurable)."""

    verdict: Verdict
    error: Verdict
    latency: Verdict
    completed: int
    errored: int
    error_ratio: float | None
    error_lower: float | None
    error_upper: float | None
    latency_increase: float | None
    reason: str
    latency_noise: float = 0.0  # the source nodes' own spread the latency gate allowed (ratio)

    def to_json(self) -> dict[str, object]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 6)

        return {"verdict": self.verdict.value, "error_gate": self.error.value, "latency_gate": self.latency.value,
                "completed": self.completed, "errored": self.errored, "error_ratio": r(self.error_ratio),
                "error_ratio_lower": r(self.error_lower), "error_ratio_upper": r(self.error_upper),
                "latency_increase": r(self.latency_increase), "latency_noise": r(self.latency_noise),
                "reason": self.reason}


def wilson_interval(errors: int, n: int, z: float) -> tuple[float, float]:
    """Wilson score interval (lower, upper) of a ratio ``errors / n`` (0..1); (0, 1) when n is 0.

    Raises ValueError for negative counts or ``errors > n``.
    """
    if n < 0 or errors < 0 or errors > n:
        raise ValueError(f"wilson_interval: need 0 <= errors <= n, got errors={errors} n={n}")
    if n == 0:
        return 0.0, 1.0
    p = errors / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    den = 1 + z2 / n
    return max(0.0, (centre - half) / den), min(1.0, (centre + half) / den)


def judge(r: GateReading, cfg: ShiftConfig) -> GateResult:
    """The verdict of one window (see module docstring). Counts below 0 or errors above completed
    are clamped (a reading is never trusted to be consistent)."""
    n = max(0, r.completed)
    e = min(max(0, r.errored), n)
    ratio = e / n if n else None
    lo, hi = wilson_interval(e, n, cfg.wilson_z)
    reasons: list[str] = []
    need = requests_needed(ratio or 0.0, cfg)
    needs = (f"; a window needs {need} at {(ratio or 0.0):.2%} errors" if need is not None
             else f"; no window passes at {(ratio or 0.0):.2%} errors")
    if n < cfg.min_requests:
        err = Verdict.HOLD
        reasons.append(f"too little data: {n} of {cfg.min_requests} requests{needs}")
    elif hi < cfg.max_error_ratio:
        err = Verdict.PASS
    elif lo > cfg.max_error_ratio:
        err = Verdict.FAIL
        reasons.append(f"error ratio {ratio:.4f} (lower bound {lo:.4f}) >= {cfg.max_error_ratio}")
    else:
        err = Verdict.HOLD
        reasons.append(f"error ratio {ratio:.4f} cannot be told from {cfg.max_error_ratio} with {n} requests "
                       f"(bounds {lo:.4f}..{hi:.4f}){needs}")
    inc: float | None = None
    if r.target_ttft_ms is None or r.source_ttft_ms is None or r.source_ttft_ms <= 0:
        lat = Verdict.HOLD
        reasons.append("no probe TTFT for the " + ("target" if r.target_ttft_ms is None else "source"))
    else:
        inc = r.target_ttft_ms / r.source_ttft_ms - 1.0
        allowed = cfg.max_latency_increase + max(0.0, r.source_noise)
        lat = Verdict.PASS if inc < allowed else Verdict.FAIL
        if lat is Verdict.FAIL:
            reasons.append(f"latency +{inc:.1%} >= +{cfg.max_latency_increase:.0%} of the source "
                           f"+ {max(0.0, r.source_noise):.1%} noise among its own nodes")
    if r.awaiting_validation:  # a recovered region's nodes: no step before their verdicts
        reasons.insert(0, f"waiting for the target's switch-back verdicts ({', '.join(r.awaiting_validation[:3])}"
                          f"{' ...' if len(r.awaiting_validation) > 3 else ''})")
        v = Verdict.HOLD
    elif Verdict.FAIL in (err, lat):
        v = Verdict.FAIL
    elif Verdict.HOLD in (err, lat):
        v = Verdict.HOLD
    else:
        v = Verdict.PASS
    return GateResult(v, err, lat, n, e, ratio, lo if n else None, hi if n else None, inc, "; ".join(reasons),
                      max(0.0, r.source_noise))


def requests_needed(error_ratio: float, cfg: ShiftConfig) -> int | None:
    """The fewest completed requests with which a window whose error ratio is ``error_ratio``
    (0..1) passes the error gate (``min_requests`` at least, and the Wilson upper bound under
    ``max_error_ratio``); None when no count would (the ratio is at or above the limit)."""
    m = cfg.max_error_ratio
    if error_ratio >= m:
        return None

    def passes(n: int) -> bool:
        return wilson_interval(min(n, math.ceil(error_ratio * n)), n, cfg.wilson_z)[1] < m

    hi = max(1, cfg.min_requests)
    while not passes(hi):
        hi *= 2
        if hi > 1 << 40:
            return None
    lo = max(1, cfg.min_requests)
    while lo < hi:  # the bound falls with n at a fixed ratio: the first n that passes
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if passes(mid) else (mid + 1, hi)
    while lo > max(1, cfg.min_requests) and passes(lo - 1):  # a rounding step can make the bound dip
        lo -= 1
    return lo


@dataclass(frozen=True, slots=True)
class ShiftSpec:
    """What the operator asked: move ``cluster``'s traffic to ``to_kind`` ("priority" or "region")
    ``to``, ``step_percent`` (0 < step <= 100) per window of ``every_s`` (s); ``hard``: all at once."""

    cluster: str
    to_kind: str
    to: str
    step_percent: float
    every_s: float
    hard: bool = False

    def __post_init__(self) -> None:
        if self.to_kind not in ("priority", "region"):
            raise ValueError(f"to_kind: {self.to_kind!r} is not priority or region")
        if not 0 < self.step_percent <= 100:
            raise ValueError(f"step_percent: {self.step_percent} is not within (0, 100]")
        if not self.every_s > 0:
            raise ValueError(f"every_s: {self.every_s} must be > 0")


@dataclass(frozen=True, slots=True)
class ShiftState:
    """A shift's progress. ``steps``: steps taken (share = min(100, steps x step)); decisions fall
    at ``anchor_s + (decisions + 1) x every_s`` (wall s); ``window_start_s``: the current window's
    start; ``failures``: consecutive failed windows; ``paused_from``: the phase a pause left."""

    spec: ShiftSpec
    phase: Phase
    steps: int
    anchor_s: float
    decisions: int
    window_start_s: float
    failures: int = 0
    rollbacks: int = 0
    paused_from: Phase | None = None
    last_gate: GateResult | None = None
    reason: str = ""

    @property
    def share_percent(self) -> float:
        """Share (%) of the cluster's traffic commanded to the target, 0..100."""
        return min(100.0, self.steps * self.spec.step_percent)

    @property
    def next_decision_s(self) -> float | None:
        """When the next gate decision falls (wall s); None when none will (paused or terminal)."""
        if self.phase not in ACTIVE:
            return None
        return self.anchor_s + (self.decisions + 1) * self.spec.every_s


@dataclass(frozen=True, slots=True)
class ShiftEvent:
    """Something to log and show: ``kind`` (started, advanced, held, failed, rolled_back, done,
    paused, resumed, cancelled) and a sentence."""

    kind: str
    detail: str


def start(spec: ShiftSpec, now_s: float, anchor_s: float | None = None) -> tuple[ShiftState, list[ShiftEvent]]:
    """A new shift at its first step (``hard``: DONE at 100 %). ``anchor_s`` (wall s, default
    ``now_s``): the schedule's origin; replicas given the same anchor decide at the same instants."""
    a = now_s if anchor_s is None else anchor_s
    st = ShiftState(spec, Phase.PENDING, 0, a, 0, a)
    return _apply(st, "start", now_s, None, None)


def decide(st: ShiftState, gate: GateResult, now_s: float, cfg: ShiftConfig) -> tuple[ShiftState, list[ShiftEvent]]:
    """Apply a window's verdict if a decision is due (``now_s >= next_decision_s``); else unchanged."""
    nxt = st.next_decision_s
    if nxt is None or now_s < nxt:
        return st, []
    return _apply(st, gate.verdict.value, now_s, gate, cfg)


def command(st: ShiftState, what: str, now_s: float) -> tuple[ShiftState, list[ShiftEvent]]:
    """An operator command: "pause", "resume" or "cancel". ValueError naming the phase when the
    command does not apply to it (a done shift cannot be paused; a running one cannot be resumed)."""
    if what not in ("pause", "resume", "cancel"):
        raise ValueError(f"command: {what!r} is not pause, resume or cancel")
    return _apply(st, what, now_s, None, None)


# -- the table ----------------------------------------------------------------------------------

_Out = tuple[ShiftState, list[ShiftEvent]]
_Handler = Callable[[ShiftState, float, "GateResult | None", "ShiftConfig | None"], _Out]


def _next_window(st: ShiftState, now_s: float) -> ShiftState:
    # one decision per due instant; missed instants (downtime) are skipped, the grid is kept
    done = max(st.decisions + 1, int((now_s - st.anchor_s) // st.spec.every_s))
    return dataclasses.replace(st, decisions=done, window_start_s=now_s)


def _start(st: ShiftState, now_s: float, g: GateResult | None, c: ShiftConfig | None) -> _Out:
    s = st.spec
    if s.hard:
        st = dataclasses.replace(st, phase=Phase.DONE, steps=math.ceil(100 / s.step_percent), reason="hard switch")
        return st, [ShiftEvent("done", f"hard switch: 100 % to {s.to_kind} {s.to}")]
    st = dataclasses.replace(st, phase=Phase.STEPPING, steps=1)
    return st, [ShiftEvent("started", f"{st.share_percent:g} % to {s.to_kind} {s.to}, "
                                      f"+{s.step_percent:g} % every {s.every_s:g} s while the gates hold")]


def _pass(st: ShiftState, now_s: float, g: GateResult | None, c: ShiftConfig | None) -> _Out:
    st = dataclasses.replace(_next_window(st, now_s), steps=st.steps + 1, failures=0, last_gate=g, reason="")
    if st.share_percent >= 100:
        st = dataclasses.replace(st, phase=Phase.DONE)
        return st, [ShiftEvent("done", f"100 % to {st.spec.to_kind} {st.spec.to}")]
    st = dataclasses.replace(st, phase=Phase.STEPPING)
    return st, [ShiftEvent("advanced", f"gates held: {st.share_percent:g} % to the target")]


def _hold(st: ShiftState, now_s: float, g: GateResult | None, c: ShiftConfig | None) -> _Out:
    why = g.reason if g is not None else ""
    st = dataclasses.replace(_next_window(st, now_s), phase=Phase.HOLDING, last_gate=g,
                             reason=f"holding at {st.share_percent:g} %: {why}")
    return st, [ShiftEvent("held", st.reason)]


def _fail(st: ShiftState, now_s: float, g: GateResult | None, c: ShiftConfig | None) -> _Out:
    assert c is not None  # a verdict always comes with its config
    why = g.reason if g is not None else ""
    failures = st.failures + 1
    if failures < c.fail_windows:
        st = dataclasses.replace(_next_window(st, now_s), failures=failures, last_gate=g,
                          reason=f"gate failed {failures} of {c.fail_windows} windows: {why}")
        return st, [ShiftEvent("failed", st.reason)]
    steps, rollbacks = max(0, st.steps - 1), st.rollbacks + 1
    st = dataclasses.replace(_next_window(st, now_s), steps=steps, failures=0, rollbacks=rollbacks, last_gate=g,
                             phase=Phase.ROLLED_BACK)
    events = [ShiftEvent("rolled_back", f"{c.fail_windows} failed windows in a row: back to "
                                        f"{st.share_percent:g} % ({why})")]
    if steps == 0 or rollbacks >= c.max_rollbacks:
        why_pause = "rolled back to 0 %" if steps == 0 else f"{rollbacks} rollbacks"
        st = dataclasses.replace(st, phase=Phase.PAUSED, paused_from=Phase.ROLLED_BACK,
                                 reason=f"paused: {why_pause}; resume to try again or cancel")
        events.append(ShiftEvent("paused", st.reason))
    else:
        st = dataclasses.replace(st, reason=events[0].detail)
    return st, events


def _pause(st: ShiftState, now_s: float, g: GateResult | None, c: ShiftConfig | None) -> _Out:
    st = dataclasses.replace(st, phase=Phase.PAUSED, paused_from=st.phase, reason="paused by the operator")
    return st, [ShiftEvent("paused", f"paused at {st.share_percent:g} %")]


def _resume(st: ShiftState, now_s: float, g: GateResult | None, c: ShiftConfig | None) -> _Out:
    steps = max(1, st.steps)  # resumed after a rollback to 0 %: the first step again
    st = dataclasses.replace(st, phase=Phase.STEPPING, paused_from=None, steps=steps, anchor_s=now_s, decisions=0,
                             window_start_s=now_s, failures=0, reason="")
    return st, [ShiftEvent("resumed", f"resumed at {st.share_percent:g} %, a fresh window")]


def _cancel(st: ShiftState, now_s: float, g: GateResult | None, c: ShiftConfig | None) -> _Out:
    was = st.share_percent
    st = dataclasses.replace(st, phase=Phase.CANCELLED, steps=0, paused_from=None,
                             reason=f"cancelled by the operator at {was:g} %: the weights before the shift are back")
    return st, [ShiftEvent("cancelled", f"cancelled at {was:g} %: the weights before the shift are back")]


_RUNNING = (Phase.STEPPING, Phase.HOLDING, Phase.ROLLED_BACK)
TABLE: dict[tuple[Phase, str], _Handler] = {
    (Phase.PENDING, "start"): _start,
    **{(p, "pass"): _pass for p in _RUNNING},
    **{(p, "hold"): _hold for p in _RUNNING},
    **{(p, "fail"): _fail for p in _RUNNING},
    **{(p, "pause"): _pause for p in (Phase.PENDING, *_RUNNING)},
    (Phase.PAUSED, "resume"): _resume,
    **{(p, "cancel"): _cancel for p in (Phase.PENDING, *_RUNNING, Phase.PAUSED)},
}
"""(phase, input) -> handler. Inputs: start, pass/hold/fail (a window's verdict), pause, resume,
cancel. A pair not in the table is refused (ValueError)."""


def _apply(st: ShiftState, what: str, now_s: float, g: GateResult | None,
           c: ShiftConfig | None) -> tuple[ShiftState, list[ShiftEvent]]:
    h = TABLE.get((st.phase, what))
    if h is None:
        raise ValueError(f"cannot {what} a shift that is {st.phase.value}")
    return h(st, now_s, g, c)
