"""Which peers a switch-back validation replays against: a peer out for a moment (a suspicion
not yet proven, a replay stream that failed to open) makes the validation wait, never
lets the candidate in on probes alone; a real shortage does."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.health.records import Drain, EjectionCause, Engine, NodeHealth, NodeState
from xds_server.health.records import Ejection as Ej
from xds_server.policy.validation_peers import PeerPlan, choose_peers, plan_peers, suspected

CAUSES = [None, *EjectionCause]


@st.composite
def node(draw: st.DrawFn, nid: str) -> NodeHealth:
    state = draw(st.sampled_from(NodeState))
    cause = draw(st.sampled_from(CAUSES)) if state is NodeState.UNHEALTHY else None
    return NodeHealth(node_id=nid, state=state,
                      ejection=Ej(cause=cause, from_state=draw(st.sampled_from([None, *NodeState]))),
                      drain=Drain(active=draw(st.booleans())),
                      engine=Engine(requests_waiting=draw(st.sampled_from([None, 0.0, 1.0, 5.0]))))


@st.composite
def cluster(draw: st.DrawFn) -> dict[str, NodeHealth]:
    n = draw(st.integers(1, 7))
    return {f"n{i}": draw(node(f"n{i}")) for i in range(n)}


def _peer_outcomes(draw: st.DrawFn, plan: PeerPlan) -> tuple[dict[str, int], dict[str, str]]:
    caps, errors = {}, {}
    for p in plan.peers:
        kind = draw(st.sampled_from(["replays", "small", "no replay", "error"]))
        caps[p] = {"replays": 16, "small": 2, "no replay": 0, "error": 0}[kind]
        if kind == "error":
            errors[p] = "UNAVAILABLE: connection refused"
    return caps, errors


@settings(max_examples=300, deadline=None)
@given(cluster(), st.data())
def test_exactly_one_outcome_and_each_follows_from_who_is_out(c, data):
    plan = plan_peers("n0", c)
    assert "n0" not in plan.peers and "n0" not in plan.held
    assert all(c[p].state is NodeState.HEALTHY and not c[p].drain.active for p in plan.peers)
    assert all(suspected(c[p]) and not c[p].drain.active for p in plan.held)
    assert set(plan.peers).isdisjoint(plan.held)
    waits = [c[p].engine.requests_waiting or 0.0 for p in plan.peers]
    assert waits == sorted(waits)  # the least queued asked first
    caps, errors = _peer_outcomes(data.draw, plan)
    ch = choose_peers(plan, caps, errors, 8, "llm")
    assert sum(map(bool, (ch.run, ch.retry, ch.probes_only))) == 1
    able = [p for p in plan.peers if caps[p] >= 8 and not errors.get(p)]
    assert list(ch.able) == able
    failed = [p for p in plan.peers if errors.get(p)]
    if len(able) >= 2:
        assert ch.run == tuple(able[:2])
    elif len(able) + len(failed) + len(plan.held) >= 2:
        for p in [*failed, *plan.held]:
            assert f"peer {p}:" in ch.retry
    else:
        assert ch.probes_only == f"{len(able)} healthy peer(s) in cluster llm that replay, 2 needed: " \
                                 "validated by probes alone"


def _healthy(nid: str, waiting: float = 0.0) -> NodeHealth:
    return NodeHealth(node_id=nid, state=NodeState.HEALTHY, engine=Engine(requests_waiting=waiting))


def test_a_peer_suspected_for_a_moment_makes_the_candidate_wait():
    c = {"cand": NodeHealth(node_id="cand", state=NodeState.PROBATION), "a": _healthy("a"),
         "b": NodeHealth(node_id="b", state=NodeState.UNHEALTHY,
                         ejection=Ej(cause=EjectionCause.PHI, from_state=NodeState.HEALTHY))}
    plan = plan_peers("cand", c)
    assert plan == PeerPlan(("a",), ("b",))
    ch = choose_peers(plan, {"a": 16}, {}, 8, "llm")
    assert ch.retry == ("1 healthy peer(s) in cluster llm that replay, 2 needed; out for now: "
                        "peer b: suspected, not yet proven or disproved")
    # proven by the count rule: a real shortage, probes alone decide
    c["b"] = NodeHealth(node_id="b", state=NodeState.UNHEALTHY,
                        ejection=Ej(cause=EjectionCause.HEARTBEAT, from_state=NodeState.HEALTHY))
    ch = choose_peers(plan_peers("cand", c), {"a": 16}, {}, 8, "llm")
    assert ch.probes_only.endswith("validated by probes alone") and ch.able == ("a",)
    # back: both replay, the less queued first
    c["b"] = _healthy("b", waiting=0.0)
    c["a"] = _healthy("a", waiting=3.0)
    plan = plan_peers("cand", c)
    assert plan.peers == ("b", "a")
    assert choose_peers(plan, {"a": 16, "b": 16}, {}, 8, "llm").run == ("b", "a")


def test_a_peer_whose_stream_failed_is_retried_not_taken_for_one_that_does_not_replay():
    plan = PeerPlan(("a", "b"), ())
    ch = choose_peers(plan, {"a": 16, "b": 0}, {"b": "no heartbeat within 5 s"}, 8, "llm")
    assert ch.retry.endswith("out for now: peer b: no heartbeat within 5 s")
    ch = choose_peers(plan, {"a": 16, "b": 0}, {}, 8, "llm")  # b's agent says it does not replay
    assert ch.probes_only and ch.able == ("a",)
    ch = choose_peers(plan, {"a": 16, "b": 4}, {}, 8, "llm")  # b replays fewer prompts than asked
    assert ch.probes_only and ch.able == ("a",)
