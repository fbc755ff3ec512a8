"""Shedding with the engines' own finished counters: each node's slots
and the time a request runs on it (Little's law on its running set, known at any load) give the
rate the pool of slots takes with the queue wait over the budget for at most 1 % of arrivals
(Erlang C); with it the drop follows the offered load, easing keeps a Poisson margin and the
headroom grows while queues pass the budget. Pure parts, and the Shedder's sampling."""
from __future__ import annotations

import math
from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from xds_server.config import ShedConfig
from xds_server.load.shedder import Shedder
from xds_server.policy.overload_drop import ShedInputs, ShedState, shed_step
from xds_server.policy.queueing import max_rate
from xds_server.policy.slot_admission import Admission

CFG = ShedConfig(enabled=True, lift_after_s=3.0, capacity_source="engines")


def feed(sh: Shedder, node: str, clock: list[float], runs: list[float], service_s: float = 0.8):
    """Evaluate once a second: each running count holds for one second; the engine finishes
    running / service_s requests per second. Returns what _finishing said each time."""
    count = [0.0]
    sh.finished = lambda _n: (clock[0], count[0])
    out = []
    for running in runs:
        out.append(sh._finishing(node, running, 3.0))
        clock[0] += 1.0
        count[0] += running / service_s
    return out


def test_slots_and_the_time_a_request_runs_are_known_at_any_load():
    sh, clock = Shedder(), [100.0]
    # 16 slots, 0.8 s a request. Half loaded (8 running) for 4 s, full once (16 running), then
    # light again: the time a request runs reads 0.8 s throughout, not the load
    out = feed(sh, "a", clock, [8.0] * 4 + [16.0] + [6.0] * 6)
    assert all(o[1] == 8.0 for o in out[1:4])            # slots: a lower bound until full
    assert all(o[1] == 16.0 for o in out[4:])
    runs = [o[2] for o in out[1:]]
    assert all(r is not None and abs(r - 0.8) < 0.1 for r in runs), runs
    rates = [o[0] for o in out[8:]]
    assert all(r is not None and abs(r - 6 / 0.8) < 0.01 for r in rates), rates  # 7.5 finished per s
    # an engine restart (the counter goes back) forgets its slots
    sh.finished = lambda _n: (clock[0], 0.0)
    assert sh._finishing("a", 4.0, 3.0) == (None, None, None)
    assert sh._slots["a"] == 4.0


def exact(waiting, offered, slots=16.0, service_s=0.8, n=2, **kw):
    return ShedInputs(list(waiting), [0.2] * n, offered, offered, 1, [None] * n, admitted_rps=offered,
                      growth_rps=kw.get("growth", 0.0), node_ids=[f"gpu-{k}" for k in range(n)],
                      finished_rps=[kw.get("finished", 15.0)] * n, slots=[slots] * n, service_s=[service_s] * n)


#: two 16-slot nodes at 0.8 s a request, a 0.5 s budget (the default): what they take at the p99
TAKE = max_rate(32, 1.25, 0.5, 0.01)


def test_the_drop_follows_the_offered_load_before_a_queue_forms():
    assert 0.8 * 40 < TAKE < 0.95 * 40  # under the 40 per s the slots complete: the tail's margin
    s = ShedState(30.0, low_since_s=0.0, capacity_rps=TAKE / 2, capacity_exact=True)
    t = shed_step(s, exact([0, 0], 60.0), CFG, 50, 100, 1.0)
    want = math.ceil((1 - TAKE / 60.0) * 100 / 5 - 1e-9) * 5
    assert t.percent == want > 30.0 and t.reason.startswith(f"tracking {want:g} %") and t.capacity_exact
    # the same rise with a measured (LRS) capacity waits for a queue
    lrs = ShedState(30.0, low_since_s=0.0, capacity_rps=20.0)
    no_counts = ShedInputs([0, 0], [0.2, 0.2], 60.0, 60.0, 1, [None, None], admitted_rps=60.0, growth_rps=0.0)
    assert shed_step(lrs, no_counts, CFG, 50, 100, 1.0).percent == 30.0
    # and the engines' counts are not read with lrs.shed.capacity_source lrs
    lrs_cfg = ShedConfig(enabled=True, lift_after_s=3.0, capacity_source="lrs")
    assert shed_step(s, exact([0, 0], 60.0), lrs_cfg, 50, 100, 1.0).percent == 30.0
    # a smaller budget takes less: more is shed at the same load
    tight = ShedConfig(enabled=True, lift_after_s=3.0, capacity_source="engines", queue_wait_budget_s=0.1)
    assert shed_step(s, exact([0, 0], 60.0), tight, 50, 100, 1.0).percent > t.percent


def test_easing_keeps_a_poisson_margin_over_the_offered_load():
    s = ShedState(15.0, low_since_s=0.0, capacity_rps=TAKE / 2, capacity_exact=True)
    # offered such that easing to 10 % lets in exactly what the slots take: two standard errors of
    # a 3 s Poisson count say that is too close, so it holds; at a lower load it eases
    at = TAKE / 0.9
    held = shed_step(s, exact([0, 0], at), CFG, 50, 100, 3.5)
    assert held.percent == 15.0 and held.reason.startswith("holding 15 %: 10 % would let in")
    low = (TAKE / 0.9 - 2 * math.sqrt(TAKE / 3)) * 0.9
    eased = shed_step(s, exact([0, 0], low), CFG, 50, 100, 3.5)
    assert eased.percent == 10.0 and eased.reason.startswith("easing")


def test_the_headroom_grows_while_queues_pass_the_budget_and_comes_back_once_they_stay_low():
    s = ShedState(40.0, capacity_rps=TAKE / 2, capacity_exact=True)
    hot = [s]
    # a queue over the budget, growing: 12 waiting drain at 16 slots / 0.8 s = 20 per s, 0.6 s > 0.5 s
    # (9 would be 0.45 s: under it, though 9 / 15 finished per s reads 0.6 s)
    assert shed_step(s, exact([9, 1], 55.0, growth=2.0), CFG, 50, 100, 0.0).headroom in (None, 0.0)
    for k in range(3):
        hot.append(shed_step(hot[-1], exact([12, 1], 55.0, growth=2.0), CFG, 50, 100, float(k)))
    assert [round(h.headroom or 0.0, 2) for h in hot[1:]] == [0.05, 0.1, 0.15]  # from 0: the model's margin
    assert all(b.percent >= a.percent for a, b in pairwise(hot))
    low = [hot[-1]]
    for k in range(30):  # queues empty from t=3 on: 0.05 back per 4 x lift_after_s (12 s)
        low.append(shed_step(low[-1], exact([0, 0], 20.0), CFG, 50, 100, 3.0 + k))
    rooms = sorted({round(x.headroom, 2) for x in low[1:] if x.headroom is not None}, reverse=True)
    assert rooms[:2] == [0.15, 0.1]
    assert any("headroom back to 0.10" in x.reason for x in low)


@given(st.lists(st.floats(0, 50), min_size=1, max_size=4), st.floats(0.1, 500), st.integers(1, 64),
       st.floats(0.05, 5), st.floats(0, 90), st.floats(0, 60), st.one_of(st.none(), st.floats(0.0, 0.5)))
def test_with_counted_slots_and_low_queues_the_drop_never_lets_in_more_than_they_take(
        waiting, offered, slots, service_s, before, now, room):
    n = len(waiting)
    take = max_rate(slots * n, 1 / service_s, CFG.queue_wait_budget.s, 0.01)
    s = ShedState(before, low_since_s=0.0, capacity_rps=take / n, capacity_exact=True, headroom=room)
    t = shed_step(s, exact([0.0] * n, offered, slots=float(slots), service_s=service_s, n=n), CFG, 50, 100, now)
    assert 0.0 <= t.percent <= CFG.max_percent
    if before > 0 and t.percent > 0:
        let_in = offered * (1.0 - t.percent / 100.0)
        assert let_in <= take * (1.0 - (room or 0.0)) + 1e-6 or t.percent >= CFG.max_percent
    q = shed_step(s, exact(waiting, offered, slots=float(slots), service_s=service_s, n=n), CFG, 50, 100, now)
    assert 0.0 <= q.percent <= CFG.max_percent and not math.isnan(q.percent)


def test_engines_without_a_budget_is_refused_naming_the_field():
    import pytest

    with pytest.raises(ValueError, match="capacity_source: engines needs queue_wait_budget"):
        ShedConfig(capacity_source="engines", queue_wait_budget_s=None)
    # the default (engines) with the budget null: the seed's thresholds alone, as null always meant
    assert ShedConfig(queue_wait_budget_s=None).capacity_source == "engines"


def test_the_budget_is_learned_from_unloaded_probes_only():
    from types import SimpleNamespace

    from xds_server.config import parse_config
    from xds_server.health.records import ProbeResultKind, Probes

    one = [{"name": "llm", "nodes": [{"id": "a", "address": "127.0.0.1:1", "probe_address": "127.0.0.1:2"}]}]
    cfg = parse_config({"xds": {"listen": "127.0.0.1:0"}, "clusters": one,
                        "lrs": {"shed": {"capacity_source": "engines"}}})
    node = SimpleNamespace(probe=Probes(), engine=SimpleNamespace(requests_waiting=0.0))
    core = SimpleNamespace(health={"a": node})
    sh = Shedder()

    def probe(k: int, ttft: float, kind=ProbeResultKind.OK, waiting=0.0):
        node.probe = Probes(seen=k, last_ttft_ms=ttft, last_kind=kind)
        node.engine = SimpleNamespace(requests_waiting=waiting)
        return sh._learn_ttft("llm", ["a"], core, cfg, float(k))

    got = [probe(k, 100.0 + k) for k in range(1, 20)]
    assert got == [None] * 19                                   # under 20 samples: not yet
    assert probe(20, 300.0) == 0.3                              # the p99 of 20: the largest
    assert probe(20, 900.0) == 0.3                              # the same probe seen again: no sample
    assert probe(21, 5000.0, kind=ProbeResultKind.TIMEOUT) == 0.3  # a failed probe says nothing
    assert probe(22, 5000.0, waiting=3.0) == 0.3                # a queue stood: not unloaded
    sh.shed["llm"] = ShedState(20.0)
    assert probe(23, 5000.0) == 0.3                             # shedding: not unloaded
    del sh.shed["llm"]
    sh.admission["llm"] = Admission(limit=32)
    assert probe(24, 5000.0) == 0.3                             # admitting by slots: not unloaded
    del sh.admission["llm"]
    sh2 = Shedder()
    for k in range(1, 31):
        node.probe = Probes(seen=k, last_ttft_ms=1.0, last_kind=ProbeResultKind.OK)
        b = sh2._learn_ttft("llm", ["a"], core, cfg, float(k))
    assert b == 0.05                                            # at least 50 ms
    off = parse_config({"xds": {"listen": "127.0.0.1:0"}, "clusters": one,
                        "lrs": {"shed": {"capacity_source": "engines", "ttft_budget_ratio": None}}})
    assert sh2._learn_ttft("llm", ["a"], core, off, 40.0) is None


def test_a_learned_budget_tighter_than_the_configured_one_admits_less():
    s = ShedState(30.0, low_since_s=0.0, capacity_rps=TAKE / 2, capacity_exact=True)
    loose = shed_step(s, exact([0, 0], 60.0), CFG, 50, 100, 1.0)
    i = exact([0, 0], 60.0)
    tight = shed_step(s, ShedInputs(**{**{f: getattr(i, f) for f in i.__slots__}, "ttft_budget_s": 0.1}),
                      CFG, 50, 100, 1.0)
    assert tight.percent > loose.percent


def test_a_nodes_slots_outlive_other_clusters_evaluations_and_go_after_10_min_unseen():
    from types import SimpleNamespace

    from xds_server.config import parse_config
    from xds_server.health.records import Probes
    from xds_server.load.aggregate import LoadAggregator

    cfg = parse_config({"xds": {"listen": "127.0.0.1:0"}, "lrs": {"shed": {"enabled": True}}, "clusters": [
        {"name": c, "nodes": [{"id": n, "address": f"127.0.0.1:{p}", "probe_address": f"127.0.0.1:{p + 1}"}]}
        for c, n, p in (("a", "gpu-a", 9001), ("b", "gpu-b", 9003))]})
    eng = SimpleNamespace(requests_waiting=1.0, requests_running=16.0, stalled=False)
    core = SimpleNamespace(routing={n: SimpleNamespace(health_status="HEALTHY") for n in ("gpu-a", "gpu-b")},
                           health={n: SimpleNamespace(heartbeat=SimpleNamespace(last_s=0.0), engine=eng,
                                                      probe=Probes()) for n in ("gpu-a", "gpu-b")},
                           mark_dirty=lambda _c: None)
    agg = LoadAggregator({"a": {("127.0.0.1", 9001): "gpu-a"}, "b": {("127.0.0.1", 9003): "gpu-b"}},
                         interval_s=1.0, min_gap_s=0.0)
    sh = Shedder()
    sh.finished = lambda _n: (0.0, 1.0)
    sh.step(cfg, core, agg, "a", ["gpu-a"], 1.0)
    assert sh._slots["gpu-a"] == 16.0
    core.routing["gpu-a"].health_status = "UNHEALTHY"  # ejected: cluster a evaluates no node
    for t in range(2, 300):
        sh.step(cfg, core, agg, "a", ["gpu-a"], float(t))
        sh.step(cfg, core, agg, "b", ["gpu-b"], float(t))
    assert sh._slots["gpu-a"] == 16.0  # kept for when it comes back (b's evaluations used to drop it)
    for t in range(300, 620, 10):
        sh.step(cfg, core, agg, "b", ["gpu-b"], float(t))
    assert "gpu-a" not in sh._slots and "gpu-b" in sh._slots  # unseen for 10 min: forgotten


def test_admitting_by_slots_weighs_fully_routed_nodes_by_their_slots_and_a_busy_node_is_one_of_them():
    from types import SimpleNamespace

    from xds_server.config import parse_config
    from xds_server.health.records import NodeState, Probes
    from xds_server.health.routing import Routing
    from xds_server.xds.resources import AdmissionArgs

    cfg = parse_config({"xds": {"listen": "127.0.0.1:0"}, "lrs": {"shed": {"enabled": True}}, "clusters": [
        {"name": "llm", "nodes": [{"id": n, "address": f"127.0.0.1:{9001 + k}"} for k, n in enumerate("abc")]}]})

    def node(state: NodeState, not_busy: bool = False) -> SimpleNamespace:
        return SimpleNamespace(state=state, probe=Probes(degraded_not_busy=not_busy))

    core = SimpleNamespace(
        routing={"a": Routing(30, "HEALTHY"), "b": Routing(30, "HEALTHY"), "c": Routing(100, "HEALTHY"),
                 "d": Routing(30, "HEALTHY")},
        health={"a": node(NodeState.DEGRADED), "b": node(NodeState.DEGRADED, not_busy=True),
                "c": node(NodeState.HEALTHY), "d": node(NodeState.DEGRADED)},
        node_cluster={"a": "llm", "b": "llm", "c": "llm", "d": "other"})
    sh = Shedder()
    assert sh.admission_args(cfg, "llm", core) is None  # not admitting: the decided weights stand
    sh.admission["llm"] = Admission(limit=32)
    # a: busy only, back to 30 / 0.3; b: slow without load, keeps its cut; c: HEALTHY; d: another cluster
    assert sh.admission_args(cfg, "llm", core) == AdmissionArgs(32, 10, {"a": 100, "c": 100})
    core.routing["c"] = Routing(80, "HEALTHY")   # a score from RTT: equal weights all the same
    sh._slots.update(a=8.0, c=16.0)               # by slots: the 8-slot node gets half the weight
    assert sh.admission_args(cfg, "llm", core) == AdmissionArgs(32, 10, {"a": 50, "c": 100})
