"""A heartbeat's record in the node's health, and the quiet heartbeat's fast path. Pure.

Shape::

    nh2, seen = record_heartbeat(nh, hb, now_s, cfg)   # the records a heartbeat updates
    nh2 = quiet_heartbeat(nh, hb, now_s, cfg)          # the whole step when no rule can fire, else None
    nh2, due_s = steady_heartbeat(nh, hb, now_s, cfg)  # the same for a node heard last time, with its
                                                       # next Tick's deadline; or None

:func:`record_heartbeat` is the recording phase of :func:`xds_server.health.rules.step` for a
:class:`HeartbeatObserved`: arrival time, the phi-accrual estimate, the engine record (kept, the
same immutable value, when the heartbeat reports what it holds) and a pending fail-static
forgiveness (consumed). :func:`quiet_heartbeat` is what ``step`` returns, without events, for the
heartbeat of a node in which none of the heartbeat's or time's rules can give a signal that
changes anything (the steady state: a routed or warming node, no ejection cause, no forgiveness
pending, engine READY-as-before and not stalled, no GPU fatal event, no ramp step or HEALTHY run
due); None otherwise (``step`` then runs every rule). A property test keeps it equal to the full
step over random observation sequences (tests/property/test_health_fast_path.py).
"""
from __future__ import annotations

from xds_server.config import HealthConfig
from xds_server.health import phi as phimod
from xds_server.health.clocks import EPS_S, next_check_s
from xds_server.health.records import (
    Engine,
    EngineState,
    HeartbeatObserved,
    Heartbeats,
    NodeHealth,
    NodeState,
)

__all__ = ["Seen", "quiet_heartbeat", "record_heartbeat", "steady_heartbeat"]

Seen = tuple["float | None", EngineState, "tuple[float, float] | None"]
"""What the recording saw before it overwrote the records: (silence before this heartbeat in ms
or None for the first, engine state before it, (burst start, until) of a pending forgiveness)."""

# States in which HEARTBEAT and CLEAN_PERIOD_MET change nothing (the table: noop, stay)
_QUIET_STATES = frozenset({NodeState.WARMING, NodeState.PROBATION, NodeState.HEALTHY, NodeState.DEGRADED,
                           NodeState.REFUSING})
_RESTARTING = (EngineState.COLD, EngineState.WARMING)


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
            arrivals = phimod.ArrivalStats(cfg.heartbeat_interval_ms, cfg.phi_min_std_ms ** 2, 0)
        arrivals = phimod.update(arrivals, (now - last) * 1000.0, cfg.phi_alpha)
    clears = h.suspicion_clears
    if clears:
        clears = tuple(t for t in clears if now - t < cfg.phi_suspicion_window_s)
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
    if not (progress_at is None and e.progress_at_s is None and e.state is hb.engine_state
            and e.stalled == hb.stalled and e.stalled_since_s == stalled_since and e.stall_counted == counted
            and (e.requests_running is hb.requests_running or _same(e.requests_running, hb.requests_running))
            and (e.requests_waiting is hb.requests_waiting or _same(e.requests_waiting, hb.requests_waiting))
            and (e.gpu_free_ratio is hb.gpu_free_ratio or _same(e.gpu_free_ratio, hb.gpu_free_ratio))
            and e.gpu_fatal == hb.gpu_fatal and e.progress_detail == progress_detail):
        e = Engine(hb.engine_state, hb.stalled, stalled_since, counted, hb.requests_running,
                   hb.requests_waiting, hb.gpu_free_ratio, hb.gpu_fatal, progress_at, progress_detail)
    # else: the engine record is unchanged (a steady node): the same immutable value is kept
    return NodeHealth(nh.node_id, nh.state, nh.reason, nh.since_s, Heartbeats(now, 0, False, arrivals, clears),
                      nh.rtt, nh.probe, e, ej, nh.ramp, nh.drain)


def quiet_heartbeat(nh: NodeHealth, hb: HeartbeatObserved, now: float, cfg: HealthConfig) -> NodeHealth | None:
    """``step(nh, hb, now, cfg)``'s node when it gives no event and only records, else None.

    Each condition is the negation of a rule's (xds_server.health.rules) for this heartbeat:
    disproved and forgive-pending need an ejection cause or a pending forgiveness; GPU fatal,
    engine FAILED, restarting (COLD/WARMING after READY) and stall read the heartbeat; stall
    confirmation needs a counted stall, which a heartbeat without a stall resets; the clean
    period's signal changes nothing in these states; ramp and HEALTHY run are read as the rules
    read them (the recording changes neither record)."""
    if nh.state not in _QUIET_STATES or hb.stalled or hb.gpu_fatal:
        return None
    ej = nh.ejection
    if ej.cause is not None or ej.forgive_since_s is not None:
        return None
    state = hb.engine_state
    if state is EngineState.FAILED or (state in _RESTARTING and nh.engine.state is EngineState.READY):
        return None
    at = nh.ramp.step_at_s
    if at is not None and now - at >= cfg.ramp_step_s - EPS_S:
        return None
    if (ej.clean_period_s and ej.healthy_since_s is not None
            and now - ej.healthy_since_s >= cfg.probation_clean_max_s):
        return None
    return _recorded(nh, hb, now, cfg)


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
