"""The health model's timers: when a miss is counted, when phi convicts, when a Tick is next due.

Pure functions of a node's records, the config and a time argument (caller's monotonic clock, s).
Other modules (cluster policy, the probe session, the control plane) ask these instead of
recomputing interval + grace or the required clean period themselves.
"""
from __future__ import annotations

import math

from xds_server.config import HealthConfig
from xds_server.health import phi as phimod
from xds_server.health.records import ROUTED_STATES, EjectionCause, NodeHealth

__all__ = ["EPS_S", "miss_after_s", "misses_at", "next_check_s", "phi_delay_s", "required_clean_s",
           "stall_confirm_at_s"]

EPS_S = 1e-9
"""Tolerance (s) for float error when a time lands exactly on a boundary."""


def miss_after_s(cfg: HealthConfig) -> float:
    """Silence (s) after the last heartbeat at which the first miss is counted: interval + grace.

    Seed 000: 100 ms + 80 ms = 0.18 s. A node silent longer than this is "silent" for fail-static.
    """
    return (cfg.heartbeat_interval_ms + cfg.heartbeat_grace_ms) / 1000.0


def misses_at(last_heartbeat_s: float, now_s: float, cfg: HealthConfig) -> int:
    """Heartbeats missed by ``now_s`` since the one that arrived at ``last_heartbeat_s``.

    One miss per heartbeat not arrived within interval + grace (seed 000): with 100 ms / 80 ms,
    misses are counted at +180 ms, +280 ms, +380 ms, ... after the last arrival.
    """
    late = now_s - last_heartbeat_s - miss_after_s(cfg) + EPS_S
    if late < 0:
        return 0
    return 1 + int(math.floor(late / (cfg.heartbeat_interval_ms / 1000.0)))


def required_clean_s(nh: NodeHealth, cfg: HealthConfig) -> float:
    """Clean period (s) an UNHEALTHY node needs before PROBATION: ``probation_clean_s`` (seed 000:
    60 s), doubled after each failed probation up to ``probation_clean_max_s``."""
    return nh.ejection.clean_period_s or cfg.probation_clean_s


def phi_delay_s(nh: NodeHealth, cfg: HealthConfig) -> float | None:
    """Silence (s) after which phi convicts, or None when phi is off, untrained or rate-limited.

    Rate limit: after ``phi_max_suspicions_per_min`` disproved suspicions within
    ``phi_suspicion_window_s``, only the count rule applies (0 = unlimited).
    """
    hb = nh.heartbeat
    if cfg.failure_detector != "phi" or hb.arrivals is None or hb.arrivals.samples < cfg.phi_min_samples:
        return None
    if cfg.phi_max_suspicions_per_min and len(hb.suspicion_clears) >= cfg.phi_max_suspicions_per_min:
        return None
    ms = phimod.suspicion_delay_ms(hb.arrivals, cfg.phi_threshold, cfg.phi_min_std_ms,
                                   cfg.phi_acceptable_pause_ms)
    return ms / 1000.0


def stall_confirm_at_s(nh: NodeHealth, cfg: HealthConfig) -> float | None:
    """When (caller's clock, s) a reported stall counts as a second probe timeout, or None when
    no stall is reported. The earlier of: ``stall_confirm_ms`` after the first report, and the
    moment the engine's last progress (``Engine.progress_at_s``, the agent's evidence) is
    ``busy_progress_window_ms`` + ``stall_confirm_ms`` old (1.3 s: the agent's 1 s stall window
    plus the confirmation, measured from the freeze itself rather than from when the report
    reached us, which adds up to a scrape and a heartbeat interval; issue 11). Progress already
    that old at the first report (the engine was idle before the stuck request: the agent's
    window started with the request) is not used; the report's time decides then."""
    e = nh.engine
    if not e.stalled or e.stalled_since_s is None:
        return None
    at = e.stalled_since_s + cfg.stall_confirm_ms / 1000.0
    if e.progress_at_s is not None:
        frozen_at = e.progress_at_s + (cfg.busy_progress_window_ms + cfg.stall_confirm_ms) / 1000.0
        if frozen_at >= e.stalled_since_s:  # older progress (idle before the request): not this freeze's
            at = min(at, frozen_at)
    return at


def next_check_s(nh: NodeHealth, cfg: HealthConfig) -> float | None:
    """Absolute time (caller's clock, s) at which a Tick can change something.

    The earliest of: the next heartbeat-miss boundary, phi conviction (routed, unsuspected
    nodes), the next ramp step, stall confirmation. None when nothing is pending (no heartbeat
    seen yet and no ramp).
    """
    # the running minimum of the candidates (no list: this runs once per heartbeat)
    best: float | None = None
    hb = nh.heartbeat
    if hb.last_s is not None:
        counted = max(hb.consecutive_misses - (1 if hb.stream_closed else 0), 0)
        best = hb.last_s + miss_after_s(cfg) + cfg.heartbeat_interval_ms / 1000.0 * counted
        if nh.ejection.cause is not EjectionCause.PHI and nh.state in ROUTED_STATES:
            d = phi_delay_s(nh, cfg)
            if d is not None and hb.last_s + d < best:
                best = hb.last_s + d
    if nh.ramp.step_at_s is not None:
        at = nh.ramp.step_at_s + cfg.ramp_step_s
        if best is None or at < best:
            best = at
    if nh.engine.stalled:
        confirm = stall_confirm_at_s(nh, cfg)
        if (confirm is not None and nh.engine.stall_counted == 1 and nh.state in ROUTED_STATES
                and (best is None or confirm < best)):
            best = confirm
    return best
