"""Fleet-wide passive ejection (xds_server.policy.traffic_ejection, pure) and its path through the health
model (signal TRAFFIC_FAILING -> UNHEALTHY, then the usual half-open probation); the simulator's
``user_error`` fault that drives it."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_probe.sim.faults import Faults
from xds_server.config import HealthConfig, TrafficEjectionConfig
from xds_server.health import model as hm
from xds_server.policy.traffic_ejection import Evidence, failure_p_value, traffic_verdicts

CFG = TrafficEjectionConfig()


def healthy(nid: str) -> hm.NodeHealth:
    return replace(hm.initial(nid, 0.0), state=hm.NodeState.HEALTHY)


def test_a_node_failing_real_traffic_is_ejected_with_the_evidence_named():
    nodes = [("a", healthy("a"), Evidence(40, 0, 3, 10.0)), ("b", healthy("b"), Evidence(39, 1, 3, 10.0)),
             ("c", healthy("c"), Evidence(3, 18, 3, 10.0))]
    v = traffic_verdicts(nodes, CFG, 50.0)
    assert list(v.eject) == ["c"] and not v.held
    assert v.eject["c"].startswith("real traffic: 18 of 21 requests failed in 10 s across 3 Envoys")
    assert v.eject["c"].endswith("; probes OK")


def test_below_minimum_volume_nothing_is_decided():
    nodes = [("a", healthy("a"), Evidence(10, 0, 3, 10.0)), ("c", healthy("c"), Evidence(0, 9, 3, 10.0))]
    assert not traffic_verdicts(nodes, CFG, 50.0).eject  # 9 < min_requests 10


def test_a_node_significantly_worse_than_its_peers_is_ejected_with_the_tests_numbers():
    nodes = [(n, healthy(n), Evidence(500, 0, 3, 10.0)) for n in "abcd"]
    nodes.append(("e", healthy("e"), Evidence(400, 100, 3, 10.0)))
    v = traffic_verdicts(nodes, CFG, 50.0)
    assert list(v.eject) == ["e"] and not v.cluster_failure
    assert "(20 % failed vs peers' 0.0 % + 2 % tolerated: p = " in v.eject["e"]


@given(st.integers(1000, 100_000), st.integers(2, 8), st.floats(0.0, 0.05))
def test_a_99_percent_node_at_high_volume_is_never_ejected(volume, peers, peer_noise):
    nodes = [(f"p{i}", healthy(f"p{i}"), Evidence(volume - int(volume * peer_noise * i / peers),
                                                 int(volume * peer_noise * i / peers), 3, 10.0))
             for i in range(peers)]
    nodes = [(n, h, e) for n, h, e in nodes if e.errored / e.completed < 0.001]  # peers near-perfect
    nodes.append(("x", healthy("x"), Evidence(volume - volume // 100, volume // 100, 3, 10.0)))
    assert "x" not in traffic_verdicts(nodes, CFG, 50.0).eject


@given(st.integers(2, 12), st.integers(0, 12), st.floats(0, 100))
def test_the_cap_holds_and_most_nodes_failing_alike_eject_none(n, bad, pct):
    bad = min(bad, n)
    nodes = [(f"n{i}", healthy(f"n{i}"), Evidence(0 if i < bad else 50, 50 if i < bad else 0, 3, 10.0))
             for i in range(n)]
    v = traffic_verdicts(nodes, CFG, pct)
    if bad > n * CFG.cluster_failure_share:  # most nodes fail alike: the requests' fault
        assert not v.eject and [(f.scope, f.failing, f.nodes) for f in v.cluster_failure] == [("cluster", bad, n)]
        assert all(why.endswith("not ejected: most nodes fail alike (cluster_failure)") for why in v.held.values())
        return
    assert len(v.eject) + len(v.held) == bad
    cap = int(n * pct / 100 + 1e-9)
    assert len(v.eject) == min(bad, cap) and not v.cluster_failure
    # nodes already out count against the cap
    out = [(nid, replace(h, state=hm.NodeState.UNHEALTHY), e) for nid, h, e in nodes[:1]] + nodes[1:]
    assert len(traffic_verdicts(out, CFG, pct).eject) <= max(0, cap - 1)


def test_off_decides_nothing():
    nodes = [("c", healthy("c"), Evidence(0, 100, 3, 10.0)), ("a", healthy("a"), Evidence(100, 0, 3, 10.0))]
    assert not traffic_verdicts(nodes, TrafficEjectionConfig(enabled=False), 50.0).eject


def test_traffic_failing_goes_through_the_model_and_its_half_open_probation():
    cfg = HealthConfig(probation_clean_s=2.0)
    nh = healthy("c")
    nh, events = hm.step(nh, hm.TrafficFailing("real traffic: 18 of 21 requests failed"), 5.0, cfg)
    assert nh.state is hm.NodeState.UNHEALTHY and nh.ejection.cause is hm.EjectionCause.TRAFFIC
    assert events[0].reason.startswith("real traffic: 18 of 21")
    # not routed states ignore it
    for s in (hm.NodeState.COLD, hm.NodeState.WARMING, hm.NodeState.UNHEALTHY):
        again, ev = hm.step(replace(nh, state=s), hm.TrafficFailing("x"), 6.0, cfg)
        assert again.state is s and not ev


def test_sim_user_error_fails_matching_user_requests_only():
    f = Faults()
    f.set("user_error", rate=0.5, min_prompt_tokens=10)
    assert f.state()["rate"] == 0.5
    assert not f.fails_request(True, 1000)    # a probe passes
    assert not f.fails_request(False, 5)      # a short prompt passes
    got = [f.fails_request(False, 20) for _ in range(10)]
    assert sum(got) == 5 and got[:2] == [False, True]
    f.set("user_error")
    assert all(f.fails_request(False, 1) for _ in range(5))
    for bad in (1.5, -0.1, float("nan"), True):
        try:
            f.set("user_error", rate=bad)
        except ValueError as e:
            assert "rate" in str(e)
        else:
            raise AssertionError(f"rate {bad!r} accepted")


def test_sim_load_slow_stretches_the_token_interval_with_load():
    f = Faults()
    assert f.load_factor(8) == 1.0
    f.set("load_slow", knee=2)
    assert f.state()["knee"] == 2
    assert [f.load_factor(n) for n in (0, 1, 2, 4)] == [1.0, 1.5, 2.0, 3.0]
    try:
        f.set("load_slow", knee=0)
    except ValueError as e:
        assert "knee" in str(e) and f.knee == 2 and f.mode == "load_slow"  # nothing changed
    else:
        raise AssertionError("knee 0 accepted")


async def test_sim_fault_endpoint_takes_the_new_fields():
    from aiohttp.test_utils import TestClient, TestServer

    from node_probe.sim import SimConfig, build_app
    async with TestClient(TestServer(build_app(SimConfig(port=0)))) as c:
        r = await c.post("/sim/fault", json={"mode": "user_error", "rate": 1, "min_prompt_tokens": 0})
        assert (await r.json())["mode"] == "user_error"
        body = {"model": "sim-model", "prompt": "hello", "max_tokens": 1}
        assert (await c.post("/v1/completions", json=body)).status == 500
        probe = await c.post("/v1/completions", json=body, headers={"x-sentinel-probe": "1"})
        assert probe.status == 200
        r = await c.post("/sim/fault", json={"mode": "load_slow", "knee": 3})
        assert (await r.json())["knee"] == 3
        assert (await c.post("/sim/fault", json={"mode": "load_slow", "knee": 0})).status == 400


def test_a_busy_node_is_held_not_ejected_whatever_its_real_traffic_errors():
    """A long prefill: the node is DEGRADED by load (its probe timed out with progress moving) and
    Envoy's per-try timeouts of the requests queued behind it arrive as LRS errors. Load is not
    failure (CI caught 8 of 13 'failed' requests ejecting such a node); a node DEGRADED by a
    failure, REFUSING aside, is ejected as any other."""
    busy = replace(hm.initial("c", 0.0), state=hm.NodeState.DEGRADED)
    pending = replace(healthy("d"), probe=replace(healthy("d").probe, busy_timeout_s=1.0))
    refusing = replace(hm.initial("e", 0.0), state=hm.NodeState.REFUSING)
    failed = replace(busy, node_id="f", probe=replace(busy.probe, degraded_not_busy=True))
    nodes = [(n, healthy(n), Evidence(40, 0, 1, 10.0)) for n in "abghi"]  # most nodes fine
    nodes += [("c", busy, Evidence(1, 12, 1, 10.0)),
             ("d", pending, Evidence(0, 13, 1, 10.0)), ("e", refusing, Evidence(0, 13, 1, 10.0)),
             ("f", failed, Evidence(1, 12, 1, 10.0))]
    v = traffic_verdicts(nodes, CFG, 100.0)
    assert list(v.eject) == ["f"]
    assert sorted(v.held) == ["c", "d", "e"]
    assert all(v.held[n].endswith("not ejected: busy (its own evidence shows load)") for n in "cde")


def test_with_min_reporters_one_reporters_failures_are_held_and_two_eject_naming_them():
    two = TrafficEjectionConfig(min_reporters=2)
    peers = [(n, healthy(n), Evidence(40, 0, 2, 10.0)) for n in "ab"]
    alone = peers + [("c", healthy("c"), Evidence(0, 20, 2, 10.0, ("envoy-forger",)))]
    v = traffic_verdicts(alone, two, 50.0)
    assert not v.eject and v.held["c"].endswith("not ejected: failures seen by 1 reporter(s), min_reporters 2")
    assert "failures seen by envoy-forger (100 % failed vs peers' 0.0 %" in v.held["c"]
    assert list(traffic_verdicts(alone, CFG, 50.0).eject) == ["c"]  # min_reporters 1: one is enough
    both = peers + [("c", healthy("c"), Evidence(1, 24, 2, 10.0, ("envoy-1", "envoy-2")))]
    v = traffic_verdicts(both, two, 50.0)
    assert not v.held and "across 2 Envoys, failures seen by envoy-1, envoy-2 (96 % failed" in v.eject["c"]
    many = peers + [("c", healthy("c"), Evidence(1, 24, 5, 10.0, tuple(f"envoy-{i}" for i in range(5))))]
    assert "seen by envoy-0, envoy-1, envoy-2 and 2 more (" in traffic_verdicts(many, two, 50.0).eject["c"]


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60), st.sets(st.sampled_from("wxyz"))),
                min_size=1, max_size=6), st.integers(1, 4))
def test_no_node_is_ejected_on_fewer_failing_reporters_than_min_reporters(rows, min_reporters):
    cfg = TrafficEjectionConfig(min_reporters=min_reporters)
    nodes = [(f"n{i}", healthy(f"n{i}"), Evidence(ok, bad, 4, 10.0, tuple(sorted(who))))
             for i, (ok, bad, who) in enumerate(rows)]
    evidence = {nid: ev for nid, _, ev in nodes}
    for nid in traffic_verdicts(nodes, cfg, 100.0).eject:
        assert min_reporters == 1 or len(evidence[nid].failing) >= min_reporters


@given(st.integers(0, 60), st.integers(0, 60), st.floats(0.001, 0.999))
def test_the_failure_p_value_is_the_exact_binomial_tail(k, extra, rate):
    n = k + extra
    exact = sum(math.comb(n, j) * rate ** j * (1 - rate) ** (n - j) for j in range(k, n + 1))
    assert math.isclose(failure_p_value(k, n, rate), min(1.0, exact), rel_tol=1e-6, abs_tol=1e-12)


@pytest.mark.parametrize("n", [10, 20, 30, 50, 100, 150, 300, 500, 1500, 5000])
def test_a_one_percent_node_is_never_ejected_at_any_volume_among_clean_peers(n):
    # the fewest failures in n requests that eject a node among peers at 0 %, and the chance a
    # node truly failing 1 % shows that many in one window: 1 to 50 req/s per node over the 10 s
    # window is n = 10..500 (and past it); a 5-minute run holds ~30 independent windows
    k_eject = next(k for k in range(1, n + 1) if failure_p_value(k, n, CFG.tolerance) <= CFG.confidence_p)
    assert failure_p_value(k_eject, n, 0.01) * 30 < 0.01
    peers = [(p, healthy(p), Evidence(n, 0, 3, 10.0)) for p in "ab"]
    below = peers + [("x", healthy("x"), Evidence(n - (k_eject - 1), k_eject - 1, 3, 10.0))]
    assert not traffic_verdicts(below, CFG, 50.0).eject


def test_a_node_failing_its_long_prompts_is_ejected_from_ten_requests():
    # 35 % of its traffic fails: among clean peers, 4 of 10 is already significant
    peers = [(p, healthy(p), Evidence(30, 0, 3, 10.0)) for p in "ab"]
    assert list(traffic_verdicts(peers + [("x", healthy("x"), Evidence(6, 4, 3, 10.0))], CFG, 50.0).eject) == ["x"]
    assert not traffic_verdicts(peers + [("x", healthy("x"), Evidence(9, 1, 3, 10.0))], CFG, 50.0).eject


def test_a_query_of_death_every_node_fails_alike_ejects_none_and_names_the_cluster_failure():
    # every node fails prompts over N tokens, ~65 % of the traffic, one node a little worse
    nodes = [(f"n{i}", healthy(f"n{i}"), Evidence(35 - i, 65 + i, 3, 10.0)) for i in range(3)]
    v = traffic_verdicts(nodes, CFG, 50.0)
    assert not v.eject
    (cf,) = v.cluster_failure
    assert (cf.scope, cf.failing, cf.nodes) == ("cluster", 3, 3) and 0.64 < cf.pooled_ratio < 0.68
    assert cf.describe().startswith("3 of 3 nodes with traffic in the cluster fail real requests alike (66 %")


def test_a_failure_of_one_priority_is_judged_within_it_and_one_locality_is_its_nodes():
    # priority 0 serves, all its nodes fail alike; priority 1 serves its own share cleanly
    rows = [(f"p0-{i}", healthy(f"p0-{i}"), Evidence(10, 40, 3, 10.0)) for i in range(3)]
    rows += [(f"p1-{i}", healthy(f"p1-{i}"), Evidence(50, 0, 3, 10.0)) for i in range(4)]
    prio = {nid: int(nid[1]) for nid, _, _ in rows}
    v = traffic_verdicts(rows, CFG, 100.0, prio)
    assert not v.eject and [(f.scope, f.failing, f.nodes) for f in v.cluster_failure] == [("priority 0", 3, 3)]
    # the same three failing in one locality beside four clean nodes of the same priority: theirs
    assert sorted(traffic_verdicts(rows, CFG, 100.0).eject) == ["p0-0", "p0-1", "p0-2"]


def test_the_older_ratio_keys_are_accepted_ignored_and_named_in_a_note():
    from xds_server.config import LrsConfig
    from xds_server.config.load import lrs_notes

    lrs = LrsConfig(traffic_ejection={"stdev_factor": 1.9, "failure_ratio": 0.5, "min_requests": 10})
    notes = lrs_notes(lrs, None, "127.0.0.1:18000")
    assert [n.split(" is ")[0] for n in notes] == ["lrs.traffic_ejection.failure_ratio",
                                                   "lrs.traffic_ejection.stdev_factor"]
    assert all("deprecated and ignored" in n for n in notes)
