"""Two replicas, one truth, in memory: versions from content only, ramps
anchored on the Unix clock, replica ids where an operator looks.

Two control planes are fed the same observations, one of them 30 ms later (another zone, a GC
pause) and with another monotonic clock base; sampled between ramp steps, they publish the same
EDS version throughout a PROBATION ramp. With ``xds.ramp_anchor: local`` (each replica's own
schedule) they do not, which is what the anchoring fixes.
"""
from __future__ import annotations

import math
import os
import tempfile

from hypothesis import given
from hypothesis import strategies as st

from xds_server.config import parse_config
from xds_server.health import model as hm
from xds_server.health.anchor import anchor_ramp, grid_point
from xds_server.health.records import Ramp
from xds_server.probing.memory import InMemoryProbes
from xds_server.process.clock import ManualClock
from xds_server.server import ControlPlane
from xds_server.xds.resources import CLA_TYPE_URL

WALL0 = 1_700_000_000.0  # a multiple of every step used here
STEP_S = 0.5


def _config(anchor: str, replica: str) -> dict:
    return {
        "xds": {"listen": "127.0.0.1:0", "coalesce_window_ms": 0, "warmup_timeout_ms": 5000,
                "ramp_anchor": anchor, "replica_id": replica},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"failure_detector": "count", "ramp_start_percent": 10.0, "ramp_step_percent": 10.0,
                   "ramp_step_s": STEP_S},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.1:{8001 + i}", "probe_address": f"127.0.0.1:{9001 + i}"}
            for i in range(2)]}],
    }


def _timeline(anchor: str, replica: str, delay_s: float, mono0_s: float,
              samples: list[float]) -> tuple[list[str], ControlPlane]:
    """Run one replica: observations at wall time t + ``delay_s``; the EDS version at each sample
    (wall seconds after WALL0)."""
    clock = ManualClock(start_s=mono0_s, wall_offset_s=WALL0 - mono0_s)
    probes = InMemoryProbes()
    cp = ControlPlane(parse_config(_config(anchor, replica)), clock=clock, probe_sources=probes)
    cp.open()
    events: list[tuple[float, str, str]] = []
    for k in range(80):  # heartbeats every 100 ms, good probes every 300 ms
        for nid in ("n0", "n1"):
            events.append((k * 0.1, nid, "hb"))
    events += [(0.05 + k * 0.3, "n1", "probe") for k in range(26)]
    events += [(0.10 + k * 0.3, "n0", "probe") for k in range(26)]
    events.sort()
    out: list[str] = []
    queue = [(s, "", "sample") for s in samples] + events
    queue.sort(key=lambda e: (e[0] + (0.0 if e[2] == "sample" else delay_s), e[2] != "sample"))
    for t, nid, what in queue:
        at = t if what == "sample" else t + delay_s
        clock.advance_to(mono0_s + at)
        if what == "hb":
            probes[nid].heartbeat()
        elif what == "probe":
            probes[nid].probe(ttft_ms=20.0)
        else:
            res = cp.cache.resources(CLA_TYPE_URL).get("llm")
            out.append(res.version if res is not None else "")
    return out, cp


def _samples() -> list[float]:
    # every 50 ms, 40 ms clear of a step boundary (a step lands on both replicas within their skew)
    return [s for s in (0.2 + 0.05 * k + 0.013 for k in range(110))
            if abs(s / STEP_S - round(s / STEP_S)) * STEP_S > 0.04]


def test_two_replicas_publish_the_same_versions_through_a_ramp():
    samples = _samples()
    a, cp_a = _timeline("wall_clock", "replica-a", 0.0, 0.0, samples)
    b, cp_b = _timeline("wall_clock", "replica-b", 0.03, 1000.0, samples)
    assert all(a) and a == b
    assert len(set(a)) >= 8  # 10 % -> 100 % in 10 % steps: the ramp really moved
    assert {nh.state for nh in cp_a.health.values()} == {hm.NodeState.HEALTHY}
    assert cp_a.view.xds_clients()["replica"] == "replica-a" and cp_b.view.xds_clients()["replica"] == "replica-b"


def test_without_anchoring_the_replicas_diverge_during_the_ramp():
    samples = _samples()
    a, _ = _timeline("local", "replica-a", 0.0, 0.0, samples)
    b, _ = _timeline("local", "replica-b", 0.03, 1000.0, samples)
    differ = [s for s, x, y in zip(samples, a, b, strict=True) if x != y]
    assert differ, "each replica on its own schedule steps 30 ms apart"


@given(t=st.floats(-1e4, 1e4), offset=st.floats(0, 2e9), step=st.sampled_from([0.1, 0.3, 1.0, 2.5]))
def test_grid_point_is_the_nearest_unix_multiple_and_anchoring_is_idempotent(t, offset, step):
    g = grid_point(t, step, offset)
    wall = g + offset
    assert math.isclose(wall / step, round(wall / step), abs_tol=1e-3)
    assert abs(g - t) <= step / 2 + 1e-3
    nh = hm.initial("n", 0.0)
    nh = nh.__class__(**{**{f: getattr(nh, f) for f in nh.__dataclass_fields__},
                         "state": hm.NodeState.PROBATION, "ramp": Ramp(10.0, t)})
    once = anchor_ramp(nh, step, offset)
    assert abs(once.ramp.step_at_s - g) <= 1e-6 and once.ramp.percent == 10.0  # already on it: kept
    assert anchor_ramp(once, step, offset) is once
    healthy = nh.__class__(**{**{f: getattr(nh, f) for f in nh.__dataclass_fields__}, "state": hm.NodeState.HEALTHY})
    assert anchor_ramp(healthy, step, offset) is healthy


# -- every PROBATION ramp is on the grid, also one resumed from the state file ------------------
# (ramps are anchored only when new or on entering PROBATION, to keep clock reads off the
# heartbeat path; a kept state resumed after a restart is such a new ramp)

_OPS = st.lists(st.tuples(st.sampled_from(["hb", "hb", "hb", "ok", "fail", "close", "wait"]),
                          st.sampled_from(["n0", "n1"]), st.floats(0.01, 1.5)), max_size=80)


def _off_grid(cp: ControlPlane) -> list[str]:
    offset = round(cp.clock.wall() - cp.clock.now(), 3)  # as the core reads it
    return [nid for nid, nh in cp.health.items()
            if nh.state is hm.NodeState.PROBATION and anchor_ramp(nh, STEP_S, offset) is not nh]


def _drive(cp: ControlPlane, probes: InMemoryProbes, ops: list, t0: float) -> None:
    t = t0
    for what, nid, dt in ops:
        t += dt if what == "wait" else 0.05
        cp.clock.advance_to(t)
        if what == "hb":
            probes[nid].heartbeat()
        elif what == "ok":
            probes[nid].probe(ttft_ms=20.0)
        elif what == "fail":
            probes[nid].probe(kind=hm.ProbeResultKind.ENGINE_FATAL, detail="boom")
        elif what == "close":
            probes[nid].close()
        assert not _off_grid(cp), (what, nid, t)


@given(before=_OPS, after=_OPS, mono1=st.floats(0, 1e5))
def test_every_probation_ramp_is_anchored_also_after_a_restart(before, after, mono1):
    with tempfile.TemporaryDirectory() as d:
        raw = _config("wall_clock", "r")
        raw["health"].update(probation_clean_s=0.3, probation_min_probes=1, probe_failures_to_eject=1,
                             good_probes_to_recover=1)
        raw["state"] = {"path": os.path.join(d, "state.json"), "max_age_s": 600.0}
        cfg = parse_config(raw)
        clock = ManualClock(start_s=0.0, wall_offset_s=WALL0 + 0.123)
        probes = InMemoryProbes()
        cp = ControlPlane(cfg, clock=clock, probe_sources=probes)
        cp.open()
        # into probation first: ejected by a failed probe, then clean probes
        for nid in ("n0", "n1"):
            probes[nid].heartbeat()
            probes[nid].probe(kind=hm.ProbeResultKind.ENGINE_FATAL, detail="boom")
        _drive(cp, probes, [("hb", "n0", 0), ("hb", "n1", 0), ("wait", "", 0.4), ("hb", "n0", 0), ("hb", "n1", 0),
                            ("ok", "n0", 0), ("ok", "n1", 0), ("ok", "n0", 0), ("ok", "n1", 0)] + before, 0.0)
        assert cp.write_state()
        wall = clock.wall()
        clock2 = ManualClock(start_s=mono1, wall_offset_s=wall + 0.05 - mono1)
        probes2 = InMemoryProbes()
        cp2 = ControlPlane(cfg, clock=clock2, probe_sources=probes2)
        cp2.open()
        _drive(cp2, probes2, [("hb", "n0", 0), ("hb", "n1", 0)] + after, mono1)
