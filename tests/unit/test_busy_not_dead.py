"""Busy is never dead: scenarios on the pure health model, numbers in their names.

A probe that is slow or times out while the agent shows *evidence* of progress (a step counter or
the KV-cache usage of a busy instance moved within ``busy_progress_window_ms``) is "busy":
DEGRADED with a reason starting "busy:", never ejected, never through probation, and back to
full weight on the next good probe once the load eases. Without evidence (a hang) a timeout is a
failure and the node is ejected as before.
"""
from __future__ import annotations

from xds_server.config import HealthConfig
from xds_server.health.model import (
    HeartbeatObserved,
    ProbeObserved,
    route,
)
from xds_server.health.model import (
    NodeState as S,
)
from xds_server.health.model import (
    ProbeResultKind as K,
)
from xds_server.health.sim import NodeSim

CFG = HealthConfig(ramp_step_percent=50, ramp_step_s=1.0)


def healthy_sim() -> NodeSim:
    sim = NodeSim(cfg=CFG)
    sim.run_until(4.0)
    assert sim.nh.state is S.HEALTHY, sim.events
    return sim


def prefill_heartbeat(t0: float, t1: float):
    """vLLM during a 5.5 s chunked prefill (measured): 1 running, the queued probe waiting, KV
    usage rising every 100 ms sample (0.008 -> 0.086), token counters frozen; idle after it."""
    def hb(t: float) -> HeartbeatObserved:
        if t0 <= t < t1:
            kv = 0.008 + (0.086 - 0.008) * (t - t0) / (t1 - t0)
            return HeartbeatObserved(requests_running=1, requests_waiting=1, progress_age_ms=40,
                                     progress_detail=f"engine 0: vllm:kv_cache_usage_perc {kv - 0.0014:.4f} -> "
                                                     f"{kv:.4f} 0.0 s ago, 1 running, 1 waiting")
        return HeartbeatObserved(requests_running=0, requests_waiting=0)
    return hb


def test_long_prefill_5500ms_kv_rising_is_busy_never_ejected_and_full_weight_within_1s_after():
    sim = healthy_sim()
    t0, t1 = 4.05, 9.55
    sim.heartbeat = prefill_heartbeat(t0, t1)
    # probes every 0.5 s (the agent's idle cadence): each one sent during the prefill times out
    sim.probe_every_s = 0.5
    sim.probe = lambda t: ProbeObserved(K.TIMEOUT) if t0 <= t < t1 else ProbeObserved(K.OK, ttft_ms=25)
    sim.run_until(t1 - 0.01)
    assert sim.nh.state is S.DEGRADED
    assert sim.nh.reason.startswith("busy: saturated, inference timeout")
    assert "vllm:kv_cache_usage_perc" in sim.nh.reason and "tokens advancing" not in sim.nh.reason
    assert route(sim.nh, 1, CFG).weight == 30 and route(sim.nh, 1, CFG).health_status == "HEALTHY"
    sim.run_until(t1 + 1.0)
    assert not any(e.to_state in (S.UNHEALTHY, S.PROBATION) for e in sim.events if e.at_s > 4.0)
    assert sim.nh.state is S.HEALTHY and route(sim.nh, 1, CFG).weight == 100
    back = next(e for e in sim.events if e.at_s >= t1 and e.to_state is S.HEALTHY)
    assert back.at_s - t1 <= 1.0 and back.reason.startswith("load eased: 1 good probe")


def test_hang_under_load_is_not_called_busy_and_is_ejected_within_1500ms():
    """Tokens advance until t0, then nothing moves (progress age grows); the agent declares the
    stall 1 s later. A probe timing out meanwhile is a failure, never "saturated"."""
    sim = healthy_sim()
    t0 = 4.02

    def hb(t: float) -> HeartbeatObserved:
        age = max(0.0, t - t0) * 1000.0 + 30.0
        return HeartbeatObserved(requests_running=4, requests_waiting=2, stalled=t >= t0 + 1.05,
                                 stall_detail="engine 0: 4 running, tokens frozen for 1.1 s",
                                 progress_age_ms=age, progress_detail="engine 0: tokens 100 -> 140")
    sim.heartbeat = hb
    sim.probe_every_s = 0.9
    sim.probe = lambda t: ProbeObserved(K.TIMEOUT) if t >= t0 + 0.85 else ProbeObserved(K.OK, ttft_ms=30)
    sim.run_until(t0 + 1.5)
    assert sim.nh.state is S.UNHEALTHY
    eject = next(e for e in sim.events if e.to_state is S.UNHEALTHY)
    assert eject.at_s - t0 <= 1.5
    assert not any("busy" in e.reason or "saturated" in e.reason for e in sim.events)


def test_probe_1200ms_slower_than_800ms_deadline_while_tokens_advance_is_degraded_busy_for_60s():
    sim = healthy_sim()
    sim.heartbeat = lambda t: HeartbeatObserved(
        requests_running=64, requests_waiting=10, progress_age_ms=60,
        progress_detail="engine 0: vllm:generation_tokens_total+vllm:prompt_tokens_total 5000 -> 5640 0.1 s ago")
    sim.probe = lambda t: ProbeObserved(K.OK, ttft_ms=1200)
    sim.run_until(64.0)
    assert sim.nh.state is S.DEGRADED and sim.nh.reason.startswith("busy: saturated, inference timeout (TTFT 1200 ms")
    assert "5000 -> 5640" in sim.nh.reason
    assert not any(e.to_state is S.UNHEALTHY for e in sim.events)


def test_slow_probe_450ms_with_evidence_is_busy_and_recovers_on_1_good_probe():
    sim = healthy_sim()
    sim.apply(HeartbeatObserved(requests_running=8, progress_age_ms=20, progress_detail="kv 0.1 -> 0.2"), 4.45)
    sim.apply(ProbeObserved(K.OK, ttft_ms=450), 4.5)
    assert sim.nh.state is S.DEGRADED and sim.nh.reason.startswith("busy: saturated, probe TTFT 450 ms")
    sim.apply(ProbeObserved(K.OK, ttft_ms=40), 5.5)
    assert sim.nh.state is S.HEALTHY and route(sim.nh, 1, CFG).weight == 100


def test_429_then_load_eases_full_weight_on_the_next_good_probe_without_probation():
    sim = healthy_sim()
    sim.apply(ProbeObserved(K.HTTP_STATUS, http_status=429), 4.5)
    assert sim.nh.state is S.DEGRADED and sim.nh.reason.startswith("busy: saturated, the engine refuses work (HTTP 429")
    sim.apply(ProbeObserved(K.OK, ttft_ms=35), 5.0)
    assert sim.nh.state is S.HEALTHY and route(sim.nh, 1, CFG).weight == 100
    assert not any(e.to_state is S.PROBATION for e in sim.events if e.at_s > 4.0)


def test_a_counted_failure_still_needs_3_good_probes():
    sim = healthy_sim()
    sim.apply(ProbeObserved(K.TIMEOUT), 4.5)  # idle engine, no evidence: a failure
    assert sim.nh.state is S.DEGRADED and sim.nh.reason.startswith("probe failure")
    for t in (5.0, 5.5):
        sim.apply(ProbeObserved(K.OK, ttft_ms=30), t)
        assert sim.nh.state is S.DEGRADED
    sim.apply(ProbeObserved(K.OK, ttft_ms=30), 6.0)
    assert sim.nh.state is S.HEALTHY and sim.nh.reason.startswith("3 consecutive good probes")


def test_gpu_lost_while_warming_first_good_probe_does_not_route_at_1pct():
    sim = NodeSim(cfg=CFG, heartbeat=lambda t: HeartbeatObserved(engine_state="WARMING", gpu_fatal="GPU lost (Xid 79)"),
                  probe=lambda t: ProbeObserved(K.OK, ttft_ms=30))
    sim.run_until(3.0)
    assert sim.nh.state is S.WARMING and route(sim.nh, 1, CFG).health_status == "UNHEALTHY"
    assert "Xid 79" in sim.nh.reason and "not routed while warming" in sim.nh.reason
    assert not any(e.to_state is S.PROBATION for e in sim.events)


def test_a_probe_queued_behind_the_prefill_answered_300ms_late_after_it_keeps_1_probe_recovery():
    """The probe sent 0.3 s before a prefill ends gets its token when it ends (TTFT 300 ms, slow),
    when the agent may already show no load: the node stays DEGRADED busy and the next good
    probe returns it to full weight."""
    sim = healthy_sim()
    sim.apply(HeartbeatObserved(requests_running=1, requests_waiting=1, progress_age_ms=30,
                                progress_detail="engine 0: vllm:kv_cache_usage_perc 0.08 -> 0.0814 0.0 s ago"), 4.45)
    sim.apply(ProbeObserved(K.TIMEOUT), 4.5)
    sim.apply(HeartbeatObserved(requests_running=1, requests_waiting=1, progress_age_ms=30,
                                progress_detail="engine 0: vllm:kv_cache_usage_perc 0.0814 -> 0.0828 0.0 s ago"), 4.6)
    assert sim.nh.state is S.DEGRADED and sim.nh.reason.startswith("busy:")  # moved after the timeout
    sim.apply(HeartbeatObserved(requests_running=0, requests_waiting=0), 9.55)
    sim.apply(ProbeObserved(K.OK, ttft_ms=300), 9.56)
    assert sim.nh.state is S.DEGRADED
    sim.apply(ProbeObserved(K.OK, ttft_ms=25), 10.06)
    assert sim.nh.state is S.HEALTHY and route(sim.nh, 1, CFG).weight == 100


# -- a reason never says "progressing" about progress older than the probe's wait -------------------


def _busy_heartbeat(age_ms: float) -> HeartbeatObserved:
    return HeartbeatObserved(requests_running=4, requests_waiting=2, progress_age_ms=age_ms,
                             progress_detail="engine 0: tokens 100 -> 140")


def test_timeout_with_progress_900ms_old_older_than_the_800ms_wait_is_a_failure_never_busy():
    """The engine hung 0.9 s ago, before the probe was sent: nothing moved while it waited."""
    sim = healthy_sim()
    sim.apply(_busy_heartbeat(850), 4.45)
    sim.apply(ProbeObserved(K.TIMEOUT), 4.5)
    assert sim.nh.state is S.DEGRADED and sim.nh.reason.startswith("probe failure: inference timeout")
    assert "busy" not in sim.nh.reason and "progress" not in sim.nh.reason
    assert sim.nh.probe.consecutive_failures == 1


def test_timeout_with_progress_700ms_old_within_the_800ms_wait_is_busy_once_progress_moves_after_it():
    """The timeout alone says nothing yet (progress moved during the wait, maybe
    just before a hang); the next heartbeat showing a move after the timeout makes it busy."""
    sim = healthy_sim()
    sim.apply(_busy_heartbeat(650), 4.45)
    sim.apply(ProbeObserved(K.TIMEOUT), 4.5)
    assert sim.nh.state is S.HEALTHY and sim.nh.probe.busy_timeout_s == 4.5   # not judged yet
    sim.apply(_busy_heartbeat(20), 4.6)
    assert sim.nh.state is S.DEGRADED
    assert sim.nh.reason == ("busy: saturated, inference timeout (no token within 800 ms); progressing: moved 0.0 s "
                             "ago, after the probe timed out: engine 0: tokens 100 -> 140")
    assert sim.nh.probe.consecutive_failures == 0 and sim.nh.probe.busy_timeout_s is None


def test_slow_probe_450ms_with_progress_600ms_old_is_slow_not_busy():
    sim = healthy_sim()
    sim.apply(_busy_heartbeat(550), 4.45)
    sim.apply(ProbeObserved(K.OK, ttft_ms=450), 4.5)
    assert sim.nh.state is S.DEGRADED and sim.nh.reason == "probe TTFT 450 ms >= 200 ms"
    assert sim.nh.probe.degraded_not_busy   # unexplained slowness: 3 good probes to recover


def test_503_with_progress_500ms_old_is_busy_and_gives_the_age_never_progressing():
    sim = healthy_sim()
    sim.apply(_busy_heartbeat(450), 4.45)
    sim.apply(ProbeObserved(K.HTTP_STATUS, http_status=503), 4.5)
    assert sim.nh.reason == "busy: saturated, HTTP 503; last progress 0.5 s ago: engine 0: tokens 100 -> 140"
    assert "progressing" not in sim.nh.reason


# -- hang detection: the stall's confirmation is measured from the freeze ----------------------------


def _hung_after(t_last: float, report_after_s: float, age_before_ms: float = 0.0) -> NodeSim:
    """A HEALTHY node whose tokens last moved at ``t_last`` (the agent's evidence ages from then,
    plus ``age_before_ms``); the agent's STALLED report arrives ``report_after_s`` later (its 1 s
    window, a scrape and a heartbeat interval). No probes."""
    def hb(t: float) -> HeartbeatObserved:
        age = max(0.0, t - t_last) * 1000.0 + age_before_ms
        return HeartbeatObserved(requests_running=4, stalled=t >= t_last + report_after_s,
                                 stall_detail="engine 0: 4 running, tokens frozen", progress_age_ms=age,
                                 progress_detail="engine 0: tokens 100 -> 140")
    sim = healthy_sim()
    sim.heartbeat, sim.probe = hb, (lambda t: None)
    return sim


def test_hang_reported_1200ms_after_the_last_progress_is_ejected_at_1300ms_not_1500ms():
    sim = _hung_after(4.02, 1.2)
    sim.run_until(4.02 + 1.6)
    eject = next(e for e in sim.events if e.to_state is S.UNHEALTHY)
    assert abs(eject.at_s - (4.02 + 1.3)) < 0.005, eject
    assert "engine still STALLED: no progress for 1.30 s (stall window 1000 ms + 300 ms)" in eject.reason


def test_hang_reported_1050ms_after_progress_still_needs_1300ms_of_freeze():
    sim = _hung_after(4.02, 1.05)
    sim.run_until(4.02 + 1.29)
    assert sim.nh.state is S.DEGRADED and "STALLED" in sim.nh.reason
    sim.run_until(4.02 + 1.31)
    assert sim.nh.state is S.UNHEALTHY


def test_stall_of_a_request_at_an_engine_idle_for_5s_is_confirmed_300ms_after_the_report():
    """Progress 5 s old at the first report is the idle time before the request, not this
    freeze: the report's own time decides (the first report at t 4.02 + 1.1)."""
    t_req = 4.02
    sim = _hung_after(t_req, 1.1, age_before_ms=5000.0)
    sim.run_until(t_req + 1.35)
    assert sim.nh.state is S.DEGRADED
    sim.run_until(t_req + 1.6)
    eject = next(e for e in sim.events if e.to_state is S.UNHEALTHY)
    assert "engine still STALLED 300 ms later" in eject.reason
    report = next(e for e in sim.events if e.to_state is S.DEGRADED and e.at_s > 4.0)
    assert abs(eject.at_s - report.at_s - 0.3) < 0.005
