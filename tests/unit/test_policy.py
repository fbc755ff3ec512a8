"""Cluster policy: seed score weights, outlier ejection, max ejection percent, fail-static."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st_

from xds_server.config import HealthConfig
from xds_server.health.model import (
    Engine,
    Heartbeats,
    ProbeObserved,
    Probes,
    Rtt,
    initial,
)
from xds_server.health.model import (
    NodeState as S,
)
from xds_server.health.model import (
    ProbeResultKind as K,
)
from xds_server.health.sim import NodeSim
from xds_server.policy.cluster_routing import (
    FailStaticState,
    OutlierState,
    cluster_routing,
    counted_silent,
    fail_static,
    fail_static_may_change,
    score,
)

CFG = HealthConfig()


def node(nid, state=S.HEALTHY, reason=None, last_heartbeat_s=0.0, ewma_rtt_ms=None, ewma_ttft_ms=None,
         gpu_free_ratio=None, requests_waiting=None, rtt_samples=CFG.outlier.min_rtt_samples):
    nh = initial(nid, 0.0)
    return replace(nh, state=state, reason=nh.reason if reason is None else reason,
                   heartbeat=Heartbeats(last_s=last_heartbeat_s),
                   rtt=Rtt(ewma_ms=ewma_rtt_ms, samples=0 if ewma_rtt_ms is None else rtt_samples),
                   probe=Probes(ewma_ttft_ms=ewma_ttft_ms),
                   engine=Engine(gpu_free_ratio=gpu_free_ratio, requests_waiting=requests_waiting))


def test_seed_score_formula():
    assert abs(score(10.0, 0.8, CFG) - (0.7 * 10.0 + 0.3 * 0.2 * 100)) < 1e-9


def test_weights_follow_score_with_slack_and_unknowns_neutral():
    nodes = [("a", 1, node("a", ewma_rtt_ms=1.0, gpu_free_ratio=0.9)),
             ("b", 1, node("b", ewma_rtt_ms=1.3, gpu_free_ratio=0.9)),     # noise-level difference
             ("c", 1, node("c", ewma_rtt_ms=40.0, gpu_free_ratio=0.9)),    # much slower, not an outlier
             ("d", 2, node("d"))]                                          # unknown: median values
    d = cluster_routing(nodes, {}, 0.0, CFG)
    w = {k: v.weight for k, v in d.routing.items()}
    assert w["a"] == 100 and w["b"] == 100
    assert w["c"] == 35                          # (3.7 + 10) / (31 + 10) = 0.334 -> quantized 0.35
    assert w["d"] == 200                         # capacity 2; unknown RTT/GPU take the median: neutral
    assert all(v.health_status == "HEALTHY" for v in d.routing.values())


def test_all_nodes_failing_probes_are_unhealthy_never_weight_0_and_healthy_fraction_0():
    """Field case fc04."""
    sims = []
    for nid in ("n1", "n2"):
        sim = NodeSim(cfg=HealthConfig(ramp_step_percent=50), node_id=nid)
        sim.run_until(4.0)
        sim.probe = lambda t: ProbeObserved(K.HTTP_STATUS, http_status=503)
        sim.run_until(8.0)
        sims.append(sim)
    d = cluster_routing([(s.node_id, 1, s.nh) for s in sims], {}, 8.0, CFG)
    assert [r.health_status for r in d.routing.values()] == ["UNHEALTHY", "UNHEALTHY"]
    assert all(r.weight == 100 for r in d.routing.values())
    assert not d.held_back  # hard evidence is never held back by max_ejection_percent


def test_recovery_restarts_ramp_at_1pct_and_a_joining_node_does_not_change_it():
    """Field case fc05."""
    cfg = HealthConfig(probation_clean_s=5, ramp_step_s=1.0)
    a = NodeSim(cfg=cfg, node_id="a")
    a.run_until(110.0)
    assert a.nh.state is S.HEALTHY
    a.apply(ProbeObserved(K.ENGINE_FATAL, detail="CUDA error"), 110.2)
    a.run_until(117.0)
    assert a.nh.state is S.PROBATION and a.nh.ramp.percent <= 2
    ramp_alone, ramp_joined = [], []
    joined = NodeSim(cfg=cfg, node_id="new", now=120.0)
    for t in range(118, 150):
        a.run_until(float(t))
        joined.run_until(float(t))
        ramp_alone.append(cluster_routing([("a", 1, a.nh)], {}, float(t), cfg).routing["a"].weight)
        members = [("a", 1, a.nh)] + ([("new", 1, joined.nh)] if t >= 120 else [])
        ramp_joined.append(cluster_routing(members, {}, float(t), cfg).routing["a"].weight)
    assert ramp_alone == sorted(ramp_alone) and min(ramp_alone) >= 1 and ramp_alone[-1] <= 40
    assert ramp_joined == ramp_alone  # the joining node does not change a's ramp
    # second failure and recovery: back to 1 %
    a.apply(ProbeObserved(K.TIMEOUT), 150.1)
    a.apply(ProbeObserved(K.TIMEOUT), 150.2)
    assert a.nh.state is S.UNHEALTHY
    a.run_until(200.0)
    assert a.nh.state in (S.PROBATION, S.HEALTHY)
    assert [e for e in a.events if e.to_state is S.PROBATION][-1].reason.endswith("ramping from 1 %")


def test_outlier_ttft_far_above_median_is_ejected_and_returns_after_ejection_time():
    nodes = [(n, 1, node(n, ewma_ttft_ms=t)) for n, t in (("a", 40), ("b", 50), ("c", 45), ("d", 900))]
    d = cluster_routing(nodes, {}, 10.0, CFG)
    assert d.routing["d"].health_status == "UNHEALTHY" and "outlier: EWMA TTFT 900 ms" in d.why_not_routed["d"]
    assert [e.kind for e in d.events] == ["outlier_ejected"] and d.outliers["d"].until_s == 40.0
    healed = [(n, 1, node(n, ewma_ttft_ms=45)) for n in "abcd"]
    d2 = cluster_routing(healed, d.outliers, 20.0, CFG)
    assert d2.routing["d"].health_status == "UNHEALTHY"  # still serving its 30 s
    d3 = cluster_routing(healed, d2.outliers, 40.5, CFG)
    assert d3.routing["d"].health_status == "HEALTHY" and [e.kind for e in d3.events] == ["outlier_returned"]
    # a second ejection lasts twice as long
    d4 = cluster_routing(nodes, d3.outliers, 50.0, CFG)
    assert d4.outliers["d"].until_s == 110.0


def test_rtt_is_judged_only_after_enough_pings():
    """The first round trips of a stream measure its setup (our connect storm): a node's EWMA RTT
    is neither an outlier nor a weight until it has ``outlier.min_rtt_samples`` pings behind it."""
    need = CFG.outlier.min_rtt_samples
    assert need > 1

    def fleet(samples):
        return [(n, 1, node(n, ewma_rtt_ms=r, rtt_samples=need, gpu_free_ratio=0.9))
                for n, r in (("a", 10), ("b", 12), ("c", 11))] + [
            ("d", 1, node("d", ewma_rtt_ms=120.0, rtt_samples=samples, gpu_free_ratio=0.9))]

    early = cluster_routing(fleet(need - 1), {}, 10.0, CFG)
    assert not early.events and early.routing["d"].health_status == "HEALTHY"
    assert early.routing["d"].weight == early.routing["c"].weight  # unknown: scored at the median (c)
    judged = cluster_routing(fleet(need), {}, 10.0, CFG)
    assert judged.routing["d"].health_status == "UNHEALTHY"
    assert "outlier: EWMA RTT 120 ms vs cluster median 12 ms" in judged.why_not_routed["d"]


def test_max_ejection_percent_holds_back_soft_ejections_and_says_so():
    nodes = [("a", 1, node("a", state=S.UNHEALTHY, reason="probe: 2 consecutive failures")),
             ("b", 1, node("b", requests_waiting=500)),
             ("c", 1, node("c", gpu_free_ratio=0.01)),
             ("d", 1, node("d"))]
    d = cluster_routing(nodes, {}, 0.0, CFG)
    statuses = {k: v.health_status for k, v in d.routing.items()}
    assert statuses == {"a": "UNHEALTHY", "b": "UNHEALTHY", "c": "HEALTHY", "d": "HEALTHY"}
    assert d.held_back == ("c",)
    held = [e for e in d.events if e.kind == "held_back"]
    assert len(held) == 1 and "2 of 4 already out" in held[0].reason and "GPU memory free 1.0 %" in held[0].reason


def test_fail_static_when_most_nodes_go_silent_together_and_resume_when_they_return():
    h = {f"n{i}": node(f"n{i}", last_heartbeat_s=10.0 + i * 0.01) for i in range(4)}
    st, evs = fail_static(FailStaticState(), h, 10.2, CFG)
    assert st.active is False  # nothing silent yet (within interval + grace)
    st, evs = fail_static(st, h, 10.5, CFG)
    assert st.active and evs[0].kind == "fail_static_on" and "4 of 4 nodes" in st.reason
    assert st.burst_start_s == 10.0
    h = {k: replace(v, heartbeat=Heartbeats(last_s=11.0)) for k, v in h.items()}
    st, evs = fail_static(st, h, 11.05, CFG)
    assert not st.active and evs[0].kind == "fail_static_off"


def test_fail_static_not_for_losses_spread_out_in_time():
    h = {"a": node("a", last_heartbeat_s=1.0), "b": node("b", last_heartbeat_s=5.0),
         "c": node("c", last_heartbeat_s=20.0)}
    st, _ = fail_static(FailStaticState(), h, 21.0, CFG)
    assert not st.active


def test_outlier_state_default():
    assert OutlierState().until_s == 0.0


# -- the walk is skipped only where it could not change the state (core: ControlCore._check_fail_static)

_HB = st_.tuples(st_.one_of(st_.none(), st_.floats(0.0, 2.0)), st_.integers(0, 4), st_.booleans())


def _fleet(hbs, now_s: float) -> dict:
    """Nodes whose counted misses are consistent with time: a miss only once interval + grace passed."""
    out = {}
    limit = (CFG.heartbeat.interval.ms + CFG.heartbeat.grace.ms) / 1000.0
    for i, (last, misses, closed) in enumerate(hbs):
        if last is None or now_s - last < limit:
            misses = 0
        out[f"n{i}"] = replace(initial(f"n{i}", 0.0), heartbeat=Heartbeats(last, misses, closed))
    return out


@given(hbs=st_.lists(_HB, min_size=0, max_size=14), now=st_.floats(0.0, 3.0), active=st_.booleans())
def test_fail_static_may_change_is_false_only_where_the_walk_changes_nothing_or_waits_for_counted_misses(
        hbs, now, active):
    h = _fleet(hbs, now)
    state = FailStaticState(True, 0.0, "on", 0.0) if active else FailStaticState()
    counted = sum(counted_silent(nh) for nh in h.values())
    after, _ = fail_static(state, h, now, CFG)
    if not fail_static_may_change(state, len(h), counted, CFG):
        if active:
            assert after == state  # exact: counted silent nodes are silent by time too
        else:
            # not active and too few counted: the walk could enter only on nodes silent by time
            # whose Tick has not run; with every silent node counted, it stays off as well
            all_counted = {k: (replace(v, heartbeat=Heartbeats(v.heartbeat.last_s, 1, v.heartbeat.stream_closed))
                               if v.heartbeat.last_s is not None and now - v.heartbeat.last_s
                               >= (CFG.heartbeat.interval.ms + CFG.heartbeat.grace.ms) / 1000.0 else v)
                           for k, v in h.items()}
            if sum(counted_silent(nh) for nh in all_counted.values()) == counted:
                assert not fail_static(state, all_counted, now, CFG)[0].active


def _out(nid: str, cause: str, probe_failures: int = 0):
    from xds_server.health.model import Ejection, EjectionCause

    nh = node(nid, S.UNHEALTHY, reason=f"{cause}: out")
    return replace(nh, ejection=Ejection(cause=EjectionCause(cause)),
                   probe=replace(nh.probe, consecutive_failures=probe_failures))


def test_silent_nodes_still_serving_stay_routed_when_nothing_else_is():
    # two nodes out for failed probes; the two survivors' agents went silent while their
    # engines keep serving Envoy (their load reports succeed)
    nodes = [("a", 1, _out("a", "probe", 3)), ("b", 1, _out("b", "probe", 3)),
             ("c", 1, _out("c", "heartbeat")), ("d", 1, _out("d", "phi"))]
    d = cluster_routing(nodes, {}, 1.0, CFG, serving={"c", "d"})
    assert {k: v.health_status for k, v in d.routing.items()} == {
        "a": "UNHEALTHY", "b": "UNHEALTHY", "c": "HEALTHY", "d": "HEALTHY"}
    assert d.kept_silent == ("c", "d") and set(d.why_not_routed) == {"a", "b"}
    assert [(e.node_id, e.kind) for e in d.events] == [("c", "fail_static_kept"), ("d", "fail_static_kept")]
    # the next decision with the same inputs: no new event
    again = cluster_routing(nodes, {}, 1.1, CFG, serving={"c", "d"}, kept_before=d.kept_silent)
    assert again.kept_silent == ("c", "d") and not again.events
    # d's real traffic stops completing (a frozen host): it goes; c stays
    frozen = cluster_routing(nodes, {}, 2.0, CFG, serving={"c"}, kept_before=d.kept_silent)
    assert frozen.kept_silent == ("c",) and frozen.routing["d"].health_status == "UNHEALTHY"
    assert [(e.node_id, e.kind) for e in frozen.events] == [("d", "fail_static_kept_ended")]


def test_silence_is_not_kept_while_another_node_is_routable_nor_without_traffic_or_with_failed_probes():
    silent = [("c", 1, _out("c", "heartbeat")), ("d", 1, _out("d", "heartbeat"))]
    d = cluster_routing([("a", 1, node("a")), *silent], {}, 1.0, CFG, serving={"c", "d"})
    assert not d.kept_silent and d.routing["c"].health_status == "UNHEALTHY"  # a serves
    assert not cluster_routing(silent, {}, 1.0, CFG).kept_silent  # no load reports: no evidence
    probed = [("c", 1, _out("c", "heartbeat", probe_failures=1)), ("e", 1, _out("e", "traffic"))]
    assert not cluster_routing(probed, {}, 1.0, CFG, serving={"c", "e"}).kept_silent


@given(st_.lists(st_.tuples(st_.sampled_from(["healthy", "heartbeat", "phi", "probe", "traffic", "engine"]),
                            st_.booleans(), st_.integers(0, 2)), min_size=1, max_size=8))
def test_kept_silent_nodes_are_only_silent_serving_ones_and_only_when_nothing_else_routes(rows):
    nodes, serving = [], set()
    for i, (kind, serves, probe_failures) in enumerate(rows):
        nid = f"n{i}"
        nodes.append((nid, 1, node(nid) if kind == "healthy" else _out(nid, kind, probe_failures)))
        if serves:
            serving.add(nid)
    d = cluster_routing(nodes, {}, 1.0, CFG, serving=serving)
    health = {nid: nh for nid, _, nh in nodes}
    for nid in d.kept_silent:
        assert nid in serving and health[nid].ejection.cause.value in ("heartbeat", "phi")
        assert health[nid].probe.consecutive_failures == 0
    if d.kept_silent:
        assert all(health[n].state is S.UNHEALTHY for n in health)  # nothing else was routable
    routed = [n for n, r in d.routing.items() if r.health_status == "HEALTHY"]
    assert set(d.kept_silent) <= set(routed)
