"""Discovery's pure parts over generated inputs: node-set diff, merge with static nodes, pod ->
node, watch events -> pod set, targets file round trip (xds_server.discovery)."""
from __future__ import annotations

import json

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import ClusterConfig, KubernetesDiscoveryConfig, NodeConfig, parse_config
from xds_server.discovery import (
    PodState,
    TargetsError,
    diff_node_sets,
    merge_discovered,
    node_map,
    parse_targets,
    pod_node,
    pods_to_nodes,
)

IDS = st.sampled_from([f"n{i}" for i in range(8)])
PORTS = st.integers(8000, 8003)


@st.composite
def nodes(draw, max_prio: int = 2) -> NodeConfig:
    i = draw(IDS)
    return NodeConfig(id=i, address=f"10.0.0.{draw(st.integers(1, 3))}:{draw(PORTS)}",
                      probe_address=f"10.0.0.{draw(st.integers(1, 3))}:9100",
                      priority=draw(st.integers(0, max_prio)), capacity=draw(st.integers(1, 3)))


def node_sets():
    return st.dictionaries(IDS, st.tuples(st.sampled_from(["a", "b"]), nodes())).map(
        lambda d: {i: (c, n.model_copy(update={"id": i})) for i, (c, n) in d.items()})


@given(node_sets(), node_sets())
def test_diff_partitions_ids_and_readdressed_means_another_address(current, desired):
    d = diff_node_sets(current, desired)
    groups = [set(d.added), set(d.removed), set(d.readdressed), set(d.changed)]
    assert sum(len(g) for g in groups) == len(set().union(*groups))  # disjoint
    assert set(d.added) == desired.keys() - current.keys()
    assert set(d.removed) == current.keys() - desired.keys()
    both = current.keys() & desired.keys()
    for i in both:
        old, new = current[i][1], desired[i][1]
        moved = (old.address, old.probe_address) != (new.address, new.probe_address)
        assert (i in d.readdressed) == moved
        assert (i in d.changed) == (not moved and current[i] != desired[i])
    assert bool(d) == (current != desired)


@given(st.lists(nodes(max_prio=1), max_size=3, unique_by=lambda n: n.id),
       st.dictionaries(st.sampled_from(["a", "b", "zz"]), st.lists(nodes(), max_size=6)))
@settings(max_examples=150)
def test_merge_keeps_static_nodes_and_cluster_invariants(static_nodes, found):
    static_nodes = [n.model_copy(update={"priority": 0}) for n in static_nodes]
    cfg = parse_config({"tls": {"agents": {"mode": "plaintext"}},
                        "clusters": [{"name": "a", "nodes": [n.model_dump() for n in static_nodes]},
                                     {"name": "b"}]})
    merged, problems = merge_discovered(cfg, found)
    got = node_map(merged)
    assert all(got[n.id] == ("a", n) for n in static_nodes)  # static nodes win and stay
    for c in merged.clusters:
        ClusterConfig.model_validate(c.model_dump())  # unique ids, contiguous priorities
    assert len(got) == sum(len(c.nodes) for c in merged.clusters)  # no id in two clusters
    offered = sum(len(v) for k, v in found.items() if k in ("a", "b"))
    assert len(got) - len(static_nodes) + sum(1 for p in problems if "left out" in p) == offered
    assert ("zz" in found) == any("unknown cluster 'zz'" in p for p in problems)


def pod(name: str, rv: int, *, ip: str | None = "10.1.0.1", ready: bool = True, deleting: bool = False,
        zone: str | None = None) -> dict:
    meta = {"name": name, "namespace": "default", "resourceVersion": str(rv), "labels": {"app": "vllm"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T08:00:00Z"
    if zone:
        meta["labels"]["topology.kubernetes.io/zone"] = zone
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "spec": {"containers": [{"name": "m", "ports": [
        {"name": "http", "containerPort": 8000}, {"name": "probe", "containerPort": 9100}]}]}, "status": status}


SPEC = KubernetesDiscoveryConfig(label_selector={"app": "vllm"}, target_port="http", probe_port="probe")


@given(st.sampled_from(["p-0", "p.1", "x" * 129, ""]), st.sampled_from([None, "10.2.3.4", "fd00::7"]),
       st.booleans(), st.booleans(), st.sampled_from([None, "us-east-1a"]),
       st.sampled_from(["http", 8080, "missing"]))
def test_pod_is_a_node_exactly_when_named_placed_ready_and_not_deleting(name, ip, ready, deleting, zone, target):
    spec = SPEC.model_copy(update={"target_port": target, "locality_from": "pod"})
    n = pod_node(pod(name, 1, ip=ip, ready=ready, deleting=deleting, zone=zone), spec)
    usable = 0 < len(name) <= 128 and ip is not None and ready and not deleting and target != "missing"
    assert isinstance(n, NodeConfig) == usable, n
    if usable:
        port = 8000 if target == "http" else 8080
        assert n.id == name and n.address == (f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
        assert n.probe_address.endswith(":9100") and n.locality.zone == (zone or "")
    elif ip is None and 0 < len(name) <= 128 and not deleting:
        assert "podIP" in n


EVENTS = st.lists(st.tuples(st.sampled_from(["ADDED", "MODIFIED", "DELETED", "BOOKMARK"]),
                            st.sampled_from(["a", "b", "c"]), st.booleans()), max_size=25)


def _run(events, truth):
    """Events with growing resourceVersions from 11, and the pods a server holds after them all
    (starting from ``truth``)."""
    out, truth = [], dict(truth)
    for i, (etype, name, ready) in enumerate(events):
        rv = 11 + i
        if etype == "BOOKMARK":
            out.append((etype, {"metadata": {"resourceVersion": str(rv)}}))
            continue
        obj = pod(name, rv, ip=f"10.0.0.{ord(name)}", ready=ready)
        if etype == "DELETED":
            truth.pop(name, None)
        else:
            truth[name] = obj
        out.append((etype, obj))
    return out, truth


@given(EVENTS, st.integers(0, 25))
def test_list_then_events_is_the_servers_pod_set_and_a_replay_changes_nothing(events, cut):
    initial = {"metadata": {"resourceVersion": "10"}, "items": [pod("a", 5), pod("z", 6, ready=False)]}
    evs, truth = _run(events, {"a": pod("a", 5), "z": pod("z", 6, ready=False)})
    state = PodState.listed(initial)
    for etype, obj in evs:
        state = state.apply(etype, obj)
    assert {k: v["metadata"]["resourceVersion"] for k, v in state.pods.items()} == \
           {k: v["metadata"]["resourceVersion"] for k, v in truth.items()}
    if evs:
        assert state.resource_version == evs[-1][1]["metadata"]["resourceVersion"]
    # a watch restarted from an older resourceVersion replays events already applied: no change
    replayed = state
    for etype, obj in evs[cut:]:
        if etype in ("ADDED", "MODIFIED"):
            replayed = replayed.apply(etype, obj)
    assert replayed.pods == state.pods
    nodes, skipped = pods_to_nodes(state.pods, SPEC)
    assert {n.id for n in nodes} | set(skipped) == set(state.pods)


@given(st.lists(nodes(), max_size=5, unique_by=lambda n: n.id), st.booleans())
def test_targets_file_round_trip_yaml_and_json(listed, as_json):
    docs = [n.model_dump() for n in listed]
    text = json.dumps(docs) if as_json else yaml.safe_dump({"nodes": docs})
    assert parse_targets(text, "t.yaml") == tuple(listed)


@given(st.lists(nodes(), min_size=1, max_size=5, unique_by=lambda n: n.id), st.data())
def test_targets_file_with_one_bad_entry_is_rejected_naming_it(listed, data):
    docs = [n.model_dump() for n in listed]
    bad = data.draw(st.integers(0, len(docs) - 1))
    field, value = data.draw(st.sampled_from([("address", "not-an-address"), ("capacity", 0),
                                               ("probe_address", "10.0.0.1:0")]))
    docs[bad][field] = value
    try:
        parse_targets(yaml.safe_dump(docs), "/etc/t.yaml")
    except TargetsError as e:
        assert f"/etc/t.yaml: entry {bad} (id {docs[bad]['id']!r}): {field}:" in str(e)
    else:
        raise AssertionError("a bad entry was accepted")


@given(node_sets(), node_sets(), st.sets(IDS))
def test_reload_plan_drains_what_left_and_undrains_what_came_back(before, after, was_leaving):
    from xds_server.control.reload import plan_reload

    def config(ns):
        return parse_config({"tls": {"agents": {"mode": "plaintext"}},
                             "clusters": [{"name": c, "nodes": [n.model_copy(update={"priority": 0}).model_dump()
                                                                 for _, (cc, n) in sorted(ns.items()) if cc == c]}
                                          for c in ("a", "b")]})

    old, new = config(before), config(after)
    leaving = {i: (old.clusters[0], NodeConfig(id=i, address="10.9.9.9:1", probe_address="10.9.9.9:2"))
               for i in was_leaving if i not in before}
    p = plan_reload(old, leaving, new)
    assert set(p.newly_leaving) == set(before) - set(after) - set(leaving)
    assert set(p.returning) == (set(leaving) | set(before) - set(after)) & set(after)
    assert set(p.leaving) == (set(leaving) | set(before) - set(after)) - set(after)
    assert p.declared.clusters == new.clusters and p.diff.added == tuple(i for i, _ in node_map(new).items()
                                                                          if i not in before)
