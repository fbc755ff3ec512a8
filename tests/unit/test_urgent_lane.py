"""The urgent lane: the publish armed for a node out on hard evidence, early or after a quiet gap,
takes that node out of the last assignment (no policy walk over the cluster); cluster policy
decides the rest one gap later. Never while fail-static holds, nor when no node would stay routed."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st
from test_control_core import all_healthy, config, in_memory, slow_builds

from xds_server.config import parse_config
from xds_server.control.publish import PublishPlanner, Urgency, loss_spread_s
from xds_server.health import model as hm
from xds_server.policy.cluster_routing import FailStaticState

IDS = ["n0", "n1", "n2"]


def healthy(nid: str) -> hm.NodeHealth:
    return replace(hm.initial(nid, 0.0), state=hm.NodeState.HEALTHY, reason="ok")


def lost(nid: str) -> hm.NodeHealth:
    return replace(hm.initial(nid, 0.0), state=hm.NodeState.UNHEALTHY, reason="GPU fatal event: Xid 79")


def planner_config(keepalive_ms: int = 30, ping_timeout_ms: int = 20) -> dict:
    """Three nodes, a 5 ms window; a freeze's streams lost within keepalive + ping timeout (50 ms by
    default here: under the 60 ms gap of a 20 ms build, so the gap alone places the decision)."""
    return {**config(xds={"coalesce_window_ms": 5}),
            "probe": {"dial_in": {"keepalive": f"{keepalive_ms}ms", "ping_timeout": f"{ping_timeout_ms}ms"}}}


def planner_after_a_publish(cfg: dict | None = None,
                            ) -> tuple[PublishPlanner, dict[str, hm.NodeHealth], dict[str, hm.Routing]]:
    """A planner that published all three nodes HEALTHY at t=1.0 in a 20 ms build (gap 60 ms)."""
    p = PublishPlanner(parse_config(cfg or planner_config()))
    p.gate_open.add("llm")
    health = {i: healthy(i) for i in IDS}
    p.mark_dirty("llm", True, 1.0)
    out = p.publish(1.0, health, FailStaticState(), 0.0)
    p.last_build_s = 0.02
    return p, health, dict(out[0].routing)


def two_clusters_after_a_publish() -> tuple[PublishPlanner, dict[str, hm.NodeHealth], dict[str, hm.Routing]]:
    """A planner of "llm" (n0-n2) and "other" (m0, m1) that published them all HEALTHY at t=1.0 in a
    20 ms build (gap 60 ms)."""
    cfg = planner_config()
    cfg["clusters"].append({"name": "other", "nodes": [
        {"id": f"m{i}", "address": f"127.0.0.1:{8101 + i}"} for i in range(2)]})
    p = PublishPlanner(parse_config(cfg))
    health = {i: healthy(i) for i in (*IDS, "m0", "m1")}
    for c in ("llm", "other"):
        p.mark_dirty(c, True, 1.0)
    published = {k: v for cp in p.publish(1.0, health, FailStaticState(), 0.0) for k, v in cp.routing.items()}
    p.built(0.02)
    return p, health, published


def test_an_early_publish_is_the_last_assignment_with_the_lost_node_out_and_the_decision_follows_a_gap_later():
    p, health, published = planner_after_a_publish()
    health["n2"] = lost("n2")
    assert p.mark_dirty("llm", True, 1.01, Urgency.URGENT, "n2") == 1.01
    [patch] = p.publish(1.01, health, FailStaticState(), 0.0, published)
    assert patch.patched == ("n2",) and patch.events == ()
    assert patch.routing["n2"] == hm.Routing(100, hm.RoutingStatus.UNHEALTHY)
    assert all(patch.routing[i] is published[i] for i in ("n0", "n1"))
    assert p.why_not_routed["n2"] == "UNHEALTHY: GPU fatal event: Xid 79"
    assert p.history("llm").before(1.02) is patch.routing          # what Envoy had, for fail-static
    assert p.dirty == {"llm"} and abs(p.follow_up() - 1.07) < 1e-9  # the decision: one gap after the patch
    [full] = p.publish(1.07, health, FailStaticState(), 0.0, dict(patch.routing))
    assert full.patched == () and full.routing["n2"].health_status == "UNHEALTHY" and not p.dirty


def test_a_second_loss_is_patched_after_the_patch_s_own_gap_and_the_decision_stays_anchored_at_the_first():
    p, health, published = planner_after_a_publish()               # full at 1.0, 20 ms: gap 60 ms
    health["n1"] = lost("n1")
    p.mark_dirty("llm", True, 1.01, Urgency.URGENT, "n1")
    [a] = p.publish(1.01, health, FailStaticState(), 0.0, published)
    p.built(0.002)                                                  # a patch of 2 ms
    assert a.patched == ("n1",) and abs(p.follow_up() - 1.07) < 1e-9
    health["n2"] = lost("n2")
    at = p.mark_dirty("llm", True, 1.012, Urgency.URGENT, "n2")
    assert abs(at - 1.016) < 1e-9                                   # 3 x 2 ms after the patch, not 60 ms
    [b] = p.publish(1.016, health, FailStaticState(), 0.0, dict(a.routing))
    p.built(0.002)
    assert b.patched == ("n2",) and b.routing["n0"].health_status == "HEALTHY"
    assert abs(p.follow_up() - 1.07) < 1e-9                         # a later patch never pushes the decision
    [full] = p.publish(1.07, health, FailStaticState(), 0.0, dict(b.routing))  # early to b, but due
    assert full.patched == () and not p.dirty and p.last_build_s == 0.02


def test_the_decision_waits_out_a_freeze_s_spread_so_its_next_lost_node_is_patched_not_stuck_behind_it():
    # a frozen host's streams are each cut at their own next PING: all within keepalive of the first.
    # At 2,000 nodes its second node waited up to ~55 ms behind the first one's decision
    # (benchmarks/RESULTS.md); keepalive 90 + ping timeout 60: no decision for 150 ms after a patch
    p, health, published = planner_after_a_publish(planner_config(90, 60))   # gap 60 ms
    health["n1"] = lost("n1")
    p.mark_dirty("llm", True, 1.2, Urgency.URGENT, "n1")
    [a] = p.publish(1.2, health, FailStaticState(), 0.0, published)
    p.built(0.002)
    assert a.patched == ("n1",) and abs(p.follow_up() - 1.35) < 1e-9   # not at the gap (1.26)
    assert p.mark_dirty("llm", True, 1.27) is None                       # another change waits for it
    health["n2"] = lost("n2")
    assert abs(p.mark_dirty("llm", True, 1.29, Urgency.URGENT, "n2") - 1.29) < 1e-9  # the freeze's next node
    [b] = p.publish(1.29, health, FailStaticState(), 0.0, dict(a.routing))
    p.built(0.002)
    assert b.patched == ("n2",) and abs(p.follow_up() - 1.35) < 1e-9     # still anchored at the first patch
    [full] = p.publish(1.35, health, FailStaticState(), 0.0, dict(b.routing))
    assert full.patched == () and not p.dirty and p.follow_up() is None


def test_a_change_after_the_deferred_decision_is_due_again_by_the_gap_alone():
    p, health, published = planner_after_a_publish(planner_config(90, 60))
    health["n1"] = lost("n1")
    p.mark_dirty("llm", True, 1.2, Urgency.URGENT, "n1")
    [a] = p.publish(1.2, health, FailStaticState(), 0.0, published)
    p.built(0.002)
    p.follow_up()
    [full] = p.publish(1.35, health, FailStaticState(), 0.0, dict(a.routing))
    p.built(0.02)
    assert full.patched == () and abs(p.mark_dirty("llm", True, 1.36) - 1.41) < 1e-9  # a gap after the decision


def test_the_full_decision_is_taken_at_once_under_fail_static_when_none_would_stay_routed_or_when_asked_directly():
    fs = FailStaticState(active=True, since_s=1.0, reason="burst", burst_start_s=1.0)
    for case in ("fail_static", "none_left", "direct"):
        p, health, published = planner_after_a_publish()
        if case == "none_left":
            published = {**published, "n0": hm.Routing(100, "UNHEALTHY"), "n1": hm.Routing(100, "DRAINING")}
        health["n2"] = lost("n2")
        p.mark_dirty("llm", True, 1.01, Urgency.URGENT, "n2")
        [out] = p.publish(1.01, health, fs if case == "fail_static" else FailStaticState(), 0.0,
                          None if case == "direct" else published)
        assert out.patched == () and not p.dirty, case
        assert out.held is (case == "fail_static"), case


def test_a_loss_after_a_quiet_gap_is_patched_too_and_the_decision_follows_a_gap_later():
    # at 2,000 nodes a full decision holds the loop 34-69 ms under load: our read of a lost stream
    # -> the publish with the node out, median 55 ms that way, 32 ms patched (benchmarks/RESULTS.md)
    p, health, published = planner_after_a_publish()               # full at 1.0, 20 ms: gap 60 ms
    health["n2"] = lost("n2")
    assert p.mark_dirty("llm", True, 1.2, Urgency.URGENT, "n2") == 1.2   # quiet since: due at once
    [patch] = p.publish(1.2, health, FailStaticState(), 0.0, published)
    assert patch.patched == ("n2",) and patch.routing["n2"].health_status == "UNHEALTHY"
    assert all(patch.routing[i] is published[i] for i in ("n0", "n1"))
    p.built(0.002)
    assert p.dirty == {"llm"} and abs(p.follow_up() - 1.26) < 1e-9  # the decision: one gap after the patch
    [full] = p.publish(1.26, health, FailStaticState(), 0.0, dict(patch.routing))
    assert full.patched == () and not p.dirty


def test_a_patch_beside_a_full_decision_anchors_the_decision_as_a_patch_alone_does():
    # cluster "other" loses its last routed node (no patch: the full decision at once) while "llm"
    # is patched: llm's decision still follows one gap after that patch, not after later patches
    p, health, published = two_clusters_after_a_publish()          # gap 60 ms
    published["m1"] = hm.Routing(100, hm.RoutingStatus.UNHEALTHY)   # m0 is other's last routed node
    health["m0"], health["n1"] = lost("m0"), lost("n1")
    p.mark_dirty("other", True, 1.01, Urgency.URGENT, "m0")
    p.mark_dirty("llm", True, 1.01, Urgency.URGENT, "n1")
    out = p.publish(1.01, health, FailStaticState(), 0.0, published)
    assert {o.cluster: o.patched for o in out} == {"other": (), "llm": ("n1",)}
    p.built(0.02)
    published.update({k: v for o in out for k, v in o.routing.items()})
    health["n2"] = lost("n2")
    assert abs(p.mark_dirty("llm", True, 1.03, Urgency.URGENT, "n2") - 1.07) < 1e-9
    [decision] = p.publish(1.07, health, FailStaticState(), 0.0, published)  # the decision, not a patch
    assert decision.cluster == "llm" and decision.patched == () and not p.dirty
    assert decision.routing["n2"].health_status == "UNHEALTHY"


def test_an_early_publish_with_nothing_to_take_out_is_the_full_decision_never_an_empty_publish():
    p, health, published = planner_after_a_publish()
    health["n2"] = lost("n2")
    p.mark_dirty("llm", True, 1.01, Urgency.URGENT, "n2")
    already_out = {**published, "n2": hm.Routing(100, "UNHEALTHY")}
    [out] = p.publish(1.01, health, FailStaticState(), 0.0, already_out)
    assert out.patched == () and out.routing["n2"].health_status == "UNHEALTHY" and not p.dirty


def test_a_cluster_without_a_lost_node_waits_for_the_decision_while_another_is_patched():
    p, health, published = two_clusters_after_a_publish()
    p.mark_dirty("other", True, 1.01)                               # a change of another kind
    health["n2"] = lost("n2")
    p.mark_dirty("llm", True, 1.01, Urgency.URGENT, "n2")
    [patch] = p.publish(1.01, health, FailStaticState(), 0.0, published)
    assert patch.cluster == "llm" and patch.patched == ("n2",)
    assert p.dirty == {"llm", "other"} and abs(p.follow_up() - 1.07) < 1e-9
    assert {out.cluster for out in p.publish(1.07, health, FailStaticState(), 0.0, published)} == {"llm", "other"}


def test_the_relay_feed_hears_the_lost_node_from_the_patch():
    cp, clock, probes = in_memory(config(n=3, xds={"coalesce_window_ms": 5, "warmup_timeout_ms": 0}))
    all_healthy(cp, clock, probes)
    heard = []
    cp.routing_listeners.append(heard.append)
    patches = []
    write = cp.core.on_publish

    def recorded(p):
        patches.append(p.patched)
        write(p)

    cp.core.on_publish = recorded
    slow_builds(cp, clock, 0.02)                           # the gap: 60 ms, so the next one comes early
    cp.core.mark_dirty("llm")
    cp.core.publish()
    heard.clear()
    probes["n1"].heartbeat(gpu_fatal="Xid 79")
    clock.advance(0.01)
    assert patches[-1] == ("n1",)
    assert [(c.node_id, c.routable, c.eds_health_status) for c in heard] == [("n1", False, "UNHEALTHY")]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lose", "soft", "clear", "wait"]), st.integers(0, 4),
                          st.floats(0.0, 0.08)), min_size=1, max_size=25),
       st.floats(0.0, 0.05))
def test_prop_a_patch_only_takes_nodes_out_and_once_quiet_envoy_has_the_policy_decision(ops, build_s):
    cp, clock, probes = in_memory(config(n=5, xds={"coalesce_window_ms": 5, "warmup_timeout_ms": 0}))
    spread = loss_spread_s(cp.config)
    all_healthy(cp, clock, probes)
    write = cp.core.on_publish
    seen: list[tuple[tuple[str, ...], set[str], set[str]]] = []

    starts: list[tuple[float, bool]] = []                   # (publish time, a patch)

    def checked(p):
        before = {i for i, r in cp.core.routing.items() if r.health_status == "HEALTHY"}
        seen.append((p.patched, before, {i for i, r in p.routing.items() if r.health_status == "HEALTHY"}))
        starts.append((clock.now(), bool(p.patched)))
        write(p)
        clock._now += build_s                                # a build takes the loop's time

    cp.core.on_publish = checked
    fields: dict[str, dict] = {}
    for op, i, dt in ops:
        nid = f"n{i}"
        if op == "lose":
            fields[nid] = {"gpu_fatal": "Xid 79"}
        elif op == "soft":
            fields[nid] = {"requests_waiting": 500.0}
        elif op == "clear":
            fields.pop(nid, None)
        for n in cp.core.node_cfg:
            probes[n].heartbeat(**fields.get(n, {}))
        clock.advance(dt)
    for _ in range(10):                                      # quiet: heartbeats only
        for n in cp.core.node_cfg:
            probes[n].heartbeat(**fields.get(n, {}))
        clock.advance(0.1)
    for patched, before, after in seen:
        if patched:
            assert after == before - set(patched) and after, (patched, before, after)
    first_patch = None             # the decision follows the first patch within a gap, or a freeze's spread
    for at, patch in starts:
        if patch and first_patch is None:
            first_patch = at
        elif not patch and first_patch is not None:
            assert at <= first_patch + max(0.005, 3 * build_s, spread) + build_s + 1e-6, (first_patch, at)
            first_patch = None
    assert not cp.core.planner.dirty
    published = dict(cp.core.routing)
    cp.core.mark_dirty("llm")
    cp.core.publish()                                        # the full decision, asked directly
    assert cp.core.routing == published
