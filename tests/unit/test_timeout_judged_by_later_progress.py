"""A hang never reads as busy: a probe timeout is judged by the progress seen after it.

A hung engine used to be shown "busy: saturated ... progressing" for ~0.7 s when its counters
moved during the probe's wait, just before the hang. A probe timeout with evidence of progress is
now judged at the heartbeats after it: busy once a progress signal moves *after* the timeout; a
failure when none has moved within ``busy_confirm_min_ms`` (300 ms) or 2 x the engine's own
progress cadence. Pure model (NodeSim), heartbeats every 100 ms as the agent sends them.
"""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import HealthConfig
from xds_server.health.model import HeartbeatObserved, ProbeObserved, route
from xds_server.health.model import NodeState as S
from xds_server.health.model import ProbeResultKind as K
from xds_server.health.sim import NodeSim

CFG = HealthConfig(ramp_step_percent=50, ramp_step_s=1.0)


def healthy_sim() -> NodeSim:
    sim = NodeSim(cfg=CFG)
    sim.run_until(4.0)
    assert sim.nh.state is S.HEALTHY
    return sim


def moving_until(t_hang: float, every_s: float = 0.1, scrape_s: float = 0.1):
    """Heartbeats of an engine with 4 requests running whose token counter moves every ``every_s``
    (as the agent's ``scrape_s`` scrapes see it) until ``t_hang``, then never; the agent declares
    the stall once tokens are frozen for its 1 s window."""
    def hb(t: float) -> HeartbeatObserved:
        step = max(every_s, scrape_s)
        last = math.floor(min(t, t_hang) / step + 1e-9) * step   # the last scrape that saw a move
        return HeartbeatObserved(requests_running=4, requests_waiting=2, progress_age_ms=(t - last) * 1000.0,
                                 progress_detail="engine 0: tokens 100 -> 140",
                                 stalled=t - t_hang > 1.05, stall_detail="engine 0: 4 running, tokens frozen for 1.1 s")
    return hb


def test_hang_50ms_before_the_probe_times_out_is_never_shown_busy_counted_within_400ms_and_ejected():
    sim = healthy_sim()
    t_hang = 5.05
    sim.heartbeat = moving_until(t_hang)
    sim.run_until(5.09)
    sim.probe = lambda t: None                 # one probe, timing out 50 ms after the hang
    sim.apply(ProbeObserved(K.TIMEOUT), 5.1)
    assert sim.nh.state is S.HEALTHY           # not judged yet: the next heartbeats tell
    sim.run_until(5.5)
    assert sim.nh.state is S.DEGRADED and sim.nh.probe.consecutive_failures == 1
    assert sim.nh.reason.startswith("probe failure: inference timeout (no token within 800 ms); no progress for ")
    assert sim.nh.reason.endswith("a hang, not load")
    failed = next(e for e in sim.events if e.to_state is S.DEGRADED)
    assert failed.at_s - 5.1 <= 0.4 + 1e-9
    sim.run_until(t_hang + 1.5)
    assert sim.nh.state is S.UNHEALTHY
    assert not any("busy" in e.reason or "saturated" in e.reason or "progressing" in e.reason for e in sim.events)


def test_a_saturated_engine_whose_tokens_keep_moving_is_busy_at_the_first_heartbeat_after_the_timeout():
    sim = healthy_sim()
    sim.heartbeat = moving_until(1e9)
    sim.probe = lambda t: None
    sim.run_until(5.09)
    sim.apply(ProbeObserved(K.TIMEOUT), 5.1)
    sim.run_until(5.21)
    assert sim.nh.state is S.DEGRADED and sim.nh.reason.startswith("busy: saturated, inference timeout")
    assert "after the probe timed out" in sim.nh.reason and sim.nh.probe.consecutive_failures == 0
    assert route(sim.nh, 1, CFG).weight == 30


def test_a_chunked_prefill_moving_every_460ms_is_not_called_hung_between_two_moves():
    """vLLM 0.32 with 256-token chunks moves its KV usage every ~0.46 s: the learned
    cadence (2 x 0.46 s) covers the wait for the next move."""
    sim = healthy_sim()
    sim.heartbeat = moving_until(1e9, every_s=0.46)
    sim.probe = lambda t: None
    sim.run_until(6.0)
    assert 0.4 <= (sim.nh.engine.progress_gap_s or 0) <= 0.5
    sim.apply(ProbeObserved(K.TIMEOUT), 6.0)
    sim.run_until(7.0)
    assert sim.nh.state is S.DEGRADED and sim.nh.reason.startswith("busy: saturated")
    assert sim.nh.probe.consecutive_failures == 0


@settings(max_examples=200, deadline=None)
@given(hang_before_timeout_s=st.floats(0.0, 0.75), every_s=st.sampled_from([0.02, 0.1]),
       timeout_at=st.floats(5.0, 6.0))
def test_prop_a_hang_during_the_probes_wait_never_reads_busy_and_is_ejected(hang_before_timeout_s, every_s, timeout_at):
    sim = healthy_sim()
    t_hang = timeout_at - hang_before_timeout_s
    sim.heartbeat = moving_until(t_hang, every_s=every_s)
    sim.probe = lambda t: None
    sim.run_until(timeout_at)
    sim.apply(ProbeObserved(K.TIMEOUT), timeout_at)
    sim.run_until(t_hang + 1.6)
    assert sim.nh.state is S.UNHEALTHY
    assert not any("busy" in e.reason or "progressing" in e.reason for e in sim.events)


@settings(max_examples=200, deadline=None)
@given(every_s=st.floats(0.1, 0.46), timeout_at=st.floats(5.0, 6.0))
def test_prop_an_engine_that_keeps_moving_is_busy_never_a_failure(every_s, timeout_at):
    sim = healthy_sim()
    sim.heartbeat = moving_until(1e9, every_s=every_s)
    sim.probe = lambda t: None
    sim.run_until(timeout_at)
    sim.apply(ProbeObserved(K.TIMEOUT), timeout_at)
    sim.run_until(timeout_at + 1.0)
    assert sim.nh.state is S.DEGRADED and sim.nh.reason.startswith("busy: saturated")
    assert sim.nh.probe.consecutive_failures == 0
