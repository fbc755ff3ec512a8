"""The health model's timers: when a miss is counted, when phi convicts, when a Tick is next due.

Pure functions of a node's records, the config and a time argument (caller's monotonic clock, s).
Other modules (cluster policy, the probe session, the control plane) ask these instead of
recomputing interval + grace or the required clean period themselves.
"""
from __future__ import annotations

import math

from xds_server.config import HealthConfig
from xds_server.health import phi as phimod
from xds_server.health.records import ROUTED_STATES, SUSPICIONS, EjectionCause, NodeHealth, NodeState, Rtt

__all__ = [
    "EPS_S",
    "DuePlan",
    "busy_confirm_s",
    "due_plan",
    "miss_after_s",
    "misses_at",
    "misses_shown",
    "next_check_s",
    "phi_delay_s",
    "planned_due_s",
    "required_clean_s",
    "rtt_above_baseline",
    "rtt_holds_until_s",
    "stall_confirm_at_s",
    "tick_due_s",
    "ticks_backed_off",
    "transport_suspected",
]

EPS_S = 1e-9
"""Tolerance (s) for float error when a time lands exactly on a boundary."""


def miss_after_s(cfg: HealthConfig) -> float:
    """Silence (s) after the last heartbeat at which the first miss is counted: interval + grace.

    Seed 000: 100 ms + 80 ms = 0.18 s. A node silent longer than this is "silent" for fail-static.
    """
    return (cfg.heartbeat.interval.ms + cfg.heartbeat.grace.ms) / 1000.0


def misses_at(last_heartbeat_s: float, now_s: float, cfg: HealthConfig) -> int:
    """Heartbeats missed by ``now_s`` since the one that arrived at ``last_heartbeat_s``.

    One miss per heartbeat not arrived within interval + grace (seed 000): with 100 ms / 80 ms,
    misses are counted at +180 ms, +280 ms, +380 ms, ... after the last arrival.
    """
    late = now_s - last_heartbeat_s - miss_after_s(cfg) + EPS_S
    if late < 0:
        return 0
    return 1 + math.floor(late / (cfg.heartbeat.interval.s))


def required_clean_s(nh: NodeHealth, cfg: HealthConfig) -> float:
    """Clean period (s) an UNHEALTHY node needs before PROBATION: ``probation.clean`` (seed 000:
    60 s), doubled after each failed probation up to ``probation.clean_max``."""
    return nh.ejection.clean_period_s or cfg.probation.clean.s


def rtt_above_baseline(r: Rtt, cfg: HealthConfig) -> bool:
    """Whether the EWMA RTT is above its baseline x ``rtt.baseline_tolerance`` + ``rtt.baseline_slack``
    (both known; either unknown: not above)."""
    return (r.baseline_ms is not None and r.ewma_ms is not None
            and r.ewma_ms > r.baseline_ms * cfg.rtt.baseline_tolerance + cfg.rtt.baseline_slack.ms)


def rtt_holds_until_s(nh: NodeHealth, cfg: HealthConfig, now_s: float) -> float | None:
    """Until when (s, the clock of ``clean_since_s``) an EWMA RTT above its baseline
    (:func:`rtt_above_baseline`) holds an UNHEALTHY node out of PROBATION at ``now_s``: at most
    (1 + ``rtt.baseline_wait_periods``) clean periods after its clean run began (``inf`` without a
    clean run); None when it does not hold it (at or under its baseline, or held its longest)."""
    if not rtt_above_baseline(nh.rtt, cfg):
        return None
    since = nh.probe.clean_since_s
    if since is None:
        return math.inf
    until = since + required_clean_s(nh, cfg) * (1.0 + cfg.rtt.baseline_wait_periods)
    return None if now_s >= until - EPS_S else until


def phi_delay_s(nh: NodeHealth, cfg: HealthConfig) -> float | None:
    """Silence (s) after which phi convicts, or None when phi is off, untrained or rate-limited.

    Rate limit: after ``phi_max_suspicions_per_min`` disproved suspicions within
    ``phi.suspicion_window``, only the count rule applies (0 = unlimited).
    """
    return _phi_delay(nh.heartbeat.arrivals, cfg) if _phi_on(nh, cfg) else None


def _phi_on(nh: NodeHealth, cfg: HealthConfig) -> bool:
    """phi is the failure detector and not rate-limited for this node (:func:`phi_delay_s`), and
    the node's transport does not vouch for it (``Heartbeats.vouched``: its heartbeats are a
    telemetry refresh, their gaps no evidence)."""
    return cfg.heartbeat.failure_detector == "phi" and not nh.heartbeat.vouched and not _suspicions_spent(nh, cfg)


def _suspicions_spent(nh: NodeHealth, cfg: HealthConfig) -> bool:
    """``phi.max_suspicions`` suspicions (phi or transport) disproved within ``phi.suspicion_window``."""
    return bool(cfg.phi.max_suspicions and len(nh.heartbeat.suspicion_clears) >= cfg.phi.max_suspicions)


def transport_suspected(nh: NodeHealth, cfg: HealthConfig) -> bool:
    """Whether a stream ended by its transport's liveness check (an unanswered HTTP/2 PING) makes
    the node suspected rather than counted out: it is routed, not suspected already, and fewer
    than ``phi.max_suspicions`` suspicions were disproved within ``phi.suspicion_window`` (a node
    whose drops keep being disproved is flapping: then the drop is proof, the whole miss threshold
    at once). A suspect is out at once, as before; a heartbeat before the count rule proves it
    (``heartbeat.consecutive_misses`` from the stream's end, ~0.28 s at the defaults) puts it back
    as it was: an agent cut by a starved host that dials again at once (65 ms measured) resumes its
    node's state, while a frozen host, silent past the count, is proven and comes back through
    PROBATION. Ours, as phi's suspicion is (its disproval, its rate limit)."""
    return nh.state in ROUTED_STATES and nh.ejection.cause not in SUSPICIONS and not _suspicions_spent(nh, cfg)


def _phi_delay(arrivals: phimod.Arrivals | None, cfg: HealthConfig) -> float | None:
    """:func:`phi_delay_s` from the inter-arrival estimate ``arrivals`` (``mean_ms``, ``var_ms2``
    and ``samples`` are read), phi on: None while untrained."""
    if arrivals is None or arrivals.samples < cfg.phi.min_samples:
        return None
    ms = phimod.suspicion_delay_ms(arrivals, cfg.phi.threshold, cfg.phi.min_std.ms, cfg.phi.acceptable_pause.ms)
    return ms / 1000.0


def stall_confirm_at_s(nh: NodeHealth, cfg: HealthConfig) -> float | None:
    """When (caller's clock, s) a reported stall counts as a second probe timeout, or None when
    no stall is reported. The earlier of: ``probes.stall_confirm`` after the first report, and the
    moment the engine's last progress (``Engine.progress_at_s``, the agent's evidence) is
    ``busy.progress_window`` + ``probes.stall_confirm`` old (1.3 s: the agent's 1 s stall window
    plus the confirmation, measured from the freeze itself rather than from when the report
    reached us, which adds up to a scrape and a heartbeat interval). Progress already
    that old at the first report (the engine was idle before the stuck request: the agent's
    window started with the request) is not used; the report's time decides then."""
    e = nh.engine
    if not e.stalled or e.stalled_since_s is None:
        return None
    at = e.stalled_since_s + cfg.probes.stall_confirm.s
    if e.progress_at_s is not None:
        frozen_at = e.progress_at_s + (cfg.busy.progress_window.ms + cfg.probes.stall_confirm.ms) / 1000.0
        if frozen_at >= e.stalled_since_s:  # older progress (idle before the request): not this freeze's
            at = min(at, frozen_at)
    return at


def busy_confirm_s(nh: NodeHealth, cfg: HealthConfig) -> float:
    """How long (s) after a probe timeout with evidence of progress a progress signal may take to
    move before the timeout is a failure (a hang) rather than busy: ``busy.confirm_min``, or
    ``busy_confirm_gaps`` x the engine's own cadence (``Engine.progress_gap_s``) if longer, at
    most ``busy.progress_window``; the window while the cadence is unknown."""
    window = cfg.busy.progress_window.s
    gap = nh.engine.progress_gap_s
    if gap is None:
        return window
    return min(window, max(cfg.busy.confirm_min.s, cfg.busy.confirm_gaps * gap))


def ticks_backed_off(nh: NodeHealth, cfg: HealthConfig) -> bool:
    """True when the node's silence Ticks are backed off (:func:`tick_due_s`): UNHEALTHY, ejected
    by the count rule (``EjectionCause.HEARTBEAT``) and ``consecutive_misses`` reached. A Tick
    then changes only the stored miss count: the count rule's ejection stands, the clean period
    cannot start while silent, and a heartbeat (handled when it arrives, not by a Tick) is what
    ends it."""
    return (nh.state is NodeState.UNHEALTHY and nh.ejection.cause is EjectionCause.HEARTBEAT
            and nh.heartbeat.last_s is not None and nh.heartbeat.consecutive_misses >= cfg.heartbeat.consecutive_misses)


def misses_shown(nh: NodeHealth, cfg: HealthConfig, now_s: float) -> int:
    """The consecutive misses at ``now_s`` (/nodes, and what :func:`tick_due_s` counts from): the
    stored count, or, once it has reached ``consecutive_misses``, the count a Tick at ``now_s``
    would store (misses from the time since the last heartbeat, one more for a closed stream):
    past the threshold Ticks may be backed off, so the stored count can lag the time."""
    hb = nh.heartbeat
    if hb.last_s is None or hb.consecutive_misses < cfg.heartbeat.consecutive_misses:
        return hb.consecutive_misses
    return max(hb.consecutive_misses, misses_at(hb.last_s, now_s, cfg) + (1 if hb.stream_closed else 0))


def next_check_s(nh: NodeHealth, cfg: HealthConfig) -> float | None:
    """Absolute time (caller's clock, s) at which a Tick can change something.

    The earliest of: the next heartbeat-miss boundary, phi conviction (routed, unsuspected
    nodes), the next ramp step, stall confirmation. None when nothing is pending (no heartbeat
    seen yet and no ramp).
    """
    return _check_s(nh, cfg, nh.heartbeat.consecutive_misses, 1)


def tick_due_s(nh: NodeHealth, cfg: HealthConfig, now_s: float) -> float | None:
    """When (caller's clock, s) the probe sources deliver the node's next Tick: :func:`next_check_s`,
    except for a node whose Ticks are backed off (:func:`ticks_backed_off`): its miss boundary is
    then ``k`` intervals ahead instead of one, ``k`` = the misses past ``consecutive_misses``
    (at least 1, at most ``heartbeat.silent_tick_max`` / ``heartbeat.interval``): Ticks 100, 100, 200,
    400, 800, 1,000, 1,000 ms apart with the defaults. Other deadlines (ramp, stall) still come
    first. Misses are counted as at ``now_s`` (:func:`misses_shown`), so a node leaving the
    back-off (e.g. a fatal probe changes its ejection's cause) gets its next Tick at the next miss
    boundary, as with a Tick every interval. ``now_s``: the caller's clock (s), the time of the
    observation just stepped. At 1,000 silent nodes this is ~1,000 health steps/s instead of
    ~10,000 (benchmarks/RESULTS.md). Routing decisions are those of a Tick every
    interval (tests/property/test_tick_backoff.py)."""
    misses = nh.heartbeat.consecutive_misses
    if misses < cfg.heartbeat.consecutive_misses:  # a heartbeat's path: no back-off, the count is exact
        return _check_s(nh, cfg, misses, 1)
    misses = misses_shown(nh, cfg, now_s)
    ahead = 1
    if ticks_backed_off(nh, cfg):
        cap = max(1, int(cfg.heartbeat.silent_tick_max.ms // cfg.heartbeat.interval.ms))
        ahead = max(1, min(misses - cfg.heartbeat.consecutive_misses, cap))
    return _check_s(nh, cfg, misses, ahead)


DuePlan = tuple["float | None", float, bool, "float | None", "float | None"]
"""What a node's next-check deadline depends on besides its heartbeat record (:func:`due_plan`):
(interval + grace s, or None when no miss can be counted, interval s, phi may convict, next ramp
step s or None, stall confirmation s or None)."""


def due_plan(nh: NodeHealth, cfg: HealthConfig) -> DuePlan:
    """The parts of ``nh``'s next-check deadline that its heartbeat arrivals do not move: the
    miss boundary's spacing, whether phi may convict (routed, not ejected by phi, phi on and not
    rate-limited), the ramp step and the stall confirmation that apply."""
    phi = nh.ejection.cause not in SUSPICIONS and nh.state in ROUTED_STATES and _phi_on(nh, cfg)
    ramp_at = None if nh.ramp.step_at_s is None else nh.ramp.step_at_s + cfg.probation.ramp_step.s
    stall_at = None
    if nh.engine.stalled and nh.engine.stall_counted == 1 and nh.state in ROUTED_STATES:
        stall_at = stall_confirm_at_s(nh, cfg)
    # vouched: no miss to count, so no Tick for one; unless a probe timeout waits for the next
    # heartbeat's progress evidence (busy or hung): the Ticks at miss boundaries bring it sooner
    # (the probe source answers them with the stream's last heartbeat, aged)
    vouched = nh.heartbeat.vouched and nh.probe.busy_timeout_s is None
    return None if vouched else miss_after_s(cfg), cfg.heartbeat.interval.s, phi, ramp_at, stall_at


def planned_due_s(plan: DuePlan, cfg: HealthConfig, last_s: float | None, counted: int,
                  arrivals: phimod.Arrivals | None) -> float | None:
    """The earliest of the deadlines :func:`next_check_s` lists, from ``due_plan`` and a last
    heartbeat at ``last_s`` (None: none yet) whose miss boundary is ``counted`` intervals after
    the first, with the inter-arrival estimate ``arrivals``. A node whose heartbeats are folded
    in place (:class:`xds_server.health.beats.BeatRun`) keeps its plan and calls this alone."""
    miss_s, interval_s, phi, ramp_at, stall_at = plan
    # the running minimum of the candidates (no list: this runs once per heartbeat)
    best: float | None = None
    if last_s is not None and miss_s is not None:
        best = last_s + miss_s + interval_s * counted
        if phi:
            d = _phi_delay(arrivals, cfg)
            if d is not None and last_s + d < best:
                best = last_s + d
    if ramp_at is not None and (best is None or ramp_at < best):
        best = ramp_at
    if stall_at is not None and (best is None or stall_at < best):
        best = stall_at
    return best


def _check_s(nh: NodeHealth, cfg: HealthConfig, misses: int, ahead: int) -> float | None:
    """:func:`next_check_s` with ``misses`` counted and the miss boundary ``ahead`` misses later."""
    hb = nh.heartbeat
    counted = misses - 1 if hb.stream_closed else misses  # a closed stream counted one at once
    if counted < 0:
        counted = 0
    return planned_due_s(due_plan(nh, cfg), cfg, hb.last_s, counted + ahead - 1, hb.arrivals)
