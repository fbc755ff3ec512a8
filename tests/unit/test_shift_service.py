"""Gated shifts in a control plane driven in memory (xds_server.load.gated_shifts): the published
assignment and Cluster at each step, gates from LRS totals, bad input refused with the field named
and nothing running changed, cancel restores the bytes from before, a restart resumes the step."""
from __future__ import annotations

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from xds_server.config import parse_config
from xds_server.load.aggregate import Counts
from xds_server.load.gated_shifts import ShiftRequestError
from xds_server.probing.memory import InMemoryProbes
from xds_server.process.clock import ManualClock
from xds_server.server import ControlPlane
from xds_server.xds.resources import CLA_TYPE_URL, CLUSTER_TYPE_URL

GATES = {"min_requests": 20, "wilson_z": 1.0, "max_error_ratio": 0.05, "fail_windows": 2,
         "max_latency_increase": 1.0}


def _cfg(tmp_path, **shift) -> dict:
    return {
        "xds": {"listen": "127.0.0.1:0", "coalesce_window_ms": 0, "warmup_timeout_ms": 5000},
        "admin": {"listen": "127.0.0.1:0", "token": "t"},
        "health": {"failure_detector": "count", "ramp_start_percent": 100.0},
        "shift": {**GATES, "state_path": str(tmp_path / "shifts.json"), **shift},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.1:{8001 + i}", "probe_address": f"127.0.0.1:{9001 + i}",
             "priority": i // 2, "locality": {"region": "us" if i < 2 else "eu"}} for i in range(4)]}],
    }


def _up(cfg: dict) -> tuple[ControlPlane, ManualClock]:
    clock, probes = ManualClock(), InMemoryProbes()
    cp = ControlPlane(parse_config(cfg), clock=clock, probe_sources=probes)
    cp.open()
    for _ in range(20):
        for nid in cp.core.node_cfg:
            probes[nid].heartbeat()
            probes[nid].probe(ttft_ms=20.0)
        clock.advance(0.1)
    return cp, clock


def _cla(cp: ControlPlane) -> endpoint_pb2.ClusterLoadAssignment:
    return endpoint_pb2.ClusterLoadAssignment.FromString(cp.cache.resources(CLA_TYPE_URL)["llm"].any.value)


def _cluster(cp: ControlPlane) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster.FromString(cp.cache.resources(CLUSTER_TYPE_URL)["llm"].any.value)


def _split(cp: ControlPlane) -> dict[int, dict[str, int]]:
    """priority -> node ids in it joined -> locality weight (0: none)."""
    out: dict[int, dict[str, int]] = {}
    for lle in _cla(cp).endpoints:
        ids = ",".join(e.endpoint.hostname for e in lle.lb_endpoints)
        out.setdefault(lle.priority, {})[ids] = lle.load_balancing_weight.value
    return out


def _traffic(cp: ControlPlane, ok: int, err: int) -> None:
    for nid in ("n2", "n3"):
        t = cp.load.aggregator.totals.get(("llm", nid), Counts())
        cp.load.aggregator.totals[("llm", nid)] = Counts(t.issued + ok + err, t.succeeded + ok, t.errored + err)


def test_steps_gates_restart_and_cancel(tmp_path):
    cfg = _cfg(tmp_path)
    cp, clock = _up(cfg)
    before_cluster = _cluster(cp).SerializeToString()
    assert _split(cp) == {0: {"n0,n1": 0}, 1: {"n2,n3": 0}}
    v = cp.shifts.begin("llm", {"to": 1, "step_percent": 25, "every": "10s"})
    clock.advance(0.0)  # the publish the shift asked for (coalescing window 0)
    assert v["phase"] == "stepping" and v["share_percent"] == 25 and v["next_decision_in_s"] == 10.0
    assert _cluster(cp).common_lb_config.HasField("locality_weighted_lb_config")
    assert _split(cp) == {0: {"n0,n1": 7500, "n2,n3": 2500}}
    # a window with too little data holds, and says so
    _traffic(cp, 5, 0)
    clock.advance(10.0)
    cp.shifts.tick()
    v = cp.shifts.view("llm")
    assert v["phase"] == "holding" and v["share_percent"] == 25 and "too little data: 10 of 20" in v["reason"]
    # a clean window advances
    _traffic(cp, 50, 0)
    clock.advance(10.0)
    cp.shifts.tick()
    clock.advance(0.0)
    assert cp.shifts.view("llm")["share_percent"] == 50 and _split(cp) == {0: {"n0,n1": 5000, "n2,n3": 5000}}
    # one failed window does not roll back (fail_windows 2); the second in a row does
    _traffic(cp, 30, 20)
    clock.advance(10.0)
    cp.shifts.tick()
    v = cp.shifts.view("llm")
    assert v["share_percent"] == 50 and v["consecutive_failures"] == 1 and v["last_gate"]["error_gate"] == "fail"
    # restart mid-shift: the new process publishes the same step
    cp2, clock2 = _up(cfg)
    clock2.advance_to(clock.now())  # the wall clock goes on
    v2 = cp2.shifts.view("llm")
    assert (v2["phase"], v2["share_percent"], v2["consecutive_failures"]) == ("stepping", 50, 1)
    assert _split(cp2) == {0: {"n0,n1": 5000, "n2,n3": 5000}}
    _traffic(cp2, 30, 20)
    clock2.advance(10.0)
    cp2.shifts.tick()
    clock2.advance(0.0)
    v2 = cp2.shifts.view("llm")
    assert v2["phase"] == "rolled_back" and v2["share_percent"] == 25 and v2["rollbacks"] == 1
    assert [e.kind for e in cp2.events.recent(10) if e.kind.startswith("shift_")][-1] == "shift_rolled_back"
    # bad input: refused naming the field, nothing running changes
    for body, status, field in [({"to": 1}, 409, "cluster"),
                                ({"to": 7}, 409, "cluster")]:
        with pytest.raises(ShiftRequestError) as e:
            cp2.shifts.begin("llm", body)
        assert (e.value.status, e.value.field) == (status, field)
    with pytest.raises(ShiftRequestError) as e:
        cp2.shifts.begin("nope", {"to": 1})
    assert (e.value.status, e.value.field) == (404, "cluster")
    assert cp2.shifts.view("llm")["share_percent"] == 25
    # cancel: the placement from before the shift, and its Cluster byte for byte
    assert cp2.shifts.command("llm", "cancel")["phase"] == "cancelled"
    clock2.advance(0.0)
    # (node health differs: the clock ran 30 s without heartbeats; the placement is what a shift changes)
    assert _split(cp2) == {0: {"n0,n1": 0}, 1: {"n2,n3": 0}}
    assert _cluster(cp2).SerializeToString() == before_cluster
    with pytest.raises(ShiftRequestError) as e:
        cp2.shifts.command("llm", "pause")
    assert e.value.status == 409 and "cancelled" in e.value.message
    for c in (cp, cp2):
        c.core.end()


@pytest.mark.parametrize(("body", "field"), [
    ({"to": "mars"}, "to"), ({"to": 5}, "to"), ({"to": 1, "step_percent": 0}, "step_percent"),
    ({"to": 1, "step_percent": -5}, "step_percent"), ({"to": 1, "step_percent": 101}, "step_percent"),
    ({"to": 1, "every": "soon"}, "every_s"), ({"to": 1, "every_s": -1}, "every_s"), ({"to": 0}, "to"),
    ({}, "to"), ({"to": 1, "hard": "yes"}, "hard"), ({"to": 1, "to_kind": "zone"}, "to_kind"), ([], "body"),
])
def test_bad_input_names_the_field(tmp_path, body, field):
    cp, _ = _up(_cfg(tmp_path))
    before = _cla(cp).SerializeToString()
    with pytest.raises(ShiftRequestError) as e:
        cp.shifts.begin("llm", body)
    assert e.value.status == 400 and e.value.field == field and e.value.message.startswith(field.split("_s")[0])
    assert cp.shifts.view("llm") is None and _cla(cp).SerializeToString() == before
    cp.core.end()


def test_hard_switch_and_region_shift_back(tmp_path):
    cp, clock = _up(_cfg(tmp_path))
    v = cp.shifts.begin("llm", {"to": "eu", "hard": True})
    clock.advance(0.0)
    assert v["phase"] == "done" and v["share_percent"] == 100
    assert _split(cp) == {0: {"n2,n3": 0}, 1: {"n0,n1": 0}}  # eu primary now, us its failover
    assert not _cluster(cp).common_lb_config.HasField("locality_weighted_lb_config")
    closing = {e.endpoint.hostname: dict(e.metadata.filter_metadata["sentinel"]) for lle in _cla(cp).endpoints
               for e in lle.lb_endpoints if "sentinel" in e.metadata.filter_metadata}
    assert closing == {"n0": {"connection": "close"}, "n1": {"connection": "close"}}  # the old path closes
    # the gated shift back to us starts from the layout the hard switch left
    v = cp.shifts.begin("llm", {"to": "us", "step_percent": 10, "every_s": 5})
    clock.advance(0.0)
    assert v["share_percent"] == 10 and _split(cp) == {0: {"n2,n3": 9000, "n0,n1": 1000}}
    assert not any("sentinel" in e.metadata.filter_metadata for lle in _cla(cp).endpoints for e in lle.lb_endpoints)
    summary = cp.view.cluster_summaries()[0]["shift"]  # /clusters and the dashboard's /live state
    assert (summary["phase"], summary["share_percent"]) == ("stepping", 10)
    assert summary["to"] == {"kind": "region", "value": "us"}
    cp.core.end()


def test_request_class_clusters_follow_the_locality_weighting(tmp_path):
    cfg = _cfg(tmp_path)
    cfg["lrs"] = {"shed": {"classes": {"enabled": True}}}
    cp, clock = _up(cfg)
    names = sorted(n for n in cp.cache.resources(CLUSTER_TYPE_URL) if n.startswith("llm"))
    assert len(names) == 3, names  # llm and its two class clusters

    def weighted() -> dict[str, bool]:
        return {n: cluster_pb2.Cluster.FromString(cp.cache.resources(CLUSTER_TYPE_URL)[n].any.value)
                .common_lb_config.HasField("locality_weighted_lb_config") for n in names}

    cp.shifts.begin("llm", {"to": 1, "step_percent": 25, "every_s": 10})
    clock.advance(0.0)
    assert weighted() == dict.fromkeys(names, True)
    cp.shifts.command("llm", "cancel")
    clock.advance(0.0)
    assert weighted() == dict.fromkeys(names, False)
    cp.core.end()
