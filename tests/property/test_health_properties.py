"""Hypothesis properties of the health model and cluster policy."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import HealthConfig
from xds_server.health.model import (
    DrainRequested,
    Engine,
    HeartbeatObserved,
    Heartbeats,
    NodeHealth,
    PingObserved,
    ProbeObserved,
    Probes,
    Ramp,
    Rtt,
    StreamClosed,
    Tick,
    initial,
    next_check_s,
    route,
    step,
)
from xds_server.health.model import (
    NodeState as S,
)
from xds_server.health.model import (
    ProbeResultKind as K,
)
from xds_server.health.sim import NodeSim
from xds_server.policy.cluster_routing import cluster_routing

CFG = HealthConfig(probation_clean_s=5.0, probation_clean_max_s=40.0, ramp_step_percent=10.0, ramp_step_s=0.5)

heartbeat = st.builds(
    HeartbeatObserved,
    engine_state=st.sampled_from(["READY", "READY", "READY", "WARMING", "FAILED", "COLD"]),
    stalled=st.booleans(),
    requests_running=st.one_of(st.none(), st.floats(0, 500)),
    requests_waiting=st.one_of(st.none(), st.floats(0, 500)),
    gpu_free_ratio=st.one_of(st.none(), st.floats(0, 1)),
    gpu_fatal=st.sampled_from(["", "", "", "GPU 0 Xid 79"]),
    vouched=st.sampled_from([False] * 3 + [True]),
)
probe = st.builds(ProbeObserved, st.sampled_from(list(K)), st.floats(0, 3000),
                  st.sampled_from([0, 200, 429, 500, 503]))
observation = st.one_of(
    heartbeat, heartbeat, heartbeat, probe, probe, st.just(Tick()), st.builds(StreamClosed, st.just("x")),
    st.builds(PingObserved, st.floats(0, 500)), st.builds(DrainRequested, st.booleans()),
)
timeline = st.lists(st.tuples(st.floats(0.0, 3.0), observation), max_size=120)


def play(items, cfg=CFG):
    """Apply a timeline, inserting the Ticks the model asks for (as a probe session would)."""
    nh = initial("p", 0.0)
    t = 0.0
    out = []  # (t, nh, events, obs)
    for dt, obs in items:
        target = t + dt
        while True:
            due = next_check_s(nh, cfg)
            if due is None or due > target or due <= t:
                break
            t = due
            nh, evs = step(nh, Tick(), t, cfg)
            out.append((t, nh, evs, Tick()))
        t = target
        nh, evs = step(nh, obs, t, cfg)
        out.append((t, nh, evs, obs))
    return out


@settings(max_examples=300, deadline=None)
@given(timeline, st.integers(1, 10_000))
def test_prop_weights_are_integers_ge_1(items, capacity):
    for _, nh, _, _ in play(items):
        r = route(nh, capacity, CFG)
        assert isinstance(r.weight, int) and 1 <= r.weight <= capacity * 100
        assert r.health_status in ("HEALTHY", "UNHEALTHY", "DRAINING")


@settings(max_examples=300, deadline=None)
@given(timeline)
def test_prop_same_inputs_same_outputs(items):
    assert play(items) == play(items)


@settings(max_examples=300, deadline=None)
@given(timeline)
def test_prop_transitions_chain_and_have_reasons(items):
    prev = S.COLD
    for _, _, evs, obs in play(items):
        for e in evs:
            if isinstance(obs, DrainRequested):
                continue  # drain events show the override, not the health state machine
            assert e.from_state is prev and e.reason
            if e.to_state is e.from_state:  # the one event that is no move: "cannot warm"
                assert e.from_state in (S.COLD, S.WARMING) and e.reason.startswith("cannot warm: ")
            prev = e.to_state


@settings(max_examples=300, deadline=None)
@given(timeline)
def test_prop_never_healthy_after_engine_fatal_before_a_complete_probation(items):
    must_ramp = False
    for _, _nh, evs, _obs in play(items):
        for e in evs:
            if e.to_state is S.UNHEALTHY and ("engine fatal" in e.reason or "engine FAILED" in e.reason):
                must_ramp = True
            if e.to_state is S.HEALTHY and must_ramp:
                assert e.from_state is S.PROBATION and e.reason == "ramp complete (100 %)"
                must_ramp = False


@settings(max_examples=300, deadline=None)
@given(timeline)
def test_prop_ramp_only_goes_up_in_probation_and_restarts_after_failure(items):
    prev_state, prev_pct = S.COLD, 0.0
    for _, nh, evs, obs in play(items):
        if isinstance(obs, DrainRequested):  # the overlay's events (DRAINING <-> the state): the ramp
            evs = []                          # went on under it, as the state does (health/model.py)
        if nh.state is S.PROBATION:
            if prev_state is S.PROBATION and not any(e.to_state is S.PROBATION for e in evs):
                assert nh.ramp.percent >= prev_pct
            elif any(e.to_state is S.PROBATION for e in evs):
                assert nh.ramp.percent == CFG.probation.ramp_start_percent  # every probation starts at 1 %
        if any(e.from_state is S.PROBATION and e.to_state is S.UNHEALTHY for e in evs):
            assert nh.ramp.percent == 0.0
        prev_state, prev_pct = nh.state, nh.ramp.percent


@settings(max_examples=50, deadline=None)
@given(st.floats(0.5, 50.0), st.floats(0.0, 799.0), st.floats(0.1, 2.0))
def test_prop_entering_probation_from_warming_starts_at_ramp_start(start_pct, ttft_ms, probe_every_s):
    cfg = HealthConfig(ramp_start_percent=start_pct, ramp_step_s=60.0)
    sim = NodeSim(cfg=cfg, probe=lambda t: ProbeObserved(K.OK, ttft_ms=ttft_ms), probe_every_s=probe_every_s)
    sim.run_until(probe_every_s)  # first probe at half the period: good or slow, both start the ramp
    assert [e.to_state for e in sim.events] == [S.WARMING, S.PROBATION]
    assert sim.nh.ramp.percent == start_pct and abs(route(sim.nh, 1, cfg).weight - max(1.0, start_pct)) <= 0.5 + 1e-9


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 1), st.sampled_from([0.3, 1.0, 2.0]))
def test_prop_alternating_good_and_bad_probes_cause_bounded_transitions_per_minute(phase, period):
    """Alternating good/bad probes for 10 minutes: at most a few transitions per minute (no flapping).

    ``phase`` 0 starts with a bad probe, 1 with a good one; the probe sequence depends on nothing
    else, so the six (phase, period) pairs are every distinct input.
    """
    def probe(t):
        k = int(t / period) + phase
        return ProbeObserved(K.OK, ttft_ms=20) if k % 2 else ProbeObserved(K.TIMEOUT)

    sim = NodeSim(cfg=HealthConfig(), probe=probe, probe_every_s=period)
    sim.run_until(600.0)
    per_minute = {}
    for e in sim.events:
        per_minute[int(e.at_s // 60)] = per_minute.get(int(e.at_s // 60), 0) + 1
    assert max(per_minute.values()) <= 4, per_minute


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.05, 0.6), min_size=50, max_size=300))
def test_prop_jittery_heartbeats_are_not_a_flapping_source(gaps):
    """Random heartbeat gaps (50-600 ms): phi suspicions are bounded per minute."""
    nh = initial("j", 0.0)
    cfg = HealthConfig()
    t = 0.0
    nh, _ = step(nh, HeartbeatObserved(), t, cfg)
    nh, _ = step(nh, ProbeObserved(K.OK, ttft_ms=10), t, cfg)
    disproved = []
    for g in gaps:
        target = t + g
        while (due := next_check_s(nh, cfg)) is not None and t < due <= target:
            t = due
            nh, evs = step(nh, Tick(), t, cfg)
        t = target
        nh, evs = step(nh, HeartbeatObserved(), t, cfg)
        disproved += [e.at_s for e in evs if "disproved" in e.reason]
    for _i, at in enumerate(disproved):
        assert sum(1 for x in disproved if at - 60 < x <= at) <= cfg.phi.max_suspicions


node_health = st.builds(
    lambda state, rtt, ttft, free, waiting: NodeHealth(
        node_id="x", state=state, rtt=Rtt(ewma_ms=rtt, samples=0 if rtt is None else 5),
        probe=Probes(ewma_ttft_ms=ttft),
        engine=Engine(gpu_free_ratio=free, requests_waiting=waiting), ramp=Ramp(percent=37.0),
        heartbeat=Heartbeats(last_s=0.0)),
    st.sampled_from(list(S)), st.one_of(st.none(), st.floats(0, 1000)), st.one_of(st.none(), st.floats(0, 3000)),
    st.one_of(st.none(), st.floats(0, 1)), st.one_of(st.none(), st.floats(0, 300)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(node_health, st.integers(1, 2**31)), min_size=1, max_size=40),
       st.floats(0, 100))
def test_prop_cluster_policy_weights_valid_and_soft_ejections_capped(nodes, pct):
    cfg = HealthConfig(max_ejection_percent=pct)
    items = [(f"n{i}", cap, replace(nh, node_id=f"n{i}")) for i, (nh, cap) in enumerate(nodes)]
    d = cluster_routing(items, {}, 100.0, cfg)
    assert set(d.routing) == {nid for nid, _, _ in items}
    for nid, _cap, _nh in items:
        r = d.routing[nid]
        assert isinstance(r.weight, int) and r.weight >= 1
    hard = sum(1 for _, _, nh in items if nh.state is S.UNHEALTHY)
    ejected = sum(1 for nid, _, nh in items if d.routing[nid].health_status == "UNHEALTHY"
                  and nh.state in (S.HEALTHY, S.DEGRADED, S.PROBATION))
    cap = int(len(items) * pct / 100.0 + 1e-9)
    assert ejected <= max(0, cap - hard)
    assert d == cluster_routing(items, {}, 100.0, cfg)  # deterministic
