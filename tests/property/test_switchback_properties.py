"""Switch-back validation, the pure parts: the judge (candidate vs two peers' noise)
and the gate in the health model (PROBATION waits unrouted for a verdict before its first
request, then ramps)."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import HealthConfig
from xds_server.health import model as hm
from xds_server.health.routing import RoutingStatus, node_routing
from xds_server.policy.replay_judge import Answer, PromptAnswers, agreement_tokens, judge, similarity

MAX = 16
KW = {"max_tokens": MAX, "token_margin": 0.25, "similarity_margin": 0.2, "min_prompt_ratio": 0.75}
ids = st.lists(st.integers(0, 40), min_size=0, max_size=MAX).map(tuple)
answers = st.builds(lambda t, ok, with_ids: Answer(" ".join(f"w{i}" for i in t), t if with_ids else None, ok),
                    ids, st.booleans(), st.booleans())
prompts = st.lists(st.builds(PromptAnswers, answers, answers, answers), min_size=1, max_size=10)


@settings(max_examples=100, deadline=None)
@given(prompts)
def test_judge_is_total_and_its_numbers_are_ratios(pas):
    j = judge(pas, **KW)
    assert j.verdict in ("passed", "failed", "inconclusive")
    assert 0 <= j.within <= j.judged <= j.prompts == len(pas)
    for d in (j.noise, j.candidate):
        if d["similarity"] is not None:
            assert 0.0 <= d["similarity"] <= 1.0
        if d["agreement_tokens"] is not None:
            assert 0 <= d["agreement_tokens"] <= MAX


@settings(max_examples=100, deadline=None)
@given(prompts)
def test_peers_swapped_give_the_same_verdict(pas):
    swapped = [PromptAnswers(p.candidate, p.peer_b, p.peer_a) for p in pas]
    assert judge(pas, **KW).verdict == judge(swapped, **KW).verdict


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(answers, answers), min_size=1, max_size=10))
def test_a_candidate_that_answers_as_one_peer_always_passes(pairs):
    # disagreement with that peer is 0 and with the other exactly the peers' own noise
    pas = [PromptAnswers(replace(a, ok=True), replace(a, ok=True), replace(b, ok=True)) for a, b in pairs]
    assert judge(pas, **KW).verdict == "passed"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), min_size=MAX, max_size=MAX).map(tuple), min_size=2, max_size=10))
def test_another_model_fails_against_agreeing_peers(outs):
    # peers agree to the last token; the candidate differs from token 0 on every prompt
    pas = [PromptAnswers(Answer("x " * MAX, tuple(0 for _ in t)), Answer(" ".join(map(str, t)), t),
                         Answer(" ".join(map(str, t)), t)) for t in outs]
    j = judge(pas, **KW)
    assert j.verdict == "failed" and j.within == 0
    assert j.detail.startswith(f"switch-back: diverges from peers at token 0 of {MAX} on {len(outs)} of {len(outs)}")
    assert f"peers agree to token {MAX} of {MAX}" in j.detail


@settings(max_examples=60, deadline=None)
@given(prompts, st.floats(0, 1), st.floats(0, 1))
def test_larger_margins_never_turn_a_pass_into_a_failure(pas, extra_t, extra_s):
    j = judge(pas, **KW)
    wider = judge(pas, **{**KW, "token_margin": min(1.0, 0.25 + extra_t), "similarity_margin": min(1.0, 0.2 + extra_s)})
    if j.verdict == "passed":
        assert wider.verdict == "passed"


def test_peer_noise_is_the_floor_not_a_fixed_threshold():
    # peers themselves diverge at token 4 (batch-size drift); a candidate diverging at 4 passes
    base = tuple(range(1, MAX + 1))
    drift = base[:4] + tuple(t + 50 for t in base[4:])
    pas = [PromptAnswers(Answer("c", drift), Answer("a", base), Answer("b", drift))] * 4
    assert agreement_tokens(Answer("", base), Answer("", drift)) == 4
    assert judge(pas, **KW).verdict == "passed"
    # ... and with peers that agree fully, the same candidate fails
    pas = [PromptAnswers(Answer("c x", drift), Answer("a", base), Answer("a", base))] * 4
    assert judge(pas, **KW).verdict == "failed"


def test_missing_peer_answers_are_inconclusive_and_cosine_applies_only_when_peers_reach_it():
    a = Answer("the same words", (1, 2, 3))
    bad = Answer("", None, ok=False)
    assert judge([PromptAnswers(a, a, bad)] * 3, **KW).verdict == "inconclusive"
    assert similarity(a, a) == 1.0
    low = judge([PromptAnswers(a, a, a, (0.5, 0.5, 0.99))] * 3, **KW)
    assert low.verdict == "failed"  # the peers reach 0.85, the candidate does not
    noisy = judge([PromptAnswers(a, a, a, (0.5, 0.5, 0.6))] * 3, **KW)
    assert noisy.verdict == "passed"  # the peers themselves do not: cosine says nothing


# ---- the gate in the health model ----------------------------------------------------------

ON = HealthConfig(ramp_step_percent=50, ramp_step_s=1.0, validation={"enabled": True})
OFF = HealthConfig(ramp_step_percent=50, ramp_step_s=1.0)


def _probation(cfg: HealthConfig) -> tuple[hm.NodeHealth, float]:
    """A node that just entered PROBATION at t = 10 s (first good probe after a heartbeat)."""
    nh = hm.initial("n", 0.0)
    nh, _ = hm.step(nh, hm.HeartbeatObserved(), 9.9, cfg)
    nh, _ = hm.step(nh, hm.ProbeObserved(hm.ProbeResultKind.OK, 10.0), 10.0, cfg)
    assert nh.state is hm.NodeState.PROBATION
    return nh, nh.since_s


def _ticks(nh: hm.NodeHealth, cfg: HealthConfig, until: float, start: float | None = None) -> hm.NodeHealth:
    t = nh.since_s if start is None else start
    while t < until:
        t += 0.1
        nh, _ = hm.step(nh, hm.HeartbeatObserved(), t, cfg)
        if round(t * 10) % 5 == 0:
            nh, _ = hm.step(nh, hm.ProbeObserved(hm.ProbeResultKind.OK, 10.0), t, cfg)
    return nh


def test_without_validation_the_ramp_ends_probation_as_before():
    nh, _ = _probation(OFF)
    assert _ticks(nh, OFF, 14.0).state is hm.NodeState.HEALTHY


@settings(max_examples=40, deadline=None)
@given(st.floats(3.0, 8.0), st.sampled_from(list(hm.ValidationVerdict)), st.text(max_size=30),
       st.floats(-5, 5))
def test_the_gate_holds_probation_unrouted_until_a_verdict_for_this_probation(wait_s, verdict, detail, skew):
    nh, since = _probation(ON)
    nh = _ticks(nh, ON, since + wait_s)
    # before its first request: no ramp runs, not routed, however long it waits
    assert nh.state is hm.NodeState.PROBATION and nh.validation.verdict is hm.ValidationVerdict.PENDING
    assert nh.ramp.step_at_s is None and "unrouted until switch-back validation passes" in nh.reason
    view = node_routing(nh, ON)
    assert view.status is RoutingStatus.UNHEALTHY and view.hard
    # a verdict for another probation (or not a verdict) changes nothing
    stale = since + skew != since or verdict in (hm.ValidationVerdict.NONE, hm.ValidationVerdict.PENDING)
    out, events = hm.step(nh, hm.ValidationObserved(verdict, detail, since + skew), since + wait_s, ON)
    if stale:
        assert out == nh and events == []
        return
    if verdict is hm.ValidationVerdict.FAILED:
        assert out.state is hm.NodeState.UNHEALTHY and out.ejection.cause is hm.EjectionCause.VALIDATION
        assert out.reason.startswith(detail) and out.validation.verdict is verdict
        assert [(e.from_state, e.to_state) for e in events] == [(hm.NodeState.PROBATION, out.state)]
    else:  # the ramp starts now, at its first step; routed from here on
        assert out.state is hm.NodeState.PROBATION and out.ramp.step_at_s == since + wait_s
        assert out.ramp.percent == ON.probation.ramp_start_percent and out.validation.verdict is verdict
        assert "switch-back validated" in out.reason
        assert f"ramping from {ON.probation.ramp_start_percent:g} %" in out.reason
        assert node_routing(out, ON).status is RoutingStatus.HEALTHY and events == []
        done = _ticks(out, ON, since + wait_s + 4, start=since + wait_s)
        assert done.state is hm.NodeState.HEALTHY  # the ramp ends it: no second wait at the end
    # a second (late) verdict changes nothing
    again, ev2 = hm.step(out, hm.ValidationObserved(verdict, detail, since), since + wait_s + 1, ON)
    assert again.state is out.state and again.validation == out.validation and ev2 == []


def test_a_new_probation_asks_again():
    nh, since = _probation(ON)
    nh = _ticks(nh, ON, since + 3)
    nh, _ = hm.step(nh, hm.ValidationObserved(hm.ValidationVerdict.FAILED, "switch-back: diverges", since), since + 3,
                    ON)
    assert nh.state is hm.NodeState.UNHEALTHY
    # clean period doubled (failure in PROBATION): the next PROBATION's validation starts from NONE
    assert nh.ejection.clean_period_s == 2 * ON.probation.clean.s


@settings(max_examples=200, deadline=None)
@given(answers, answers)
def test_similarity_is_symmetric(a, b):
    assert similarity(a, b) == similarity(b, a)


def test_peers_swapped_on_a_found_example_give_the_same_verdict():
    # difflib's ratio differs by argument order on these texts (0.86 vs 0.82): a verdict flipped
    def ans(*t: int) -> Answer:
        return Answer(" ".join(f"w{i}" for i in t), None, True)

    failed = Answer("", None, False)
    pas = [PromptAnswers(failed, failed, failed), PromptAnswers(failed, failed, failed),
           PromptAnswers(ans(), ans(), ans()), PromptAnswers(ans(0, 1), ans(0, 1, 0, 1), ans(1, 2, 0, 0))]
    swapped = [PromptAnswers(p.candidate, p.peer_b, p.peer_a) for p in pas]
    assert judge(pas, **KW).verdict == judge(swapped, **KW).verdict
