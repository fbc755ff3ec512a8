"""How soon a change is published. A node leaving routing on hard evidence: after the coalescing
window, not after the build-ratio gap a large cluster's publishes are otherwise spaced by; early
publishes never follow each other, so a burst of them still leaves the loop half of its time. A
change of a node's measures alone (RTT, TTFT, GPU free memory): at most every
``xds.publish.measure_refresh``."""
from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st
from test_control_core import all_healthy, config, in_memory, published, slow_builds

from xds_server.config import HealthConfig, parse_config
from xds_server.control.publish import PublishPlanner, Urgency
from xds_server.health import model as hm
from xds_server.health.pipeline import leaves_routing, routing_key
from xds_server.policy.cluster_routing import FailStaticState

CFG = HealthConfig()


def _planner(window_ms: float = 5, ratio: float = 3, refresh: str = "1s") -> PublishPlanner:
    p = PublishPlanner(parse_config(config(xds={"coalesce_window_ms": window_ms, "publish_build_ratio": ratio,
                                                "publish": {"measure_refresh": refresh}})))
    p.gate_open.add("llm")
    return p


def _publish(p: PublishPlanner, now_s: float, build_s: float) -> None:
    """What ControlCore.publish does to the planner: publish, then record the build time."""
    health = {n.id: hm.initial(n.id, 0.0) for n in p.config.clusters[0].nodes}
    p.publish(now_s, health, FailStaticState(), 0.0)
    p.last_build_s = build_s


def test_an_urgent_change_is_due_after_the_window_and_an_ordinary_one_after_the_gap():
    p = _planner()
    _publish(p, 1.0, 0.02)                                      # a 20 ms build: gap 60 ms
    assert abs(p.mark_dirty("llm", warm=True, now_s=1.021) - 1.06) < 1e-9
    p.disarm()
    assert p.mark_dirty("llm", warm=True, now_s=1.021, urgency=Urgency.URGENT) == 1.021  # past the window: now
    p.disarm()
    assert abs(p.mark_dirty("llm", warm=True, now_s=1.002, urgency=Urgency.URGENT) - 1.005) < 1e-9  # inside it: its end


def test_an_urgent_change_moves_an_armed_publish_earlier_and_an_ordinary_one_never_does():
    p = _planner()
    _publish(p, 1.0, 0.02)
    assert abs(p.mark_dirty("llm", warm=True, now_s=1.021) - 1.06) < 1e-9
    assert p.mark_dirty("llm", warm=True, now_s=1.022) is None               # armed soon enough
    assert p.mark_dirty("llm", warm=True, now_s=1.03, urgency=Urgency.URGENT) == 1.03    # re-armed earlier
    assert p.mark_dirty("llm", warm=True, now_s=1.031, urgency=Urgency.URGENT) is None   # already as early


def test_after_an_early_publish_the_next_urgent_change_waits_for_the_gap():
    p = _planner()
    _publish(p, 1.0, 0.02)
    assert p.mark_dirty("llm", warm=True, now_s=1.021, urgency=Urgency.URGENT) == 1.021
    _publish(p, 1.021, 0.02)                                    # early: 21 ms after the last, gap 60
    assert p.last_early
    assert abs(p.mark_dirty("llm", warm=True, now_s=1.042, urgency=Urgency.URGENT) - 1.081) < 1e-9
    _publish(p, 1.081, 0.02)                                    # on the gap: not early
    assert not p.last_early
    p.disarm()
    assert p.mark_dirty("llm", warm=True, now_s=1.102, urgency=Urgency.URGENT) == 1.102


def test_a_change_of_measures_alone_waits_for_the_refresh_and_rides_along_with_any_other():
    p = _planner(refresh="1s")
    _publish(p, 1.0, 0.02)
    assert p.mark_dirty("llm", warm=True, now_s=1.1, urgency=Urgency.REFRESH) == 2.0  # a second after
    assert p.mark_dirty("llm", warm=True, now_s=1.2, urgency=Urgency.REFRESH) is None
    assert p.mark_dirty("llm", warm=True, now_s=1.3) == 1.3                        # a state change: now
    _publish(p, 2.5, 0.02)
    p.disarm()
    assert p.mark_dirty("llm", warm=True, now_s=4.0, urgency=Urgency.REFRESH) == 4.0  # after a quiet second
    off = _planner(refresh="0s")
    _publish(off, 1.0, 0.02)
    assert abs(off.mark_dirty("llm", warm=True, now_s=1.01, urgency=Urgency.REFRESH) - 1.06) < 1e-9  # the gap


def test_the_warm_up_gate_holds_an_urgent_change_too():
    p = PublishPlanner(parse_config(config()))
    assert p.mark_dirty("llm", warm=False, now_s=1.0, urgency=Urgency.URGENT) is None


@settings(max_examples=200, deadline=None)
@given(marks=st.lists(st.tuples(st.floats(0.0, 0.15), st.sampled_from(list(Urgency))), min_size=1, max_size=60),
       build_s=st.floats(0.001, 0.06))
def test_prop_every_change_is_published_and_early_publishes_never_follow_each_other(marks, build_s):
    """Changes of any urgency at arbitrary times, every publish taking ``build_s`` of the loop
    (nothing else runs meanwhile). Every change is published, never before it was made and never
    later than its urgency allows; no two early publishes in a row, so publishing takes at most
    half the loop in any burst; an urgent change after a publish on the gap is published within
    the window (or as soon as the loop is free)."""
    p = _planner()
    window, ratio = p.window_s, p.build_ratio
    due: float | None = None
    starts: list[tuple[float, bool]] = []   # (publish start, early)
    t, free_at = 0.0, 0.0
    pending: list[tuple[float, Urgency, bool, float]] = []  # (mark time, urgency, previous early, latest start)

    def run_until(limit: float) -> None:
        nonlocal due, free_at
        while due is not None and due <= limit:
            start = max(due, free_at)
            prev = starts[-1][0] if starts else float("-inf")
            starts.append((start, start < prev + max(window, ratio * p.last_build_s) - 1e-9))
            due = None
            _publish(p, start, build_s)
            free_at = start + build_s
            for m, urgency, prev_early, latest in pending:
                if urgency is Urgency.URGENT and not prev_early:
                    assert start <= max(m, prev + window) + 1e-9
                assert m - 1e-9 <= start <= latest + 1e-9
            pending.clear()

    for gap, urgency in marks:
        t += gap
        run_until(t)
        now = max(t, free_at)  # a change made while a build runs is seen once it ends
        prev = starts[-1] if starts else (float("-inf"), False)
        slowest = max(window, ratio * p.last_build_s, p.refresh_s if urgency is Urgency.REFRESH else 0.0)
        at = p.mark_dirty("llm", warm=True, now_s=now, urgency=urgency)
        if at is not None:
            assert due is None or at < due
            due = at
        assert due is not None and p.scheduled
        pending.append((now, urgency, prev[1], max(now, prev[0] + slowest)))
    run_until(float("inf"))
    assert not pending and not p.dirty
    assert all(not (a[1] and b[1]) for a, b in itertools.pairwise(starts))


def test_leaves_routing_only_on_hard_evidence_from_a_routable_node():
    healthy = hm.NodeHealth("n", hm.NodeState.HEALTHY, "ok", 0.0)
    lost = hm.NodeHealth("n", hm.NodeState.UNHEALTHY, "lost", 1.0)
    queued = hm.NodeHealth("n", hm.NodeState.HEALTHY, "ok", 0.0,
                           engine=hm.Engine(requests_waiting=CFG.load.queue_critical + 1))
    drained = hm.NodeHealth("n", hm.NodeState.HEALTHY, "ok", 0.0, drain=hm.Drain(True, 1.0))
    key = {name: routing_key(nh, CFG) for name, nh in
           {"healthy": healthy, "lost": lost, "queued": queued, "drained": drained}.items()}
    assert leaves_routing(key["healthy"], key["lost"])
    assert leaves_routing(key["queued"], key["lost"])      # soft-blocked, still routable by its own view
    assert not leaves_routing(key["healthy"], key["queued"])  # a soft block: the cap may hold it back
    assert not leaves_routing(key["healthy"], key["drained"])
    assert not leaves_routing(key["lost"], key["lost"])
    assert not leaves_routing(None, key["lost"])


def test_a_node_lost_right_after_a_slow_publish_reaches_envoy_after_the_window_the_decision_a_gap_later():
    """A 2,000-endpoint cluster builds in ~45 ms; at the ratio's 3x a frozen node would stay routed
    up to ~135 ms past its verdict. Lost on hard evidence, it is taken out of the last assignment
    5 ms after the last publish; cluster policy decides everything else (a soft change armed for
    the gap, the cap the lost node now fills) one gap after that."""
    # a frozen host's streams all lost within 20 + 20 ms: under the gap, which alone places the decision
    cp, clock, probes = in_memory({**config(xds={"coalesce_window_ms": 5, "warmup_timeout_ms": 0}),
                                   "probe": {"dial_in": {"keepalive": "20ms", "ping_timeout": "20ms"}}})
    all_healthy(cp, clock, probes)
    at = slow_builds(cp, clock, 0.02)                       # every build takes 20 ms
    cp.core.drain("n0", True, "t")                          # published at once; the next gap: 60 ms
    probes["n1"].heartbeat(requests_waiting=CFG.load.queue_critical + 1)  # soft: armed for the gap
    clock.advance(0.001)
    assert len(at) == 1
    probes["n2"].heartbeat(gpu_fatal="Xid 79")              # hard: engine fatal
    assert cp.health["n2"].state is hm.NodeState.UNHEALTHY
    clock.advance(0.001)
    assert len(at) == 2 and at[1] - at[0] <= 0.02 + 0.005
    assert published(cp) == {"n0": "DRAINING", "n1": "HEALTHY", "n2": "UNHEALTHY"}
    assert cp.core.planner.held_back == {}                  # n1 not judged yet: the last assignment, n2 out
    clock.advance(0.1)
    assert len(at) == 3 and 0.06 - 1e-9 <= at[2] - at[1] <= 0.06 + 0.005
    assert "n1" in cp.core.planner.held_back                # held back: n2 fills the cap
    assert published(cp) == {"n0": "DRAINING", "n1": "HEALTHY", "n2": "UNHEALTHY"}


def test_noisy_rtt_pings_publish_about_once_a_refresh_not_at_every_bucket_change():
    """50 nodes pinged every 100 ms with RTTs of 1-30 ms (their EWMA buckets move at most pings):
    at the default 1 s refresh a few publishes in 3 s; with the refresh off, about one per step."""
    def publishes(refresh: str) -> tuple[int, dict[str, str]]:
        cp, clock, probes = in_memory(config(n=50, xds={"coalesce_window_ms": 5, "warmup_timeout_ms": 0,
                                                        "publish": {"measure_refresh": refresh}}))
        all_healthy(cp, clock, probes)
        rng = random.Random(7)
        write, count = cp.core.on_publish, [0]

        def counted(p):
            count[0] += 1
            write(p)

        cp.core.on_publish = counted
        for step in range(40):  # the first 10: past outlier.min_rtt_samples, the RTTs are judged
            if step == 10:
                count[0] = 0
            for nid in cp.core.node_cfg:
                probes[nid].heartbeat()
                probes[nid].ping(rtt_ms=rng.uniform(1, 30))
            clock.advance(0.1)
        return count[0], published(cp)

    slow, routed = publishes("1s")
    fast, _ = publishes("0s")
    assert set(routed.values()) == {"HEALTHY"}
    assert 1 <= slow <= 4 and fast >= 20


def test_a_publish_computes_a_node_view_again_only_for_a_new_record_or_config():
    cp, clock, probes = in_memory(config(n=4, xds={"coalesce_window_ms": 0, "warmup_timeout_ms": 0}))
    all_healthy(cp, clock, probes)
    planner = cp.core.planner
    cp.core.mark_dirty("llm")
    cp.core.publish()
    before = dict(planner._views)
    probes["n1"].heartbeat(requests_waiting=CFG.load.queue_critical + 1)  # n1: a new record
    cp.core.mark_dirty("llm")
    cp.core.publish()
    after = planner._views
    assert after["n0"] is before["n0"] and after["n1"] is not before["n1"]
    assert after["n1"][2].soft_block.startswith("queue: ")
    assert published(cp)["n1"] == "UNHEALTHY"  # the soft block, published from the new view
