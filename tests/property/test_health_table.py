"""The health transition table, h2-style: every (state, signal) pair from arbitrary start records.

Pairs in the table reach the table's next state (PREVIOUS: the state before the ejection) with
the entry bookkeeping every transition owes; pairs not in it raise InvalidTransition.
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import HealthConfig
from xds_server.health import model
from xds_server.health.clocks import required_clean_s
from xds_server.health.phi import ArrivalStats
from xds_server.health.records import (
    MACHINE_STATES,
    ROUTED_STATES,
    Drain,
    Ejection,
    EjectionCause,
    Engine,
    EngineState,
    Heartbeats,
    NodeHealth,
    NodeState,
    ProbeResultKind,
    Probes,
    Ramp,
    Rtt,
)
from xds_server.health.transitions import PREVIOUS, TABLE, Ctx, Fired, InvalidTransition, Signal, apply, render_diagram

CFG = HealthConfig()
NOW = 500.0

opt_t = st.one_of(st.none(), st.floats(0, 1000))
opt_ms = st.one_of(st.none(), st.floats(0, 5000))
opt_n = st.one_of(st.none(), st.floats(0, 500))
records = st.fixed_dictionaries({
    "reason": st.text(max_size=10),
    "since_s": st.floats(0, 1000),
    "heartbeat": st.builds(
        Heartbeats, opt_t, st.integers(0, 10), st.booleans(),
        st.one_of(st.none(), st.builds(ArrivalStats, st.floats(1, 1000), st.floats(0, 1e4), st.integers(0, 50))),
        st.lists(st.floats(0, 1000), max_size=8).map(tuple)),
    "rtt": st.builds(Rtt, opt_ms, opt_ms, opt_ms),
    "probe": st.builds(Probes, st.integers(0, 5), st.integers(0, 5), opt_ms, opt_ms,
                       st.one_of(st.none(), st.sampled_from(list(ProbeResultKind))), st.integers(0, 100), opt_t,
                       st.integers(0, 10), st.booleans(), opt_t, opt_t, st.integers(0, 40),
                       st.sampled_from([0, 429])),
    "engine": st.builds(Engine, st.sampled_from(list(EngineState)), st.booleans(), opt_t, st.integers(0, 2), opt_n,
                        opt_n, st.one_of(st.none(), st.floats(0, 1)), st.sampled_from(["", "GPU 0 Xid 79"])),
    "ejection": st.builds(Ejection, st.one_of(st.none(), st.sampled_from(list(EjectionCause))),
                          st.one_of(st.none(), st.sampled_from(list(NodeState))), st.floats(0, 600), opt_t, opt_t,
                          st.floats(0, 1000)),
    "ramp": st.builds(Ramp, st.floats(0, 100), opt_t),
    "drain": st.builds(Drain, st.booleans(), opt_t),
})
PAIRS = list(itertools.product(MACHINE_STATES, list(Signal)))


@pytest.mark.parametrize(("state", "signal"), PAIRS, ids=[f"{s.value}-{g.name}" for s, g in PAIRS])
@settings(max_examples=12, deadline=None)
@given(rec=records, detail=st.text(min_size=1, max_size=20), arg=st.integers(0, 5))
def test_prop_every_state_signal_pair_reaches_the_table_next_state_or_raises(state, signal, rec, detail, arg):
    nh = NodeHealth(node_id="n", state=state, **rec)
    ctx = Ctx(NOW, CFG, [])
    fired = Fired(signal, detail, float(arg))
    t = TABLE.get((state, signal))
    if t is None:
        with pytest.raises(InvalidTransition) as err:
            apply(nh, fired, ctx)
        assert err.value.state is state and err.value.signal is signal
        return
    expected = nh.ejection.from_state if t.next is PREVIOUS else t.next
    if expected not in MACHINE_STATES or (t.next is PREVIOUS and expected not in ROUTED_STATES):
        with pytest.raises(InvalidTransition):
            apply(nh, fired, ctx)
        return
    out = apply(nh, fired, ctx)
    assert out.state is expected and out.node_id == "n"
    moves = [e for e in ctx.events if NodeState.DRAINING not in (e.from_state, e.to_state)]
    if signal in (Signal.DRAIN, Signal.UNDRAIN):
        assert out.drain.active is (signal is Signal.DRAIN) and len(ctx.events) == 1
        assert out.state is state
    if expected is state:
        reports = [e for e in moves if e.from_state is e.to_state]  # "cannot warm", once per episode
        assert moves == reports and out.since_s == nh.since_s
        if reports:
            assert state in (NodeState.COLD, NodeState.WARMING) and len(reports) == 1
            assert out.probe.warm_reported and not nh.probe.warm_reported
            assert reports[0].reason.startswith("cannot warm: ") and reports[0].reason == out.reason
        return
    # a transition: one event with a reason, and what every entry resets
    assert [(e.from_state, e.to_state) for e in moves] == [(state, expected)] and moves[0].reason
    assert moves[0].at_s == NOW and out.since_s == NOW and out.reason and out.probe.consecutive_good == 0
    if expected is NodeState.UNHEALTHY:
        assert out.ejection.cause is not None and out.ejection.from_state is state
        assert out.ramp.percent == 0.0 and out.probe.clean_since_s is None
        if state is NodeState.PROBATION:  # a failed probation doubles the next clean period
            assert out.ejection.clean_period_s == min(2 * required_clean_s(nh, CFG), CFG.probation.clean_max.s)
    else:
        assert out.ejection.cause is None
    if expected is NodeState.REFUSING:  # a soft block (entered directly: the refusals' evidence)
        assert model.route(out, 1, CFG).health_status == ("DRAINING" if out.drain.active else "UNHEALTHY")
        assert state is NodeState.UNHEALTHY or (out.reason.startswith("busy: ") and "not routed" in out.reason)
    if state is NodeState.REFUSING and expected in (NodeState.HEALTHY, NodeState.DEGRADED):
        assert out.ramp.percent == nh.ramp.percent  # busy, not failed: no probation, no ramp
    if expected is NodeState.PROBATION:
        assert out.ramp == Ramp(CFG.probation.ramp_start_percent, NOW)
    else:
        assert out.ramp.step_at_s is None
    assert (out.ejection.healthy_since_s == NOW) if expected is NodeState.HEALTHY else (
        out.ejection.healthy_since_s is None or state is not NodeState.HEALTHY)


def test_draining_is_an_overlay_not_a_table_state():
    assert not any(s is NodeState.DRAINING for s, _ in TABLE)
    with pytest.raises(InvalidTransition):
        model.step(NodeHealth(node_id="n", state=NodeState.DRAINING), model.HeartbeatObserved(), 1.0, CFG)


def test_every_signal_is_used_by_the_table_and_every_state_has_an_exit():
    assert {sig for _, sig in TABLE} == set(Signal)
    for st_ in MACHINE_STATES:
        assert any(t.next is not st_ for (s, _), t in TABLE.items() if s is st_), st_


def test_model_docstring_diagram_is_the_table():
    drawn = "\n".join("    " + line for line in render_diagram().splitlines())
    assert drawn in (model.__doc__ or ""), "regenerate with: python -c 'from xds_server.health.transitions " \
                                          "import render_diagram; print(render_diagram())'"


def test_diagram_shows_the_edges_the_old_drawing_missed():
    d = render_diagram()
    for s in ("PROBATION", "HEALTHY", "DEGRADED"):
        assert any(line.startswith(s) and "──► WARMING" in line and "engine restarting" in line
                   for line in d.splitlines())
    assert "UNHEALTHY  ──► (previous)  suspicion disproved | fail-static forgives" in d
