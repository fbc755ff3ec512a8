"""A restart keeps what the control plane knew (state file): nodes that were
HEALTHY are routed at full weight at their first heartbeat, an ejected node stays ejected with its
back-off, a drained node stays drained; a stale or broken state file is ignored."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import parse_config
from xds_server.control.state import restore, snapshot, usable_until_s, with_unclaimed
from xds_server.health import model as hm
from xds_server.health.records import ProbeResultKind
from xds_server.probing.memory import InMemoryProbes
from xds_server.process.clock import ManualClock
from xds_server.server import ControlPlane
from xds_server.testing import wait_for


def config(state_path: Path, **state) -> dict:
    return {
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"probation_clean_s": 0.3, "ramp_start_percent": 1, "ramp_step_percent": 1,
                   "ramp_step_s": 1.0},
        "state": {"path": str(state_path), "write_interval_s": 0.1, **state},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.1:{8001 + i}", "probe_address": f"127.0.0.1:{9001 + i}"}
            for i in range(3)]}],
    }


@contextlib.asynccontextmanager
async def running(cfg: dict, silent: set[str] = frozenset()):
    probes = InMemoryProbes()
    cp = ControlPlane(parse_config(cfg), probe_sources=probes)
    await cp.start()

    async def pump() -> None:
        while True:
            for nid, s in list(probes.sources.items()):
                if nid not in silent:
                    s.heartbeat()
            await asyncio.sleep(0.05)

    task = asyncio.create_task(pump())
    try:
        yield cp, probes
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await cp.stop()


async def test_restart_resumes_healthy_at_full_weight_and_keeps_ejection_and_drain(tmp_path):
    path = tmp_path / "state.json"
    cfg = config(path)
    async with running(cfg) as (cp, probes):
        await wait_for(lambda: all(cp.health[n].state.value == "WARMING" for n in ("n0", "n1", "n2")),
                       timeout_s=5.0, step_s=0.02)
        def promoted() -> bool:  # a node still WARMING gets another good probe, as its agent would send
            warming = [n for n in ("n0", "n1", "n2") if cp.health[n].state.value == "WARMING"]
            for n in warming:
                probes[n].probe(ttft_ms=20.0)
            return not warming

        await wait_for(promoted, timeout_s=5.0, step_s=0.2)
        for n in ("n0", "n1", "n2"):
            probes[n].probe(ttft_ms=20.0)
        # ramp: 1 % per 1 s step, so a fresh start is far from full weight for ~100 s
        assert cp.health["n0"].state.value in ("PROBATION", "HEALTHY")
        for _ in range(2):
            probes["n1"].probe(kind=ProbeResultKind.TIMEOUT)
        assert cp.health["n1"].state.value == "UNHEALTHY"
        cp.drain("n2", True, "maintenance")
        n0_before = cp.health["n0"]
        n1_ejection = cp.health["n1"].ejection
    assert path.exists()
    doc = json.loads(path.read_text())
    assert set(doc["nodes"]) == {"n0", "n1", "n2"}

    async with running(cfg) as (cp, probes):
        await wait_for(lambda: cp.routing.get("n0") is not None and cp.routing["n0"].health_status == "HEALTHY",
                       timeout_s=3.0, step_s=0.01)
        assert cp.health["n0"].state == n0_before.state
        assert cp.health["n0"].ramp.percent == pytest.approx(n0_before.ramp.percent)
        assert cp.routing["n1"].health_status == "UNHEALTHY"
        assert cp.health["n1"].state.value == "UNHEALTHY"
        assert cp.health["n1"].ejection.cause == n1_ejection.cause
        assert cp.health["n1"].ejection.clean_period_s == n1_ejection.clean_period_s
        assert cp.health["n2"].effective_state.value == "DRAINING"
        assert cp.routing["n2"].health_status == "DRAINING"
        kinds = [e.reason for e in cp.events.recent(50)]
        assert any(r.startswith("resumed after restart") for r in kinds)


async def test_stale_or_broken_state_file_is_ignored(tmp_path):
    path = tmp_path / "state.json"
    doc = snapshot({"n0": hm.NodeHealth("n0", state=hm.NodeState.HEALTHY)}, 100.0, 1000.0)
    path.write_text(json.dumps(doc))  # written at wall 1000 s: far older than max_age_s
    async with running(config(path)) as (cp, _):
        assert cp.core.restored == {}
    path.write_text("{not json")
    async with running(config(path)) as (cp, _):
        assert cp.core.restored == {}
        await wait_for(lambda: cp.health["n0"].state.value == "WARMING", timeout_s=3.0, step_s=0.02)


def test_restore_names_the_bad_field():
    doc = snapshot({"n0": hm.NodeHealth("n0", state=hm.NodeState.HEALTHY)}, 100.0, 1000.0)
    doc["nodes"]["n0"]["ramp"]["percent"] = "lots"
    with pytest.raises(ValueError, match=r"nodes.n0.ramp.percent"):
        restore(doc, 5.0, 1001.0, 60.0, ["n0"])
    with pytest.raises(ValueError, match="version"):
        restore({"version": 99}, 5.0, 1001.0, 60.0, ["n0"])


times = st.floats(min_value=-1e5, max_value=1e5, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(state=st.sampled_from(sorted(hm.NodeState, key=lambda s: s.value)), since=times, step=times,
       pct=st.floats(0, 100), age=st.floats(0, 60), mono0=times, mono1=times)
def test_snapshot_restore_roundtrip_shifts_times_by_the_elapsed_wall_time(state, since, step, pct, age, mono0, mono1):
    nh = hm.NodeHealth("n0", state=state, since_s=since, ramp=hm.Ramp(pct, step))
    doc = json.loads(json.dumps(snapshot({"n0": nh}, mono0, 1000.0)))
    out = restore(doc, mono1, 1000.0 + age, 60.0, ["n0", "other"])
    if state.value in ("COLD", "WARMING", "DRAINING"):
        assert out == {}
        return
    got = out["n0"]
    assert got.state == state and got.ramp.percent == pct
    assert got.since_s == pytest.approx(since - mono0 + mono1 - age, abs=1e-6)
    assert got.ramp.step_at_s == pytest.approx(step - mono0 + mono1 - age, abs=1e-6)
    assert restore(doc, mono1, 1000.0 + 61.0, 60.0, ["n0"]) == {}


def test_kept_states_wait_for_nodes_found_later_and_are_written_again_until_resumed():
    """Discovered nodes are not configured at the restart: every kept state is read (ids None),
    usable until the document is ``max_age_s`` old, and written again while not resumed."""
    kept_doc = snapshot({"n0": hm.NodeHealth("n0", state=hm.NodeState.UNHEALTHY),
                         "pod-a": hm.NodeHealth("pod-a", state=hm.NodeState.UNHEALTHY)}, 100.0, 1000.0)
    out = restore(kept_doc, 5.0, 1010.0, 60.0, None)
    assert set(out) == {"n0", "pod-a"}
    assert usable_until_s(kept_doc, 5.0, 1010.0, 60.0) == 5.0 + 60.0 - 10.0
    with pytest.raises(ValueError, match="version"):
        usable_until_s({"version": 99}, 5.0, 1010.0, 60.0)
    cold = hm.initial("n0", 5.0)
    drained = dataclasses.replace(hm.initial("n1", 5.0), drain=hm.Drain(True, 6.0))
    heard = dataclasses.replace(hm.initial("n2", 5.0), state=hm.NodeState.WARMING)
    kept = {"n0": out["n0"], "n1": out["n0"], "n2": out["n0"], "pod-a": out["pod-a"]}
    got = with_unclaimed({"n0": cold, "n1": drained, "n2": heard}, kept)
    assert got["n0"] is kept["n0"]            # not heard since the restart: its kept state stands
    assert got["n1"] is drained               # drained by the operator since: the drain is written
    assert got["n2"] is heard                 # heard (a resume pops the kept state in practice)
    assert got["pod-a"] is kept["pod-a"]      # not found again yet: kept for its pod


async def test_a_kept_state_is_given_to_a_node_added_later_only_while_the_file_is_young(tmp_path):
    """A node that appears after the restart (discovery, a reload) resumes its kept state while
    the state file is younger than max_age_s; later it starts afresh."""
    doc = snapshot({"n2": hm.NodeHealth("n2", state=hm.NodeState.UNHEALTHY, reason="probe: 2 failures")},
                   0.0, 1000.0)
    two = config(tmp_path / "state.json")
    two["clusters"][0]["nodes"] = two["clusters"][0]["nodes"][:2]
    for late_s, resumed in ((1.0, True), (200.0, False)):
        clock, probes = ManualClock(), InMemoryProbes()
        (tmp_path / "state.json").write_text(json.dumps({**doc, "written_at_wall_s": clock.wall()}))
        cp = ControlPlane(parse_config(two), clock=clock, probe_sources=probes)
        cp.open()
        assert "n2" in cp.core.restored and "n2" not in cp.health
        clock.advance(late_s)
        cp.core.reconfigure(parse_config(config(tmp_path / "state.json")))  # n2 appears
        assert ("n2" in cp.core.restored) is resumed
        cp.core.observe("n2", hm.HeartbeatObserved(), clock.now())
        assert cp.health["n2"].state is (hm.NodeState.UNHEALTHY if resumed else hm.NodeState.WARMING)
        cp.core.end()


def test_a_kept_state_never_claimed_is_not_written_again_after_max_age(tmp_path):
    """A kept state of a node that never comes back is written again only while it may still be
    claimed (state.max_age from the file's time): rewriting it under a fresh file time would
    let it outlive max_age_s across every later restart."""
    path = tmp_path / "state.json"
    doc = snapshot({"n2": hm.NodeHealth("n2", state=hm.NodeState.UNHEALTHY, reason="probe: 2 failures")},
                   0.0, 1000.0)
    two = config(path)
    two["clusters"][0]["nodes"] = two["clusters"][0]["nodes"][:2]
    clock = ManualClock()
    path.write_text(json.dumps({**doc, "written_at_wall_s": clock.wall()}))
    cp = ControlPlane(parse_config(two), clock=clock, probe_sources=InMemoryProbes())
    cp.open()
    try:
        clock.advance(1.0)
        assert cp.write_state() and "n2" in json.loads(path.read_text())["nodes"]  # still claimable
        clock.advance(parse_config(two).state.max_age.s)
        assert cp.write_state() and "n2" not in json.loads(path.read_text())["nodes"]  # aged out
    finally:
        cp.core.end()
