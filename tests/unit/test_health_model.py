"""The first health model: seed scenarios as tables, plus hypothesis properties."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import HealthConfig
from xds_server.health.model import (
    EngineFatalKind as K,
    HeartbeatObserved,
    NodeState as S,
    PingObserved,
    ProbeObserved,
    StreamClosed,
    Tick,
    initial,
    misses_at,
    route,
    step,
)

CFG = HealthConfig()


def run(events, cfg=CFG, node="n1"):
    """Apply (t_s, observation) pairs; return final health and all transition events."""
    nh = initial(node, 0.0)
    out = []
    for t, obs in events:
        nh, evs = step(nh, obs, t, cfg)
        out.extend(evs)
    return nh, out


def healthy_at(t0=0.0):
    """Heartbeats every 100 ms for 0.5 s plus one good probe -> HEALTHY."""
    evs = [(t0 + i * 0.1, HeartbeatObserved()) for i in range(5)]
    evs.append((t0 + 0.45, ProbeObserved(K.OK, ttft_ms=20)))
    return evs


def test_cold_until_heartbeat_and_good_probe():
    nh, evs = run([(0.0, ProbeObserved(K.OK, ttft_ms=20))])
    assert nh.state is S.COLD  # no heartbeat yet
    nh, evs = run(healthy_at())
    assert nh.state is S.HEALTHY and [(e.from_state, e.to_state) for e in evs] == [(S.COLD, S.HEALTHY)]


def test_cold_failures_are_not_counted():
    nh, _ = run([(0.0, HeartbeatObserved()), (0.1, ProbeObserved(K.TIMEOUT)),
                 (0.2, ProbeObserved(K.TIMEOUT)), (0.3, ProbeObserved(K.ENGINE_FATAL))])
    assert nh.state is S.COLD and nh.consecutive_probe_failures == 0


def test_misses_counted_at_interval_plus_grace():
    # seed 000: interval 100 ms, grace 80 ms -> misses at +180, +280, +380 ms
    assert [misses_at(0.0, t, CFG) for t in (0.179, 0.180, 0.279, 0.280, 0.380)] == [0, 1, 1, 2, 3]


def test_three_missed_heartbeats_eject_within_300ms_of_fault():
    base = healthy_at()
    last_hb = 0.4
    ticks = [(last_hb + 0.18 + 0.1 * i, Tick()) for i in range(3)]
    nh, evs = run(base + ticks)
    assert nh.state is S.UNHEALTHY
    ej = evs[-1]
    assert ej.to_state is S.UNHEALTHY and "3 consecutive misses" in ej.reason
    # fault right after the last heartbeat: ejected 380 ms after the last heartbeat,
    # i.e. within 300 ms of the first heartbeat that failed to arrive (at +100 ms)
    assert abs(ej.at_s - last_hb - 0.38) < 1e-9
    assert route(nh, 1, CFG).health_status == "UNHEALTHY"


def test_two_misses_do_not_eject():
    nh, _ = run(healthy_at() + [(0.58, Tick()), (0.68, Tick())])
    assert nh.state is S.HEALTHY and nh.consecutive_misses == 2


def test_stream_closed_counts_as_a_miss_at_once():
    nh, _ = run(healthy_at() + [(0.41, StreamClosed("UNAVAILABLE"))])
    assert nh.consecutive_misses == 1 and nh.state is S.HEALTHY
    # closed (1) + misses at +180 ms (2) and +280 ms (3): ejected 100 ms earlier than silence alone
    nh, evs = run(healthy_at() + [(0.41, StreamClosed("x")), (0.58, Tick()), (0.68, Tick())])
    assert nh.state is S.UNHEALTHY and "3 consecutive misses" in evs[-1].reason


def test_heartbeat_recovery_needs_good_probes():
    evs = healthy_at() + [(0.58, Tick()), (0.68, Tick()), (0.78, Tick())]
    evs += [(1.0 + 0.1 * i, HeartbeatObserved()) for i in range(3)]
    nh, _ = run(evs)
    assert nh.state is S.UNHEALTHY and "waiting for good probes" in nh.reason
    evs += [(1.3 + i, ProbeObserved(K.OK, ttft_ms=30)) for i in range(2)]
    assert run(evs)[0].state is S.UNHEALTHY
    evs += [(1.3 + 2, HeartbeatObserved()), (3.35, ProbeObserved(K.OK, ttft_ms=30))]
    nh, trans = run(evs)
    assert nh.state is S.HEALTHY and "3 consecutive good probes" in trans[-1].reason


def test_fc06_hung_inference_two_probe_timeouts_eject_and_health_200_does_not_reset():
    evs = healthy_at()
    evs += [(1.0, ProbeObserved(K.TIMEOUT)), (1.05, HeartbeatObserved()), (2.0, ProbeObserved(K.TIMEOUT))]
    nh, trans = run(evs)
    assert [t.to_state for t in trans] == [S.HEALTHY, S.DEGRADED, S.UNHEALTHY]
    assert "inference timeout" in trans[-1].reason and "2 consecutive failures" in trans[-1].reason
    # Heartbeats (and the engine's /health) keep arriving: they do not heal it.
    nh, _ = run(evs + [(2.1 + 0.1 * i, HeartbeatObserved()) for i in range(20)])
    assert nh.state is S.UNHEALTHY


def test_one_engine_fatal_ejects_at_once():
    nh, trans = run(healthy_at() + [(1.0, ProbeObserved(K.ENGINE_FATAL, detail="CUDA error: illegal memory access"))])
    assert nh.state is S.UNHEALTHY and "engine fatal error" in trans[-1].reason and "CUDA" in trans[-1].reason


def test_ttft_tiers():
    slow, _ = run(healthy_at() + [(1.0, ProbeObserved(K.OK, ttft_ms=450))])
    assert slow.state is S.DEGRADED
    assert route(slow, 1, CFG).weight == 30 and route(slow, 1, CFG).health_status == "HEALTHY"
    over, _ = run(healthy_at() + [(1.0, ProbeObserved(K.OK, ttft_ms=900)), (2.0, ProbeObserved(K.OK, ttft_ms=950))])
    assert over.state is S.UNHEALTHY  # > 800 ms counts as a timeout
    fast, _ = run(healthy_at() + [(1.0, ProbeObserved(K.OK, ttft_ms=199))])
    assert fast.state is S.HEALTHY and route(fast, 2, CFG) == route(fast, 2, CFG) and route(fast, 2, CFG).weight == 200


def test_degraded_back_to_healthy_after_three_good_probes():
    evs = healthy_at() + [(1.0, ProbeObserved(K.OK, ttft_ms=500))]
    evs += [(1.0 + 0.1 * i, HeartbeatObserved()) for i in range(1, 40)]
    evs += [(1.5, ProbeObserved(K.OK, ttft_ms=50)), (2.5, ProbeObserved(K.OK, ttft_ms=50))]
    assert run(sorted(evs, key=lambda e: e[0]))[0].state is S.DEGRADED
    evs += [(3.5, ProbeObserved(K.OK, ttft_ms=50))]
    assert run(sorted(evs, key=lambda e: e[0]))[0].state is S.HEALTHY


def test_agent_reports_engine_failed():
    nh, trans = run(healthy_at() + [(1.0, HeartbeatObserved(engine_state="FAILED"))])
    assert nh.state is S.UNHEALTHY and trans[-1].reason == "agent reports engine FAILED"


def test_rtt_ewma_alpha_02():
    nh, _ = run([(0.0, PingObserved(10.0)), (1.0, PingObserved(20.0))])
    assert nh.ewma_rtt_ms == 10.0 * 0.8 + 20.0 * 0.2 and nh.last_rtt_ms == 20.0


# ---- properties ------------------------------------------------------------------------------

obs_strategy = st.one_of(
    st.just(HeartbeatObserved()),
    st.just(HeartbeatObserved(engine_state="FAILED")),
    st.just(Tick()),
    st.builds(StreamClosed, st.just("x")),
    st.builds(PingObserved, st.floats(0, 5000)),
    st.builds(ProbeObserved, st.sampled_from(list(K)), st.floats(0, 5000)),
)
timeline = st.lists(st.tuples(st.floats(0.0, 0.5), obs_strategy), max_size=80)


def _apply(items, capacity=1):
    nh = initial("p", 0.0)
    t = 0.0
    weights = []
    trans = []
    for dt, obs in items:
        t += dt
        nh, evs = step(nh, obs, t, CFG)
        trans.extend(evs)
        weights.append(route(nh, capacity, CFG))
    return nh, trans, weights


@settings(max_examples=300, deadline=None)
@given(timeline, st.integers(1, 10_000))
def test_prop_weights_integer_ge_1_and_status_valid(items, capacity):
    _, _, routes = _apply(items, capacity)
    for r in routes:
        assert isinstance(r.weight, int) and 1 <= r.weight <= capacity * 100
        assert r.health_status in ("HEALTHY", "UNHEALTHY", "DRAINING")


@settings(max_examples=300, deadline=None)
@given(timeline)
def test_prop_deterministic(items):
    assert _apply(items)[:2] == _apply(items)[:2]


@settings(max_examples=300, deadline=None)
@given(timeline)
def test_prop_transitions_are_real_and_chained(items):
    _, trans, _ = _apply(items)
    prev = S.COLD
    for e in trans:
        assert e.from_state is prev and e.to_state is not e.from_state and e.reason
        prev = e.to_state


@settings(max_examples=200, deadline=None)
@given(timeline)
def test_prop_never_healthy_right_after_engine_fatal(items):
    """After an ENGINE_FATAL while routed, HEALTHY needs good_probes_to_recover good probes."""
    nh = initial("p", 0.0)
    t = 0.0
    good_since_fatal = None
    for dt, obs in items:
        t += dt
        before = nh.state
        nh, _ = step(nh, obs, t, CFG)
        if isinstance(obs, ProbeObserved) and obs.kind is K.ENGINE_FATAL and before not in (S.COLD,):
            good_since_fatal = 0
        elif isinstance(obs, ProbeObserved) and obs.kind is K.OK and obs.ttft_ms < CFG.ttft_healthy_ms:
            if good_since_fatal is not None:
                good_since_fatal += 1
        elif isinstance(obs, ProbeObserved) and good_since_fatal is not None:
            good_since_fatal = 0
        if good_since_fatal is not None and nh.state is S.HEALTHY:
            assert good_since_fatal >= CFG.good_probes_to_recover
            good_since_fatal = None
