"""What keeps an UNHEALTHY node out of PROBATION, said: the half-open rule fires exactly when the
list is empty, and /nodes shows the list (an operator sees the RTT baseline or the engine state
that holds a node, not only a clean period that seems met)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import HealthConfig
from xds_server.health.model import (
    EjectionCause,
    Engine,
    EngineState,
    Heartbeats,
    NodeHealth,
    NodeState,
    Tick,
    clean_period_unmet,
    step,
)
from xds_server.health.records import Ejection, Probes, Rtt
from xds_server.health.time_rules import clean_period_met

CFG = HealthConfig(probation={"clean": "1s", "min_probes": 3})


def _out(**kw) -> NodeHealth:
    base = {"probe": Probes(clean_since_s=0.0, clean_probes=4), "heartbeat": Heartbeats(last_s=9.95),
            "rtt": Rtt(ewma_ms=2.0, baseline_ms=2.0), "engine": Engine(state=EngineState.READY),
            "ejection": Ejection(cause=EjectionCause.PROBE, from_state=NodeState.HEALTHY)}
    return NodeHealth(node_id="n", state=NodeState.UNHEALTHY, **{**base, **kw})


def test_each_condition_is_named_with_its_numbers():
    assert list(clean_period_unmet(_out(), CFG, 10.0)) == []
    assert list(clean_period_unmet(_out(probe=Probes(clean_since_s=8.5, clean_probes=4),
                                        rtt=Rtt(ewma_ms=9.0, baseline_ms=2.0)), CFG, 10.0)) == [
        "EWMA RTT 9.0 ms above its baseline 2.0 ms x 1.5 + 1 ms (it holds the node 0.5 s more at most)"]
    assert list(clean_period_unmet(_out(engine=Engine(state=EngineState.WARMING)), CFG, 10.0)) == ["engine WARMING"]
    assert list(clean_period_unmet(_out(probe=Probes(clean_since_s=9.5, clean_probes=1)), CFG, 10.0)) == [
        "probes clean for 0.5 of 1 s", "1 of 3 good probes"]
    assert list(clean_period_unmet(_out(probe=Probes()), CFG, 10.0)) == [
        "no good probe since the last failure (1 s of them needed)", "0 of 3 good probes"]
    suspected = _out(ejection=Ejection(cause=EjectionCause.TRANSPORT, from_state=NodeState.HEALTHY))
    assert list(clean_period_unmet(suspected, CFG, 10.0)) == [
        "a transport suspicion: back as it was at its next heartbeat, or proven by 3 consecutive misses"]


def test_an_rtt_above_its_baseline_holds_a_clean_node_at_most_baseline_wait_periods_more():
    """A baseline learned while the host was idle must not keep a recovered node out for good once
    the host is busy: past (1 + rtt.baseline_wait_periods) clean periods the node enters PROBATION with
    its RTT as it is, and the reason says so."""
    nh = _out(probe=Probes(clean_since_s=0.0, clean_probes=40), rtt=Rtt(ewma_ms=4.6, baseline_ms=1.9))
    assert not clean_period_met(nh, CFG, 1.99)  # clean 1 s, held 1 s more (baseline_wait_periods 1)
    assert clean_period_met(nh, CFG, 2.0) and list(clean_period_unmet(nh, CFG, 2.0)) == []
    after, events = step(nh, Tick(), 2.0, CFG)
    assert after.state is NodeState.PROBATION
    assert "EWMA RTT 4.6 ms, still above its baseline 1.9 ms: admitted" in events[-1].reason
    doubled = _out(probe=Probes(clean_since_s=0.0, clean_probes=40), rtt=Rtt(ewma_ms=4.6, baseline_ms=1.9),
                   ejection=Ejection(cause=EjectionCause.PROBE, from_state=NodeState.PROBATION, clean_period_s=4.0))
    assert not clean_period_met(doubled, CFG, 7.9) and clean_period_met(doubled, CFG, 8.0)  # 4 s x (1 + 1)
    never = HealthConfig(probation={"clean": "1s", "min_probes": 3}, rtt={"baseline_wait_periods": 0})
    assert clean_period_met(nh, never, 1.0)  # 0: the RTT never holds a clean node
    patient = HealthConfig(probation={"clean": "1s", "min_probes": 3}, rtt={"baseline_wait_periods": 9})
    assert not clean_period_met(nh, patient, 9.9) and clean_period_met(nh, patient, 10.0)
    back = _out(probe=Probes(clean_since_s=0.0, clean_probes=40), rtt=Rtt(ewma_ms=3.0, baseline_ms=1.9))
    assert clean_period_met(back, CFG, 1.0)  # back under 1.9 x 1.5 + 1 ms: no wait at all


@settings(max_examples=300, deadline=None)
@given(since=st.none() | st.floats(0, 10), probes=st.integers(0, 5), misses=st.integers(0, 4),
       ewma=st.floats(0.1, 20), engine=st.sampled_from(EngineState),
       cause=st.sampled_from([EjectionCause.PROBE, EjectionCause.HEARTBEAT, EjectionCause.PHI,
                              EjectionCause.TRANSPORT]),
       wait_periods=st.sampled_from([0.0, 1.0, 4.5, 20.0]))
def test_probation_is_entered_exactly_when_nothing_is_unmet(since, probes, misses, ewma, engine, cause, wait_periods):
    cfg = HealthConfig(probation={"clean": "1s", "min_probes": 3}, rtt={"baseline_wait_periods": wait_periods})
    nh = _out(probe=Probes(clean_since_s=since, clean_probes=probes),
              heartbeat=Heartbeats(last_s=9.95, consecutive_misses=misses), rtt=Rtt(ewma_ms=ewma, baseline_ms=2.0),
              engine=Engine(state=engine), ejection=Ejection(cause=cause, from_state=NodeState.HEALTHY))
    unmet = list(clean_period_unmet(nh, cfg, 10.0))
    assert clean_period_met(nh, cfg, 10.0) == (not unmet), unmet  # the rule's checks, said in words
    after, _ = step(nh, Tick(), 10.0, cfg)
    assert (after.state is NodeState.PROBATION) == (not unmet), unmet
