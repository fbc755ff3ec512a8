"""Overload shedding for one cluster: how much of its traffic Envoy should drop. Pure.

Seed 002: when a region or a group of nodes drops out the survivors take 1.8-2.3x their load and
queue without limit; more than ``queue_warning`` (50) waiting is a warning, more than
``queue_critical`` (100) is critical. Shedding the excess at Envoy keeps the survivors' queues
short and tells the shed clients to come back (429 + Retry-After).

:func:`shed_step` (called once per load report, ``now_s`` monotonic s):

- **fail open**: no routable node, a routable node's queue telemetry missing or older than
  ``stale_after_s``, or no Envoy reporting load -> no drop (stale data never sheds);
- **start** when the routable nodes' mean waiting exceeds ``queue_warning``, a node whose KV-cache
  usage is above ``kv_saturated_ratio`` counting as ``queue_warning + 1`` waiting (saturated like a
  queue over the warning; a node without KV telemetry adds nothing: the KV input fails open too);
  **stay** while it
  is above ``off_ratio`` x ``queue_warning``; **lift** once it stayed at or below that for
  ``lift_after_s`` (hysteresis: no flapping around one threshold);
- on entry the drop is the excess of the offered load (issued + already dropped, per s) over what
  the routable nodes complete (per s), keeping ``headroom_ratio`` of it free so queues drain:
  ``1 - completed x (1 - headroom) / offered``, at least one step; then one more step per
  evaluation while the mean waiting is above ``queue_critical``, held otherwise (once shedding,
  completions track what is let in, so the formula would only ratchet up); ``step_percent``
  steps, at most ``max_percent``.

``flip`` changes with every change of the drop: Envoy 1.40 applies a drop change only with a
host-set rebuild (docs/xds_protocol.md 2.5), so the assignment carries it as a one-point change
of ``overprovisioning_factor`` (:func:`~xds_server.xds.resources.build_cla`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from xds_server.config import ShedConfig

__all__ = ["ShedInputs", "ShedState", "shed_step"]


@dataclass(frozen=True, slots=True)
class ShedState:
    """``percent``: the drop published (0..100); ``low_since_s``: since when queues are low
    while shedding (s); ``reason``: why, for the views."""

    percent: float = 0.0
    flip: bool = False
    low_since_s: float | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ShedInputs:
    """``waiting``: each routable node's waiting requests (None: unknown); ``telemetry_age_s``:
    the age of each one's last heartbeat (s; None: never); ``offered_rps`` and ``completed_rps``:
    the cluster's real traffic over the window (LRS); ``reporters``: Envoys reporting;
    ``kv_usage``: each routable node's KV-cache usage (0..1; None or absent: unknown)."""

    waiting: Sequence[float | None]
    telemetry_age_s: Sequence[float | None]
    offered_rps: float
    completed_rps: float
    reporters: int
    kv_usage: Sequence[float | None] = ()


def _set(state: ShedState, percent: float, reason: str, low_since_s: float | None = None) -> ShedState:
    flip = state.flip if percent == state.percent else not state.flip
    return ShedState(percent, flip, low_since_s, reason)


def shed_step(state: ShedState, inp: ShedInputs, cfg: ShedConfig, queue_warning: float, queue_critical: float,
              now_s: float) -> ShedState:
    """The next state (see module docstring). Deterministic; no I/O."""
    if not cfg.enabled:
        return _set(state, 0.0, "")
    if not inp.waiting:
        return _set(state, 0.0, "fail open: no routable node")
    stale = [a for a in inp.telemetry_age_s if a is None or a > cfg.stale_after_s]
    if stale or any(w is None for w in inp.waiting) or len(inp.telemetry_age_s) != len(inp.waiting):
        return _set(state, 0.0, f"fail open: queue telemetry of {max(1, len(stale))} routable node(s) "
                                f"older than {cfg.stale_after_s:g} s")
    if inp.reporters <= 0:
        return _set(state, 0.0, "fail open: no Envoy reports load")
    known = [w for w in inp.waiting if w is not None]
    kv = list(inp.kv_usage)[:len(known)]
    full = {i for i, u in enumerate(kv) if u is not None and u > cfg.kv_saturated_ratio}  # NaN: not full
    mean = sum(max(w, queue_warning + 1) if i in full else w for i, w in enumerate(known)) / len(known)
    kv_note = f" ({len(full)} node(s) with KV usage > {cfg.kv_saturated_ratio:g})" if full else ""
    low = queue_warning * cfg.off_ratio
    if state.percent <= 0 and mean <= queue_warning:
        return _set(state, 0.0, "")
    if mean <= low:
        since = state.low_since_s if state.low_since_s is not None else now_s
        if now_s - since >= cfg.lift_after_s:
            return _set(state, 0.0, f"lifted: mean waiting {mean:.0f} <= {low:g} for {cfg.lift_after_s:g} s")
        if state.percent > cfg.max_percent:  # a reload lowered max_percent
            return _set(state, cfg.max_percent, state.reason, since)
        return replace(state, low_since_s=since)
    step = cfg.step_percent
    if state.percent <= 0:  # entry: the measured excess (completions are capacity when saturated)
        excess = 0.0
        if inp.offered_rps > 0:
            excess = max(0.0, 1.0 - inp.completed_rps * (1.0 - cfg.headroom_ratio) / inp.offered_rps) * 100.0
        target = max(step, math.ceil(excess / step - 1e-9) * step)
    elif mean > queue_critical:  # still too much reaches the nodes: one more step
        target = state.percent + step
    else:  # queues between off_ratio x warning and critical: hold (completions now track what is let in)
        target = state.percent
    target = min(cfg.max_percent, target)
    return _set(state, target, f"shedding {target:g} %: mean waiting {mean:.0f}{kv_note} > {queue_warning:g}; "
                               f"offered {inp.offered_rps:.1f} rps, completed {inp.completed_rps:.1f} rps")
