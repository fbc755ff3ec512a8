"""Probe workers without processes: the node -> worker assignment, the worker's detector and
the main process's adoption of its reports (against the in-process path), the channel's
frames, the config field. The processes themselves: tests/integration/test_probe_workers_fleet.py."""
from __future__ import annotations

import asyncio
import dataclasses
import pickle
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import ConfigError, HealthConfig, ProbeConfig, parse_config
from xds_server.control.core import ControlCore
from xds_server.health import model as hm
from xds_server.probing.claims import Claim
from xds_server.probing.memory import InMemoryProbes
from xds_server.probing.workers import Detector, worker_for
from xds_server.probing.workers._channel import FrameTooLarge, encode, read_frame
from xds_server.process.clock import ManualClock
from xds_server.process.identity import PeerIdentity
from xds_server.server import ControlPlane


def config(n: int = 2, **probe) -> dict:
    return {
        "xds": {"listen": "127.0.0.1:0", "coalesce_window_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"phi_min_samples": 5},
        "probe": probe,
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.1:{8001 + i}", "probe_address": f"127.0.0.1:{9001 + i}"}
            for i in range(n)]}],
    }


# -- assignment ----------------------------------------------------------------------------------


@given(st.text(min_size=1, max_size=64), st.integers(1, 64))
def test_worker_for_is_in_range_and_the_same_every_time(node_id, n):
    w = worker_for(node_id, n)
    assert 0 <= w < n
    assert worker_for(node_id, n) == w


def test_worker_for_is_not_salted_per_process_and_refuses_zero_workers():
    # crc32, not hash(): these values hold in every process (a restarted worker agrees)
    assert [worker_for(f"gpu-{c}", 2) for c in "abcdef"] == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="workers must be >= 1"):
        worker_for("gpu-a", 0)


# -- config --------------------------------------------------------------------------------------


def test_workers_setting_auto_n_and_in_process_default():
    assert ProbeConfig().workers == 0 and ProbeConfig().worker_count(16) == 0
    assert ProbeConfig(workers="auto").worker_count(8) == 7
    assert ProbeConfig(workers="auto").worker_count(1) == 1
    assert ProbeConfig(workers="auto").worker_count(None) == 1
    assert ProbeConfig(workers=3).worker_count(2) == 3
    for bad in ("many", -1):
        with pytest.raises(ConfigError, match=r"probe\.workers"):
            parse_config(config(workers=bad))


def test_default_control_plane_keeps_probe_streams_in_process():
    cp = ControlPlane(parse_config(config()))
    assert cp.probe_pool is None and cp.core.forward_fail_static_end is None
    cp2 = ControlPlane(parse_config(config(workers=2)))
    assert cp2.probe_pool is not None and cp2.probe_pool.n == 2
    assert cp2.core.forward_fail_static_end == cp2.probe_pool.forward_fail_static_end
    # an injected probe-source factory wins (tests drive the in-process path)
    assert ControlPlane(parse_config(config(workers=2)), probe_sources=InMemoryProbes()).probe_pool is None


def dial_in_config(listen: str | None, workers: int = 2) -> dict:
    """Two nodes whose agents dial in (no probe_address)."""
    cfg = config(workers=workers, **({"dial_in": {"listen": listen}} if listen else {}))
    for n in cfg["clusters"][0]["nodes"]:
        del n["probe_address"]
    return cfg


def test_workers_accept_agents_only_on_a_named_port_of_their_own():
    with pytest.raises(ConfigError, match=r"dial_in.listen 127.0.0.1:0: port 0 with workers 2"):
        parse_config(dial_in_config("127.0.0.1:0"))
    on_xds = parse_config(dial_in_config(None))
    assert any(n.startswith("probe.workers: agents that dial in are held by this process") for n in on_xds.notes())
    own = parse_config(dial_in_config("127.0.0.1:18001"))
    assert not [n for n in own.notes() if n.startswith("probe.workers")]
    assert parse_config(dial_in_config("127.0.0.1:0", workers=0)).probe.dial_in.listen == "127.0.0.1:0"
    # who holds the agents' streams: the workers with a port of their own, else this process
    cp, cp_shared = ControlPlane(own), ControlPlane(on_xds)
    assert cp.probe_pool is not None and cp.probe_pool.accepts_agents
    assert cp_shared.probe_pool is not None and not cp_shared.probe_pool.accepts_agents


class _Wire:
    """A worker channel's write end, decoding what the pool sends."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def write(self, frame: bytes) -> None:
        self.sent.append(pickle.loads(frame[4:]))

    def is_closing(self) -> bool:
        return False


async def test_a_node_moves_to_the_worker_that_accepted_its_agent_with_its_current_health():
    cp = ControlPlane(parse_config(dial_in_config("127.0.0.1:18001")))  # its own hub judges the claims
    pool = cp.probe_pool
    assert pool is not None
    wires = [_Wire(), _Wire()]
    for h, w in zip(pool.handles, wires, strict=True):
        h.writer, h.task = w, asyncio.get_running_loop().create_future()  # running, as far as the pool knows
    cp.open()
    node = cp.sessions["n0"].node
    home = worker_for("n0", 2)
    other = pool.handles[1 - home]
    claim = Claim(node=node, cluster="", said=frozenset())
    await pool._claim(other, 7, claim, PeerIdentity(), "ipv4:127.0.0.1:1")
    assert wires[home].sent[-1] == ("remove", "n0")
    add, verdict = wires[1 - home].sent[-2:]
    assert add[0] == "add" and add[1] == node and add[2] == cp.health["n0"]
    assert verdict == ("verdict", 7, "OK", "") and pool.moves == 1 and "n0" in other.nodes
    # the same worker again: no move
    await pool._claim(other, 8, claim, PeerIdentity(), "ipv4:127.0.0.1:2")
    assert wires[1 - home].sent[-1] == ("verdict", 8, "OK", "") and pool.moves == 1
    # a node nobody serves: refused and counted here, nothing moves
    unknown = Claim(node=node.model_copy(update={"id": "zz"}), cluster="", said=frozenset())
    await pool._claim(other, 9, unknown, PeerIdentity(), "ipv4:127.0.0.1:3")
    code, why = wires[1 - home].sent[-1][2:]
    assert code == "FAILED_PRECONDITION" and "zz" in why and pool.moves == 1
    assert cp.refusals.counts[("xds", "agent_claim")] == 1


# -- detector + adopt == the in-process model -----------------------------------------------------


def EventRecord_json(e) -> dict:  # used as a map() function below
    return e.to_json()


_hb = st.builds(hm.HeartbeatObserved,
                engine_state=st.sampled_from(list(hm.EngineState)),
                stalled=st.booleans(),
                requests_waiting=st.one_of(st.none(), st.sampled_from([0.0, 5.0, 500.0])),
                gpu_free_ratio=st.one_of(st.none(), st.sampled_from([0.01, 0.5])),
                gpu_fatal=st.sampled_from(["", "GPU 0 Xid 79"]))
_probe = st.builds(hm.ProbeObserved, kind=st.sampled_from(list(hm.ProbeResultKind)),
                   ttft_ms=st.sampled_from([10.0, 300.0, 2000.0]))
_obs = st.one_of(_hb, _hb, _hb, st.just(hm.Tick()), st.builds(hm.StreamClosed, st.just("x")),
                 st.builds(hm.PingObserved, st.sampled_from([1.0, 2.0, 40.0])), _probe)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["n0", "n1"]), _obs, st.floats(0.0, 0.4)), min_size=1, max_size=80))
def test_worker_reports_leave_the_main_process_where_the_in_process_model_would_be(script):
    cfg = parse_config(config())
    here = ControlCore(cfg, ManualClock())
    main = ControlCore(cfg, ManualClock())
    here.begin()
    main.begin()
    d = Detector(cfg.health)
    # ramps anchored to Unix time (xds.ramp_anchor wall_clock, the default), as a Worker sets it
    d.wall_offset_s = round(here.clock.wall() - here.clock.now(), 3)
    for node_id in ("n0", "n1"):
        d.add(node_id, main.health[node_id], None, 0.0, 3.0)
    t = 0.0
    for node_id, obs, dt in script:
        t += dt
        here.observe(node_id, obs, t)
        d.observe(node_id, obs, t)
        if d.urgent:
            for r in d.take(False):
                main.adopt(r.node_id, r.health, list(r.events), t)
        # decisions never wait for a full report: state, ejection and fail-static inputs agree now
        for n in ("n0", "n1"):
            a, b = here.health[n], main.health[n]
            assert (b.state, b.reason, b.ejection) == (a.state, a.reason, a.ejection)
            assert (b.heartbeat.consecutive_misses > 0, b.heartbeat.stream_closed) == (
                a.heartbeat.consecutive_misses > 0, a.heartbeat.stream_closed)
    for r in d.take(True):
        main.adopt(r.node_id, r.health, list(r.events), t)
    for n in ("n0", "n1"):
        a, b = here.health[n], main.health[n]
        # the same record but for what moves at every heartbeat: last arrival (None while it
        # flows: the worker watches it) and the phi estimate (it goes with material changes)
        flowing = a.heartbeat.consecutive_misses == 0 and not a.heartbeat.stream_closed
        want = dataclasses.replace(a.heartbeat, last_s=None if flowing else a.heartbeat.last_s,
                                   arrivals=b.heartbeat.arrivals)
        assert b == dataclasses.replace(a, heartbeat=want)
    assert [(e["node"], e["from"], e["to"], e["reason"]) for e in map(EventRecord_json, main.events)] == [
        (e["node"], e["from"], e["to"], e["reason"]) for e in map(EventRecord_json, here.events)]
    assert main.counters.ejections == here.counters.ejections
    assert d.heartbeats + main.counters.heartbeats == here.counters.heartbeats
    assert {(n, k, o): v for (n, k, o), v in d.probe_results.items()} == dict(here.counters.probe_results)


def test_steady_heartbeats_send_nothing_but_counts_telemetry_waits_for_the_full_report():
    cfg = HealthConfig(phi_min_samples=5)
    d = Detector(cfg)
    d.add("n0", None, None, 0.0, 3.0)
    hb = hm.HeartbeatObserved()
    d.observe("n0", hb, 0.0)
    assert d.urgent  # COLD -> WARMING is a transition
    assert [r.health.state for r in d.take(False)] == [hm.NodeState.WARMING]
    for i in range(1, 50):
        d.observe("n0", hb, i * 0.1)
        assert not d.urgent, f"heartbeat {i} made an urgent report"
    assert d.take(False) == []
    assert d.heartbeats["n0"] == 50
    assert d.take(True) == []  # nothing material: only the heartbeat count travels
    d.observe("n0", hm.HeartbeatObserved(requests_waiting=3.0), 5.0)  # below queue_warning
    assert not d.urgent and d.take(False) == []
    (r,) = d.take(True)  # a telemetry-only change waits for the full report
    assert r.health.engine.requests_waiting == 3.0 and r.events == ()
    d.observe("n0", hm.HeartbeatObserved(requests_waiting=3.0), 5.1)
    assert d.take(True) == []
    d.observe("n0", hm.StreamClosed("agent gone"), 5.15)
    assert d.urgent  # a fail-static input flipped: at once
    (r,) = d.take(False)
    assert r.health.heartbeat.stream_closed


def test_handed_over_node_is_not_counted_silent_before_the_grace_and_keeps_its_phi_history():
    cfg = HealthConfig(phi_min_samples=5)
    here = ControlCore(parse_config(config()), ManualClock())
    here.begin()
    t = 0.0
    for _ in range(40):
        here.observe("n0", hm.HeartbeatObserved(), t)
        t += 0.1
    here.observe("n0", hm.ProbeObserved(hm.ProbeResultKind.OK, ttft_ms=10.0), t)
    mirror = here.health["n0"]
    assert mirror.state in hm.ROUTED_STATES and mirror.heartbeat.arrivals is not None

    d = Detector(cfg)
    start = t + 5.0  # the old worker died 5 s after the last heartbeat the main process had
    d.add("n0", mirror, None, start, 2.0)
    nh = d.nodes["n0"].nh
    assert nh.heartbeat.last_s == start + 2.0 and nh.heartbeat.consecutive_misses == 0
    d.observe("n0", hm.Tick(), start + 1.9)
    nh = d.nodes["n0"].nh
    assert nh.state is mirror.state and nh.heartbeat.consecutive_misses == 0 and not nh.heartbeat.stream_closed
    # the first heartbeat after the handover is no inter-arrival sample
    d.observe("n0", hm.HeartbeatObserved(), start + 0.3)
    assert d.nodes["n0"].nh.heartbeat.arrivals == mirror.heartbeat.arrivals

    # never heard from after the handover: silent from the end of the grace, then ejected
    d2 = Detector(cfg)
    d2.add("n0", mirror, None, start, 2.0)
    for k in range(1, 8):
        d2.observe("n0", hm.Tick(), start + 2.0 + 0.1 * k)
    assert d2.nodes["n0"].nh.state is hm.NodeState.UNHEALTHY
    assert d2.urgent


def test_kept_state_is_resumed_at_the_first_heartbeat_in_the_worker():
    cfg = HealthConfig()
    kept = dataclasses.replace(hm.initial("n0", 0.0), state=hm.NodeState.HEALTHY, reason="was healthy")
    d = Detector(cfg)
    d.add("n0", None, kept, 10.0, 3.0)
    d.observe("n0", hm.HeartbeatObserved(), 10.1)
    (r,) = d.take(False)
    assert r.health.state is hm.NodeState.HEALTHY
    assert r.events[0].reason == "resumed after restart: was healthy"


def test_fail_static_end_goes_to_the_workers_nodes_not_the_local_copy():
    core = ControlCore(parse_config(config()), ManualClock())
    core.begin()
    asked: list[float] = []
    core.forward_fail_static_end = lambda burst: asked.append(burst) or {"n0"}
    core.fail_static = dataclasses.replace(core.fail_static, active=True, burst_start_s=1.5)
    before = core.health["n0"]
    core._check_fail_static(2.0, None)  # fewer than the fraction silent: the episode ends
    assert asked == [1.5]
    assert core.health["n0"] is before


# -- channel ------------------------------------------------------------------------------------


async def test_frames_round_trip_and_end_of_stream_reads_none():
    a, b = socket.socketpair()
    _ra, wa = await asyncio.open_unix_connection(sock=a)
    rb, wb = await asyncio.open_unix_connection(sock=b)
    msg = ("report", [hm.initial("n0", 1.0)], {"n0": 3}, {}, {}, {}, 3)
    wa.write(encode(msg))
    wa.write(encode(("stop",)))
    await wa.drain()
    assert await read_frame(rb) == msg
    assert await read_frame(rb) == ("stop",)
    wa.close()
    assert await read_frame(rb) is None
    wb.close()
    c, d = socket.socketpair()
    rc, wc = await asyncio.open_unix_connection(sock=c)
    d.sendall(b"\xff\xff\xff\xff")  # header of a 4 GiB frame: refused before reading it
    with pytest.raises(FrameTooLarge):
        await read_frame(rc)
    wc.close()
    d.close()


# -- the pool with real worker processes (agents unreachable: the workers dial and report it) ----


async def test_nodes_added_and_removed_by_a_reload_reach_the_worker_that_owns_them():
    from xds_server.testing import free_port, wait_for

    cfg = config(2, workers=2, worker_report_interval_ms=100)
    cp = ControlPlane(parse_config(cfg))
    cp.open()
    try:
        pool = cp.probe_pool
        assert {i for h in pool.handles for i in h.nodes} == {"n0", "n1"}
        cfg["clusters"][0]["nodes"].append({"id": "gpu-d", "address": "127.0.0.1:8100",
                                            "probe_address": f"127.0.0.1:{free_port()}"})
        await cp.reload(parse_config(cfg))
        owner = pool.handles[worker_for("gpu-d", 2)]
        assert "gpu-d" in owner.nodes and all("gpu-d" not in h.nodes for h in pool.handles if h is not owner)
        # the owning worker dials it: its failed dials come back in a report
        src = cp.sessions["gpu-d"]
        # (a worker's start-up is ~0.7 s of CPU: seconds on a loaded 2-core host)
        await wait_for(lambda: src.failed_dials > 0, timeout_s=30, what="gpu-d was never dialled")
        assert "unavailable" in src.last_error.lower() or "connect" in src.last_error.lower()
        del cfg["clusters"][0]["nodes"][0]  # n0 leaves: drained first, then dropped
        await cp.reload(parse_config(cfg))
        assert await cp.reap_drained() == ["n0"]  # COLD (its agent never answered): drained at once
        assert all("n0" not in h.nodes for h in pool.handles)
    finally:
        await cp.stop()
    assert all(h.proc is None or h.proc.poll() is not None for h in pool.handles)


async def test_worker_anchors_ramps_as_the_main_process_says_and_dials_with_its_replica_id():
    import asyncio
    import time

    from xds_server.probing.workers._worker import Worker

    cfg = parse_config(config())
    loop = asyncio.get_running_loop()
    w = Worker(0, cfg.health, cfg.probe, ("replica-7", cfg.tls.agents, "wall_clock"), 3.0, writer=None)
    assert w.replica_id == "replica-7"
    assert abs(w.detector.wall_offset_s - (time.time() - loop.time())) < 0.05
    assert w.handle(("config", cfg.health, cfg.probe, ("replica-8", cfg.tls.agents, "local")))
    assert w.replica_id == "replica-8" and w.detector.wall_offset_s is None


_DETECTOR_STEPS = st.lists(st.tuples(
    st.sampled_from(["n0", "n1"]),
    st.sampled_from(["hb"] * 8 + ["hb_new", "probe", "probe_fail", "tick", "take", "take_full", "fail_static_end"]),
    st.sampled_from([0.0, 0.1, 0.1, 0.1, 0.05, 0.3])), min_size=20, max_size=150)


def _run_detector(steps, fold: bool) -> list:
    """Run ``steps`` on a Detector (steady heartbeats folded, or every one stepped); everything it gave."""
    cfg = HealthConfig(probation_clean_s=0.5, ramp_step_s=0.2, ramp_start_percent=50.0)
    with pytest.MonkeyPatch.context() as mp:
        if not fold:
            mp.setattr(hm, "steady_heartbeat", lambda *a: None)
        d, t, out = Detector(cfg), 0.0, []
        hbs = {"n0": hm.HeartbeatObserved(engine_state="READY"), "n1": hm.HeartbeatObserved(engine_state="READY")}
        for nid in hbs:
            d.add(nid, None, None, 0.0, 2.0)
        for nid, what, dt in steps:
            t += dt
            if what.startswith("hb"):
                if what == "hb_new":
                    hbs[nid] = hm.HeartbeatObserved(engine_state="READY", requests_running=float(int(t * 10) % 3))
                out.append(d.observe(nid, hbs[nid], t))
            elif what.startswith("probe"):
                kind = hm.ProbeResultKind.TIMEOUT if what == "probe_fail" else hm.ProbeResultKind.OK
                out.append(d.observe(nid, hm.ProbeObserved(kind, ttft_ms=10.0), t))
            elif what == "tick":
                out.append(d.observe(nid, hm.Tick(), t))
            elif what == "fail_static_end":
                d.fail_static_ended(t - 1.0, t)
            else:
                out.append((d.urgent, sorted(((r.node_id, r.health, r.events) for r in d.take(what == "take_full")),
                                             key=lambda x: x[0]), dict(d.heartbeats)))
        out.append([d.nodes[nid].nh for nid in hbs])
        return out


@settings(max_examples=60, deadline=None)
@given(_DETECTOR_STEPS)
def test_a_worker_detector_folding_steady_heartbeats_reports_what_stepping_every_one_reports(steps):
    """The probe worker's detector with steady heartbeats folded in place gives the same Tick
    deadlines, urgent flags, reports (records and transitions) and heartbeat counts as with every
    heartbeat stepped."""
    assert _run_detector(steps, fold=True) == _run_detector(steps, fold=False)
