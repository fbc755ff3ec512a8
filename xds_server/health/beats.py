"""A heartbeat's record in the node's health, the quiet heartbeat's fast path, and heartbeats
folded in place. No I/O, no clock reads: times are arguments.

Shape::

    nh2, seen = record_heartbeat(nh, hb, now_s, cfg)   # the records a heartbeat updates
    nh2 = quiet_heartbeat(nh, hb, now_s, cfg)          # the whole step when no rule can fire, else None
    nh2, due_s = steady_heartbeat(nh, hb, now_s, cfg)  # the same for a node heard last time, with its
                                                       # next Tick's deadline; or None
    run = BeatRun.start(nh2, hb, cfg)                  # then the same heartbeat again, folded:
    due_s = run.fold(hb, now_s, cfg)                   #   the deadline, or None (settle, step it)
    nh3 = run.settled()                                #   the record step would have built

:func:`record_heartbeat` is the recording phase of :func:`xds_server.health.rules.step` for a
:class:`HeartbeatObserved`: arrival time, the phi-accrual estimate, the engine record (kept, the
same immutable value, when the heartbeat reports what it holds) and a pending fail-static
forgiveness (consumed). :func:`quiet_heartbeat` is what ``step`` returns, without events, for the
heartbeat of a node in which none of the heartbeat's or time's rules can give a signal that
changes anything (the steady state: a routed or warming node, no ejection cause, no forgiveness
pending, engine READY-as-before and not stalled, no GPU fatal event, no ramp step or HEALTHY run
due); None otherwise (``step`` then runs every rule). A property test keeps it equal to the full
step over random observation sequences (tests/property/test_health_fast_path.py).
:class:`BeatRun` is the one mutable value here: an accumulator its owner (the control core's
health table, a worker's detector) keeps per steady node and settles on any read.
"""
from __future__ import annotations

from xds_server.config import HealthConfig
from xds_server.health import phi as phimod
from xds_server.health.clocks import EPS_S, due_plan, next_check_s, planned_due_s
from xds_server.health.records import (
    Engine,
    EngineState,
    HeartbeatObserved,
    Heartbeats,
    NodeHealth,
    NodeState,
)

__all__ = ["BeatRun", "Seen", "quiet_heartbeat", "record_heartbeat", "steady_heartbeat"]

Seen = tuple["float | None", EngineState, "tuple[float, float] | None"]
"""What the recording saw before it overwrote the records: (silence before this heartbeat in ms
or None for the first, engine state before it, (burst start, until) of a pending forgiveness)."""

# States in which HEARTBEAT and CLEAN_PERIOD_MET change nothing (the table: noop, stay)
_QUIET_STATES = frozenset({NodeState.WARMING, NodeState.PROBATION, NodeState.HEALTHY, NodeState.DEGRADED,
                           NodeState.REFUSING})
_RESTARTING = (EngineState.COLD, EngineState.WARMING)
_GAP_DECAY = 0.5
"""``Engine.progress_gap_s`` after a move: the larger of this gap and the last value x this, so a
slow cadence (a chunked prefill) is learned at its first long gap and forgotten within a few moves."""


def _same(a: float | None, b: float | None) -> bool:
    """Equal and of the same type and zero sign (so keeping ``a`` is exactly keeping ``b``)."""
    return a is b or (type(a) is type(b) and a == b and (a != 0.0 or str(a) == str(b)))


def record_heartbeat(nh: NodeHealth, hb: HeartbeatObserved, now: float, cfg: HealthConfig) -> tuple[NodeHealth, Seen]:
    """The node's records after heartbeat ``hb`` at ``now`` (s), and what they held before (:data:`Seen`)."""
    last, ej = nh.heartbeat.last_s, nh.ejection
    pending = None if ej.forgive_since_s is None else (ej.forgive_since_s, ej.forgive_until_s)
    return _recorded(nh, hb, now, cfg), (None if last is None else (now - last) * 1000.0, nh.engine.state, pending)


def _recorded(nh: NodeHealth, hb: HeartbeatObserved, now: float, cfg: HealthConfig) -> NodeHealth:
    """The node's records after heartbeat ``hb`` at ``now`` (s) (:func:`record_heartbeat`'s node)."""
    h, e = nh.heartbeat, nh.engine
    last = h.last_s
    arrivals = h.arrivals
    if last is not None and not h.stream_closed:
        if arrivals is None:
            arrivals = phimod.ArrivalStats(cfg.heartbeat.interval.ms, cfg.phi.min_std.ms ** 2, 0)
        arrivals = phimod.update(arrivals, (now - last) * 1000.0, cfg.phi.alpha)
    clears = h.suspicion_clears
    if clears:
        clears = tuple(t for t in clears if now - t < cfg.phi.suspicion_window.s)
    stalled_since, counted = e.stalled_since_s, e.stall_counted
    if hb.stalled and not e.stalled:
        stalled_since, counted = now, 0
    elif not hb.stalled:
        stalled_since, counted = None, 0
    ej = nh.ejection
    if ej.forgive_since_s is not None:  # a pending forgiveness is consumed by this heartbeat either way
        ej = type(ej)(ej.cause, ej.from_state, ej.clean_period_s, ej.healthy_since_s, None, 0.0)
    age = hb.progress_age_ms
    progress_at = None if age is None else now - age / 1000.0
    progress_detail = hb.progress_detail if age is not None else ""
    gap = None if progress_at is None else e.progress_gap_s
    if progress_at is not None and e.progress_at_s is not None and \
            progress_at - e.progress_at_s > cfg.heartbeat.interval.s / 2:  # moved (not arrival jitter)
        moved = min(progress_at - e.progress_at_s, cfg.busy.progress_window.s)
        gap = moved if gap is None else max(moved, gap * _GAP_DECAY)
    if not (progress_at is None and e.progress_at_s is None and e.state is hb.engine_state
            and e.stalled == hb.stalled and e.stalled_since_s == stalled_since and e.stall_counted == counted
            and (e.requests_running is hb.requests_running or _same(e.requests_running, hb.requests_running))
            and (e.requests_waiting is hb.requests_waiting or _same(e.requests_waiting, hb.requests_waiting))
            and (e.gpu_free_ratio is hb.gpu_free_ratio or _same(e.gpu_free_ratio, hb.gpu_free_ratio))
            and e.gpu_fatal == hb.gpu_fatal and e.progress_detail == progress_detail):
        e = Engine(hb.engine_state, hb.stalled, stalled_since, counted, hb.requests_running,
                   hb.requests_waiting, hb.gpu_free_ratio, hb.gpu_fatal, progress_at, progress_detail, gap)
    # else: the engine record is unchanged (a steady node): the same immutable value is kept
    return NodeHealth(nh.node_id, nh.state, nh.reason, nh.since_s,
                      Heartbeats(now, 0, False, arrivals, clears, hb.vouched),
                      nh.rtt, nh.probe, e, ej, nh.ramp, nh.drain, nh.validation)


def quiet_heartbeat(nh: NodeHealth, hb: HeartbeatObserved, now: float, cfg: HealthConfig) -> NodeHealth | None:
    """``step(nh, hb, now, cfg)``'s node when it gives no event and only records, else None."""
    return _recorded(nh, hb, now, cfg) if _quiet(nh, hb, now, cfg) else None


def _quiet(nh: NodeHealth, hb: HeartbeatObserved, now: float, cfg: HealthConfig) -> bool:
    """No rule can fire for heartbeat ``hb`` at ``now`` (:func:`quiet_heartbeat`).

    Each condition is the negation of a rule's (xds_server.health.rules) for this heartbeat:
    disproved and forgive-pending need an ejection cause or a pending forgiveness; GPU fatal,
    engine FAILED, restarting (COLD/WARMING after READY) and stall read the heartbeat; stall
    confirmation needs a counted stall, which a heartbeat without a stall resets; the clean
    period's signal changes nothing in these states; ramp and HEALTHY run are read as the rules
    read them (the recording changes neither record)."""
    return _quiet_record(nh, hb) and _quiet_until(nh, now, cfg)


def _quiet_record(nh: NodeHealth, hb: HeartbeatObserved) -> bool:
    """The conditions of :func:`_quiet` that do not read the time."""
    if nh.state not in _QUIET_STATES or hb.stalled or hb.gpu_fatal or nh.probe.busy_timeout_s is not None:
        return False  # (a timeout read as busy is judged at the heartbeats after it)
    ej = nh.ejection
    if ej.cause is not None or ej.forgive_since_s is not None:
        return False
    state = hb.engine_state
    return not (state is EngineState.FAILED or (state in _RESTARTING and nh.engine.state is EngineState.READY))


def _quiet_until(nh: NodeHealth, now: float, cfg: HealthConfig) -> bool:
    """The conditions of :func:`_quiet` that read the time: no ramp step and no HEALTHY run due."""
    at = nh.ramp.step_at_s
    if at is not None and now - at >= cfg.probation.ramp_step.s - EPS_S:
        return False
    ej = nh.ejection
    return not (ej.clean_period_s and ej.healthy_since_s is not None
                and now - ej.healthy_since_s >= cfg.probation.clean_max.s)


def steady_heartbeat(nh: NodeHealth, hb: HeartbeatObserved, now: float,
                     cfg: HealthConfig) -> tuple[NodeHealth, float | None] | None:
    """``(quiet_heartbeat(nh, hb, now, cfg), tick_due_s(of it))`` for a node with no counted miss
    and an open stream (the steady state of a watched node), None otherwise or when the heartbeat
    is not quiet. After a quiet heartbeat no miss is counted, so the next Tick is due at
    :func:`~xds_server.health.clocks.next_check_s` (``tick_due_s`` backs off only past
    ``consecutive_misses``). The control plane's per-heartbeat path (ControlCore.observe);
    tests/property/test_health_fast_path.py keeps it equal to ``step`` and ``tick_due_s``."""
    h = nh.heartbeat
    if h.consecutive_misses or h.stream_closed:
        return None
    out = quiet_heartbeat(nh, hb, now, cfg)
    if out is None:
        return None
    return out, next_check_s(out, cfg)


class BeatRun:
    """The quiet heartbeats of one steady node folded in place, after its record ``base``.

    A heartbeat that changes nothing but the arrival time and the inter-arrival estimate (the
    same observation object as the one ``base`` recorded, hence the same engine record; no
    progress age, no suspicion record, no miss, the stream open, not vouched: a transport
    stream's refresh comes once a second and may leave no deadline) is folded here instead of
    building three records (``NodeHealth``, ``Heartbeats``, ``ArrivalStats``) per heartbeat:
    :meth:`fold` gives the next Tick's deadline, :meth:`settled` the record ``step`` would have
    built after the same heartbeats. A property test keeps both equal to ``steady_heartbeat``
    step by step (tests/property/test_health_fast_path.py). The control plane keeps one per
    steady node and settles it on any read of the node's health (xds_server.control.node_table).

    ``mean_ms``, ``var_ms2`` and ``samples`` are read as an ``ArrivalStats`` by the phi functions.
    """

    __slots__ = ("base", "cfg", "last_s", "mean_ms", "obs", "plan", "samples", "var_ms2")

    def __init__(self, base: NodeHealth, obs: HeartbeatObserved, cfg: HealthConfig) -> None:
        h = base.heartbeat
        assert h.last_s is not None and h.arrivals is not None
        self.base = base
        self.obs = obs
        self.cfg = cfg
        self.plan = due_plan(base, cfg)  # what the deadline reads besides the arrivals: fixed in a run
        self.last_s = h.last_s
        a = h.arrivals
        self.mean_ms, self.var_ms2, self.samples = a.mean_ms, a.var_ms2, a.samples

    @classmethod
    def start(cls, nh: NodeHealth, hb: HeartbeatObserved, cfg: HealthConfig) -> BeatRun | None:
        """A run after ``nh``, the record a steady heartbeat ``hb`` just gave under ``cfg``; None
        when later heartbeats could not be folded (see the class docstring)."""
        h = nh.heartbeat
        if (h.last_s is None or h.arrivals is None or h.consecutive_misses or h.stream_closed or h.suspicion_clears
                or hb.progress_age_ms is not None or hb.stalled or hb.vouched or not _quiet_record(nh, hb)):
            return None  # (vouched: its deadline may be none, which fold could not tell from "not folded")
        return cls(nh, hb, cfg)

    def fold(self, hb: HeartbeatObserved, now: float, cfg: HealthConfig) -> float | None:
        """Fold heartbeat ``hb`` at ``now`` (s): the next Tick's deadline (s, as
        ``steady_heartbeat`` gives it), or None when ``hb`` cannot be folded (another
        observation, another config, a ramp step or HEALTHY run due: nothing changed; settle
        the run and step the heartbeat)."""
        if hb is not self.obs or cfg is not self.cfg or not _quiet_until(self.base, now, cfg):
            return None
        self.mean_ms, self.var_ms2, self.samples = phimod.fold(self.mean_ms, self.var_ms2, self.samples,
                                                               (now - self.last_s) * 1000.0, cfg.phi.alpha)
        self.last_s = now
        return planned_due_s(self.plan, cfg, now, 0, self)

    def settled(self) -> NodeHealth:
        """The node's record after the folded heartbeats, as ``step`` builds it."""
        nh = self.base
        return NodeHealth(nh.node_id, nh.state, nh.reason, nh.since_s,
                          Heartbeats(self.last_s, 0, False,
                                     phimod.ArrivalStats(self.mean_ms, self.var_ms2, self.samples), (),
                                     self.obs.vouched),
                          nh.rtt, nh.probe, nh.engine, nh.ejection, nh.ramp, nh.drain, nh.validation)
