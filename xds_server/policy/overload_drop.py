"""Overload shedding for one cluster: how much of its traffic Envoy should drop. Pure.

Seed 002: when a region or a group of nodes drops out the survivors take 1.8-2.3x their load and
queue without limit; more than ``queue_warning`` (50) waiting is a warning, more than
``queue_critical`` (100) is critical. Shedding the excess at Envoy keeps the survivors' queues
short and tells the shed clients to come back (429 + Retry-After).

:func:`shed_step` (called once per load report, ``now_s`` monotonic s):

- **fail open**: no routable node, a routable node's queue telemetry missing or older than
  ``stale_after_s``, or no Envoy reporting load -> no drop (stale data never sheds);
- the completion rate ``C`` of the routable nodes (per s) is measured where the queue is: what
  Envoy sent them (LRS issued, ``admitted_rps``) minus the growth of their in-flight requests
  (waiting + running from the agents, ``growth_rps``), so a stream counts when it leaves the
  engine, not when its headers come back (LRS alone counts it then: ``completed_rps`` is the
  fallback when either input is missing, and the measure with ``queue_wait_budget`` null);
- **start** on either trigger: the seed's, the routable nodes' mean waiting over
  ``queue_warning`` (a node whose KV-cache usage is above ``kv_saturated_ratio`` counting as
  ``queue_warning + 1`` waiting; a node without KV telemetry adds nothing: the KV input fails
  open too); or the relative one, some node's expected queue wait, its waiting over its share of
  ``C`` (``C / n``), above ``queue_wait_budget`` with at least ``min_waiting`` waiting (the
  node with the longest queue decides, not the mean);
- the drop is the excess of the offered load (issued + already dropped, per s) over ``C``,
  keeping ``headroom_ratio`` of it free so queues drain: ``1 - C x (1 - headroom) / offered``, at
  least one step. It is taken on entry, and again (at least one step more) while the pressure
  stays (a wait over the budget, or a mean over ``queue_critical``) and the in-flight requests
  still grow; under pressure with queues shrinking, and between the low and the high marks, it
  is held (once shedding, a static queue means the completions track what is let in, so the
  formula alone would only ratchet up);
- **ease** once every queue stayed low (mean at or below ``off_ratio`` x ``queue_warning`` and
  every wait at or below ``off_ratio`` x the budget) for ``lift_after``: one step down per
  evaluation while they stay low, **lifted** at 0 (hysteresis: no flapping around a threshold,
  and an over-estimated drop gives capacity back step by step); ``step_percent`` steps, at most
  ``max_percent``.

With ``capacity_source: engines`` and every routable node's engine counting its finished
requests (``finished_rps``, ``slots``, ``service_s``): what the nodes take is the rate at which
the pool of their slots keeps the queue wait over ``queue_wait_budget`` to 1 % of arrivals
(:func:`~xds_server.policy.queueing.max_rate`, Erlang C); the drop never lets in more than that
(less an adaptive headroom from 0, +0.05 per evaluation over the budget, at most 0.5, 0.05 back
per ``4 x lift_after_s`` of low queues) whatever the offered load does, and an easing step must
fit under it with two Poisson standard errors of margin on the offered count.

``flip`` changes with every change of the drop: Envoy 1.40 applies a drop change only with a
host-set rebuild (docs/xds_protocol.md 2.5), so the assignment carries it as a one-point change
of ``overprovisioning_factor`` (:func:`~xds_server.xds.resources.build_cla`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from xds_server.config import ShedConfig
from xds_server.policy.queueing import max_rate

__all__ = ["ShedInputs", "ShedState", "shed_step"]

# Easing is held while the eased drop would let in more than the measured capacity, for at most
# this many lift_after_s (then eased anyway: a capacity measured long ago may be stale). Ours.
_TRUST_CAPACITY_LIFTS = 4
_HEADROOM_STEP = 0.05
_TAIL = 0.01  # the share of admitted requests allowed to wait past the budget: the p99
_MAX_HEADROOM = 0.5


@dataclass(frozen=True, slots=True)
class ShedState:
    """``percent``: the drop published (0..100); ``low_since_s``: since when queues are low
    while shedding (s); ``reason``: why, for the views; ``capacity_rps``: completions per s per
    routable node since shedding began (None: not yet). ``capacity_exact``: it came from the
    engines' own counters (the rate their pooled slots take with the queue wait over the budget
    for 1 % of arrivals, known at any load: nothing lets in more, less the headroom); else it is
    the most LRS-derived completions measured while a queue stood over the budget (a window
    saturated only in part reads low, so the most is kept, and trusted for ``4 x lift_after_s``
    of low queues). ``headroom``: the share of that rate kept free now (None: the default, 0 with
    the engines' counts, else ``headroom_ratio``; see the module docstring)."""

    percent: float = 0.0
    flip: bool = False
    low_since_s: float | None = None
    reason: str = ""
    capacity_rps: float | None = None
    capacity_exact: bool = False
    headroom: float | None = None


@dataclass(frozen=True, slots=True)
class ShedInputs:
    """``waiting``: each routable node's waiting requests (None: unknown); ``telemetry_age_s``:
    the age of each one's last heartbeat (s; None: never); ``offered_rps`` and ``completed_rps``:
    the cluster's real traffic over the window (LRS); ``reporters``: Envoys reporting;
    ``kv_usage``: each routable node's KV-cache usage (0..1; None or absent: unknown);
    ``admitted_rps``: LRS issued to the routable nodes over the window (per s) and ``growth_rps``:
    the growth of their in-flight requests over it (per s; None: unknown); ``node_ids``: their
    names, for the reason; ``finished_rps``: what each one's engine finished over the window by
    its own counter (per s; None: unknown), its ``slots`` (the most requests seen running) and
    ``service_s``: the time a request runs on it (s, Little's law; None: unknown);
    ``ttft_budget_s``: the budget learned from the cluster's unloaded TTFT (s; None: none yet or
    off), which with the engines' counts replaces ``queue_wait_budget`` when smaller."""

    waiting: Sequence[float | None]
    telemetry_age_s: Sequence[float | None]
    offered_rps: float
    completed_rps: float
    reporters: int
    kv_usage: Sequence[float | None] = ()
    admitted_rps: float | None = None
    growth_rps: float | None = None
    node_ids: Sequence[str] = ()
    finished_rps: Sequence[float | None] = ()
    slots: Sequence[float | None] = ()
    service_s: Sequence[float | None] = ()
    ttft_budget_s: float | None = None


def _set(state: ShedState, percent: float, reason: str, low_since_s: float | None = None,
         capacity_rps: float | None = None, exact: bool = False, headroom: float | None = None) -> ShedState:
    flip = state.flip if percent == state.percent else not state.flip
    shedding = percent > 0
    room = (headroom if headroom is not None else state.headroom) if shedding else None
    return ShedState(percent, flip, low_since_s, reason, capacity_rps if shedding else None, exact and shedding,
                     room)


def _offered_high(inp: ShedInputs, cfg: ShedConfig) -> float:
    """The offered load (per s) plus two standard errors of a Poisson count over the window: an
    easing step is taken only if it would let in no more than the capacity at this load, so a
    window that happened to count few arrivals does not open the door (ours)."""
    return inp.offered_rps + 2.0 * math.sqrt(max(inp.offered_rps, 0.0) / cfg.window.s)


def _engine_counts(inp: ShedInputs, cfg: ShedConfig) -> list[float] | None:
    """Each routable node's finished rate by its engine's counter, when every one has it and
    ``capacity_source`` is ``engines``."""
    if cfg.capacity_source != "engines" or cfg.queue_wait_budget is None:
        return None
    f = inp.finished_rps
    if len(f) != len(inp.waiting) or any(v is None for v in f):
        return None
    return [v for v in f if v is not None]


def _completions(inp: ShedInputs, cfg: ShedConfig, counted: list[float] | None) -> float:
    """The routable nodes' completion rate (per s, see the module docstring; with the relative
    trigger off, LRS's alone: the seed's thresholds as they were first built); ``counted``: the
    engines' counts (:func:`_engine_counts`)."""
    if cfg.queue_wait_budget is None:
        return inp.completed_rps
    if counted is not None:
        return sum(counted)
    if inp.admitted_rps is not None and inp.growth_rps is not None:
        return max(0.0, inp.admitted_rps - inp.growth_rps)
    return inp.completed_rps


def _budget(inp: ShedInputs, cfg: ShedConfig, counted: list[float] | None) -> float | None:
    """The queue-wait budget (s): ``queue_wait_budget``, or with the engines' counts the
    smaller of it and the one learned from the cluster's unloaded TTFT (``ttft_budget_s``)."""
    b = None if cfg.queue_wait_budget is None else cfg.queue_wait_budget.s
    if b is not None and inp.ttft_budget_s is not None and counted is not None:
        return min(b, inp.ttft_budget_s)
    return b


def _capacity(state: ShedState, inp: ShedInputs, completions: float, n: int, over_budget: bool,
              budget: float | None, counted: list[float] | None) -> tuple[float | None, bool]:
    """(arrivals per s per routable node the nodes take, exact). With the engines' counts: the
    rate at which the pool of their slots (nodes whose slots are not known yet counted as the
    mean of those known) keeps the queue wait over ``budget`` (:func:`_budget`) to 1 % of arrivals
    (:func:`~xds_server.policy.queueing.max_rate`: the p99 is the target). Else the most
    completions measured while over the budget (see :class:`ShedState`)."""
    if budget is not None and counted is not None:
        known = [(k, r) for k, r in zip(inp.slots, inp.service_s, strict=False) if k and r and r > 0]
        if known:
            pool = sum(k for k, _ in known) * n / len(known)
            mu = sum(k / r for k, r in known) / sum(k for k, _ in known)  # per slot, per s
            return max_rate(max(1, round(pool)), mu, budget, _TAIL) / n, True
    cap = None if state.capacity_exact else state.capacity_rps  # an engine-counted one was of other nodes
    if over_budget and completions > 0:  # saturated: completions are what they can do, at least
        cap = max(cap or 0.0, completions / n)
    return cap, False


def _longest_wait(known: list[float], completions: float, cfg: ShedConfig,
                  drain: Sequence[float | None] = ()) -> tuple[int, float] | None:
    """(index, expected wait in s) of the node whose queue waits longest among those with at least
    ``min_waiting`` waiting; None when none has (inf: nothing completes). A node's queue drains at
    its ``drain`` rate when known (per s: its slots over the time a request runs, what a node with
    a queue finishes), else at its share of ``completions`` (which on a node not full all the
    window reads low)."""
    share = completions / len(known)
    best: tuple[int, float] | None = None
    for i, w in enumerate(known):
        if w >= max(cfg.min_waiting, 1e-9):
            rate = drain[i] if i < len(drain) and drain[i] else share
            wait = w / rate if rate and rate > 0 else math.inf
            if best is None or wait > best[1]:
                best = (i, wait)
    return best


def shed_step(state: ShedState, inp: ShedInputs, cfg: ShedConfig, queue_warning: float, queue_critical: float,
              now_s: float) -> ShedState:
    """The next state (see module docstring). Deterministic; no I/O."""
    if not cfg.enabled:
        return _set(state, 0.0, "")
    if not inp.waiting:
        return _set(state, 0.0, "fail open: no routable node")
    stale = [a for a in inp.telemetry_age_s if a is None or a > cfg.stale_after.s]
    if stale or any(w is None for w in inp.waiting) or len(inp.telemetry_age_s) != len(inp.waiting):
        return _set(state, 0.0, f"fail open: queue telemetry of {max(1, len(stale))} routable node(s) "
                                f"older than {cfg.stale_after.s:g} s")
    if inp.reporters <= 0:
        return _set(state, 0.0, "fail open: no Envoy reports load")
    known = [w for w in inp.waiting if w is not None]
    kv = list(inp.kv_usage)[:len(known)]
    full = {i for i, u in enumerate(kv) if u is not None and u > cfg.kv_saturated_ratio}  # NaN: not full
    mean = sum(max(w, queue_warning + 1) if i in full else w for i, w in enumerate(known)) / len(known)
    kv_note = f" ({len(full)} node(s) with KV usage > {cfg.kv_saturated_ratio:g})" if full else ""
    counted = _engine_counts(inp, cfg)
    completions = _completions(inp, cfg, counted)
    budget = _budget(inp, cfg, counted)
    drain: list[float | None] = []
    if counted is not None:
        drain = [k / r if k and r and r > 0 else None
                 for k, r in zip(inp.slots, inp.service_s, strict=False)]
    longest = None if budget is None else _longest_wait(known, completions, cfg, drain)
    wait = 0.0 if longest is None else longest[1]
    over_budget = budget is not None and wait > budget
    queued = budget is not None and wait > budget * cfg.off_ratio  # above the low mark
    if state.percent <= 0 and mean <= queue_warning and not over_budget:
        return _set(state, 0.0, "")
    cap, exact = _capacity(state, inp, completions, len(known), over_budget, budget, counted)
    step = cfg.step_percent
    # With a capacity the engines counted, the headroom adapts from 0 (the queueing model keeps
    # the tail's margin): each evaluation with a queue over the budget while shedding adds 0.05
    # (at most 0.5); 4 x lift_after_s of low queues give 0.05 back. Ours (benchmarks/RESULTS.md).
    # Else it is headroom_ratio.
    floor = 0.0 if exact else cfg.headroom_ratio
    room = max(state.headroom if state.headroom is not None else floor, floor)
    if exact and over_budget and state.percent > 0:
        room = min(_MAX_HEADROOM, room + _HEADROOM_STEP)
    keep = 1.0 - room
    # with a capacity the engines counted, the drop follows the offered load: never less than
    # what lets in at most that capacity (less headroom), before a queue shows the excess
    need = 0.0
    if exact and cap is not None and inp.offered_rps > 0:
        need = math.ceil(max(0.0, 1.0 - cap * len(known) * keep / inp.offered_rps) * 100.0 / step - 1e-9) * step
        need = min(cfg.max_percent, need)
    if mean <= queue_warning * cfg.off_ratio and not queued:
        since = state.low_since_s if state.low_since_s is not None else now_s
        if cap is not None and need > state.percent:  # need > 0 only with a capacity
            return _set(state, need, f"tracking {need:g} %: offered {inp.offered_rps:.1f} rps, over the "
                        f"{cap * len(known) * keep:.1f} rps the routable nodes can complete (less headroom)",
                        since, cap, exact, room)
        if exact and room > floor and now_s - since >= cfg.lift_after.s * _TRUST_CAPACITY_LIFTS:
            room = max(floor, room - _HEADROOM_STEP)
            return _set(state, state.percent, f"holding {state.percent:g} %: queues low for "
                        f"{now_s - since:.0f} s, headroom back to {room:.2f}", now_s, cap, exact, room)
        if now_s - since >= cfg.lift_after.s:
            eased = max(0.0, min(state.percent, cfg.max_percent) - step)
            let_in = (_offered_high(inp, cfg) if exact else inp.offered_rps) * (1.0 - eased / 100.0)
            able = None if cap is None else cap * len(known) * keep
            over_cap = able is not None and let_in > able
            if able is not None and over_cap and (exact or now_s - since < cfg.lift_after.s * _TRUST_CAPACITY_LIFTS):
                return _set(state, state.percent, f"holding {state.percent:g} %: {eased:g} % would let in "
                            f"{let_in:.1f} rps, over the {able:.1f} rps the routable nodes "
                            f"were measured to complete (less headroom)", since, cap, exact, room)
            if eased <= 0:
                return _set(state, 0.0, f"lifted: queues low (mean waiting {mean:.0f}) for {cfg.lift_after.s:g} s")
            return _set(state, eased, f"easing to {eased:g} %: queues low (mean waiting {mean:.0f}, longest "
                                      f"wait {wait:.2f} s) for {now_s - since:.1f} s", since, cap, exact, room)
        if state.percent > cfg.max_percent:  # a reload lowered max_percent
            return _set(state, cfg.max_percent, state.reason, since, cap, exact, room)
        return replace(state, low_since_s=since, capacity_rps=cap, capacity_exact=exact, headroom=room)
    excess = 0.0
    if inp.offered_rps > 0:
        # the model's rate when the engines count; else a window saturated only in part reads low
        able = (cap or 0.0) * len(known) if exact else max(completions, (cap or 0.0) * len(known))
        excess = max(0.0, 1.0 - able * keep / inp.offered_rps) * 100.0
    measured = math.ceil(excess / step - 1e-9) * step
    growing = (inp.growth_rps or 0.0) > 0
    if state.percent <= 0:  # entry: the measured excess
        target, verb = max(step, measured), "shedding"
    elif mean > queue_critical or (over_budget and growing):
        target, verb = max(state.percent + step, measured), "shedding"  # still too much reaches the nodes
    elif queued and growing:  # a queue building under the budget: one step, the rate is not capacity yet
        target, verb = state.percent + step, "shedding"
    else:  # shrinking, or between the marks: hold (or follow the offered load, see need)
        target, verb = (need, "tracking") if need > state.percent else (state.percent, "holding")
    target = min(cfg.max_percent, target)
    if queued and longest is not None:
        i = longest[0]
        who = inp.node_ids[i] if i < len(inp.node_ids) else f"node {i}"
        mark = budget if over_budget else (budget or 0.0) * cfg.off_ratio
        why = (f"{who}'s queue waits ~{wait:.2f} s ({known[i]:.0f} waiting) > {mark:g} s"
               f"{', growing' if growing else ''}; mean waiting {mean:.0f}{kv_note}")
    else:
        rel = ">" if mean > queue_warning else "<="
        why = f"mean waiting {mean:.0f}{kv_note} {rel} {queue_warning:g}"
    src = " (engines' counters)" if counted is not None else ""
    return _set(state, target, f"{verb} {target:g} %: {why}; offered {inp.offered_rps:.1f} rps, "
                               f"completed {completions:.1f} rps{src}", None, cap, exact, room)
