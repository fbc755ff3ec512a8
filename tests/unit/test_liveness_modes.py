"""The two liveness modes at their edges: the agent's StreamHub sends heartbeats on
change and refresh only when a Hello asks for transport liveness (and it takes it), the probe
channel's keepalive enforces its deadline only in transport liveness, and the helpers of
``xds_server.probing.liveness``."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from node_probe.proto import probe_pb2
from node_probe.streams import StreamHub, change_key
from xds_server.config import ProbeConfig
from xds_server.health.records import HeartbeatObserved
from xds_server.probing.liveness import call_metadata, hello, liveness_lost, reasserted, silent_after_s


async def _requests(first: probe_pb2.ControlMessage | None):
    if first is not None:
        yield first
    await asyncio.Event().wait()  # the control plane keeps its side open


async def _heartbeats(hub: StreamHub, first: probe_pb2.ControlMessage | None, seconds: float,
                      at=None) -> list[probe_pb2.Heartbeat]:
    got: list[probe_pb2.Heartbeat] = []

    async def read() -> None:
        async for m in hub.serve(_requests(first), "test"):
            if m.WhichOneof("msg") == "heartbeat":
                got.append(m.heartbeat)

    task = asyncio.create_task(read())
    if at is not None:
        await asyncio.sleep(seconds / 2)
        at()
        await asyncio.sleep(seconds / 2)
    else:
        await asyncio.sleep(seconds)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await hub.close()
    return got


def _hub(tel: list[probe_pb2.Telemetry], transport_ok: bool = True) -> StreamHub:
    return StreamHub(node_id="n", heartbeat_interval_ms=20, queue_max=64, telemetry=lambda: tel[0],
                     on_probe_now=lambda _r: None, transport_liveness=transport_ok)


def _hello(liveness: int, refresh_ms: int = 400) -> probe_pb2.ControlMessage:
    return probe_pb2.ControlMessage(hello=probe_pb2.Hello(control_plane_id="cp", liveness=liveness,
                                                          telemetry_refresh_ms=refresh_ms))


async def test_transport_hello_sends_heartbeats_on_change_and_refresh_only():
    tel = [probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY)]

    def stall() -> None:
        tel[0] = probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY, stalled=True)

    got = await _heartbeats(_hub(tel), _hello(probe_pb2.LIVENESS_TRANSPORT), 1.2, at=stall)
    transport = [h for h in got if h.liveness == probe_pb2.LIVENESS_TRANSPORT]
    # at 20 ms that would be ~60 heartbeats; on change and a 400 ms refresh: the first (before
    # the Hello was read), the first in transport, ~2 refreshes, the stall at once
    assert 3 <= len(transport) <= 7, [(h.seq, h.telemetry.stalled) for h in got]
    assert len(got) - len(transport) <= 2
    assert any(h.telemetry.stalled for h in transport)


async def test_transport_asked_in_the_call_metadata_has_no_heartbeat_phase():
    tel = [probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY)]
    hub = _hub(tel)
    got: list[probe_pb2.Heartbeat] = []

    async def read() -> None:
        md = (("x-sentinel-liveness", "transport"), ("x-sentinel-telemetry-refresh-ms", "400"))
        async for m in hub.serve(_requests(None), "test", md):
            got.append(m.heartbeat)

    task = asyncio.create_task(read())
    await asyncio.sleep(1.0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await hub.close()
    assert 2 <= len(got) <= 4 and all(h.liveness == probe_pb2.LIVENESS_TRANSPORT for h in got), got
    assert call_metadata(ProbeConfig()) == ()
    assert dict(call_metadata(ProbeConfig(liveness="transport", telemetry_refresh_ms=400))) == {
        "x-sentinel-liveness": "transport", "x-sentinel-telemetry-refresh-ms": "400"}


async def test_heartbeat_hello_an_old_control_plane_or_a_declining_agent_get_every_heartbeat():
    tel = [probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY)]
    for hub, first in ((_hub(tel), _hello(probe_pb2.LIVENESS_HEARTBEAT)),
                       (_hub(tel), probe_pb2.ControlMessage(hello=probe_pb2.Hello(control_plane_id="old"))),
                       (_hub(tel, transport_ok=False), _hello(probe_pb2.LIVENESS_TRANSPORT))):
        got = await _heartbeats(hub, first, 0.6)
        assert len(got) >= 15, len(got)  # every 20 ms (a loaded host may lose some)
        assert all(h.liveness == probe_pb2.LIVENESS_UNSPECIFIED for h in got)


def test_change_key_sees_engine_state_stall_and_gpu_faults_not_load():
    base = probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY)
    base.gpu.gpus.add(index=0)
    k = change_key(base)
    load = probe_pb2.Telemetry()
    load.CopyFrom(base)
    load.engine_load.requests_running = 7.0
    load.gpu.gpus[0].memory_used_bytes = 123
    assert change_key(load) == k
    for edit in (lambda t: setattr(t, "engine_state", probe_pb2.ENGINE_STATE_FAILED),
                 lambda t: setattr(t, "stalled", True),
                 lambda t: t.gpu.gpus[0].xid_events.append(79),
                 lambda t: setattr(t.gpu.gpus[0], "ecc_uncorrected", 1),
                 lambda t: setattr(t.gpu, "state", probe_pb2.NVML_STATE_ERROR)):
        t = probe_pb2.Telemetry()
        t.CopyFrom(base)
        edit(t)
        assert change_key(t) != k


def test_channel_keepalive_enforced_only_in_transport_liveness():
    hb = dict(ProbeConfig().channel_options(5000))
    assert "grpc.http2.ping_timeout_ms" not in hb and hb["grpc.keepalive_time_ms"] == 1000
    tr = dict(ProbeConfig(liveness="transport", transport_keepalive_time_ms=200,
                          transport_ping_timeout_ms=150).channel_options(5000))
    assert tr["grpc.keepalive_time_ms"] == 200
    assert tr["grpc.keepalive_timeout_ms"] == tr["grpc.http2.ping_timeout_ms"] == 150


def test_the_agents_port_holds_the_accept_backlog_before_grpc_refuses_a_stream():
    opts = dict(ProbeConfig().dial_in_options())
    assert opts["grpc.server.max_pending_requests"] == opts["grpc.server.max_pending_requests_hard_limit"] == 20_000
    small = dict(ProbeConfig(dial_in={"accept_backlog": 5000}).dial_in_options())
    assert small["grpc.server.max_pending_requests"] == small["grpc.server.max_pending_requests_hard_limit"] == 5000
    with pytest.raises(ValueError, match="accept_backlog"):
        ProbeConfig(dial_in={"accept_backlog": 10})  # under gRPC's own default: refused


def test_the_agents_port_holds_a_stream_not_taken_yet_for_the_accept_wait_in_whole_seconds():
    assert dict(ProbeConfig().dial_in_options())["grpc.server_max_unrequested_time_in_server"] == 300
    for wait, seconds in (("1s", 1), ("1500ms", 2), ("90s", 90), ("1h", 3600)):
        opts = dict(ProbeConfig(dial_in={"accept_wait": wait}).dial_in_options())
        assert opts["grpc.server_max_unrequested_time_in_server"] == seconds, wait
    for bad in ("500ms", "2h"):  # under gRPC's one-second unit; past the bound
        with pytest.raises(ValueError, match="accept_wait"):
            ProbeConfig(dial_in={"accept_wait": bad})


def test_probe_liveness_config_is_checked():
    assert ProbeConfig().liveness == "heartbeat"
    for bad, where in (({"liveness": "pings"}, "liveness"), ({"transport": {"telemetry_refresh": "2m"}},
                                                             "transport.telemetry_refresh"),
                       ({"transport_ping_timeout_ms": 0}, "transport.ping_timeout")):
        with pytest.raises(ValueError, match=where):
            ProbeConfig(**bad)


def test_hello_and_silent_stream_limit_follow_the_mode():
    assert hello("cp", ProbeConfig()).hello.liveness == probe_pb2.LIVENESS_HEARTBEAT
    t = hello("cp", ProbeConfig(liveness="transport", telemetry_refresh_ms=1500)).hello
    assert (t.liveness, t.telemetry_refresh_ms, t.control_plane_id) == (probe_pb2.LIVENESS_TRANSPORT, 1500, "cp")
    assert silent_after_s(ProbeConfig()) == 2.0
    assert silent_after_s(ProbeConfig(liveness="transport", telemetry_refresh_ms=1500)) == 4.5


def test_reasserted_keeps_the_object_or_ages_the_progress_evidence():
    quiet = HeartbeatObserved()
    assert reasserted(quiet, 10.0, 10.5) is quiet
    busy = HeartbeatObserved(progress_age_ms=100.0, progress_detail="moved")
    again = reasserted(busy, 10.0, 10.5)
    assert again.progress_age_ms == pytest.approx(600.0) and again.progress_detail == "moved"


class _Err(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_liveness_lost_is_an_unanswered_ping_only():
    assert liveness_lost(_Err(grpc.StatusCode.UNAVAILABLE, "Stream removed (ping timeout)"))
    assert not liveness_lost(_Err(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)"))
    assert not liveness_lost(_Err(grpc.StatusCode.CANCELLED, "ping timeout"))


def test_a_stream_failed_by_an_unanswered_ping_ejects_at_once_a_plain_close_counts_one_miss():
    from xds_server.config import HealthConfig
    from xds_server.health.model import EjectionCause, NodeState, StreamClosed
    from xds_server.health.sim import NodeSim

    for lost, cause, state in ((True, EjectionCause.TRANSPORT, NodeState.UNHEALTHY), (False, None, NodeState.HEALTHY)):
        sim = NodeSim(cfg=HealthConfig(ramp_step_percent=50, ramp_step_s=1.0))
        sim.run_until(4.0)
        assert sim.nh.state is NodeState.HEALTHY
        last = sim.nh.heartbeat.last_s
        sim.apply(StreamClosed("UNAVAILABLE: Stream removed (ping timeout)", liveness_lost=lost), last + 0.01)
        assert (sim.nh.heartbeat.consecutive_misses, sim.nh.state, sim.nh.ejection.cause) == (1, state, cause)


def _cut(*, back_after_s: float | None, max_suspicions: int = 6, cuts: int = 1):
    """A HEALTHY node whose stream is failed by an unanswered PING ``cuts`` times, 1 s apart; its
    agent's heartbeats resume ``back_after_s`` after each cut (None: never)."""
    from xds_server.config import HealthConfig
    from xds_server.health.model import StreamClosed
    from xds_server.health.sim import NodeSim

    cut_at: list[float] = []

    def heartbeat(t: float):
        silent = any(c <= t and (back_after_s is None or t < c + back_after_s) for c in cut_at)
        return None if silent else _ready(t)

    sim = NodeSim(cfg=HealthConfig(ramp_step_percent=50, ramp_step_s=1.0, phi={"max_suspicions": max_suspicions}),
                  heartbeat=heartbeat)
    sim.run_until(4.0)
    for k in range(cuts):
        t = 4.0 + k + 0.005
        sim.run_until(t)
        cut_at.append(t)
        sim.apply(StreamClosed("UNAVAILABLE: Stream removed (ping timeout)", liveness_lost=True), t)
        sim.run_until(t + 0.9)
    return sim


def _ready(t: float):
    from xds_server.health.model import EngineState, HeartbeatObserved
    return HeartbeatObserved(engine_state=EngineState.READY)


def test_an_agent_back_before_the_count_rule_resumes_its_node_one_silent_past_it_is_proven():
    from xds_server.health.model import EjectionCause, NodeState

    # back 65 ms after the cut (an agent that dials again at once): out for those 65 ms, then HEALTHY
    # as it was, with no probation
    sim = _cut(back_after_s=0.065)
    seen = [(round(t - 4.005, 3), s) for t, s in sim.states if t >= 4.0]
    assert seen == [(0.0, NodeState.UNHEALTHY), (0.095, NodeState.HEALTHY)], seen  # the next heartbeat
    assert "transport suspicion disproved: heartbeat arrived after" in sim.events[-1].reason
    assert sim.nh.state is NodeState.HEALTHY and sim.nh.heartbeat.suspicion_clears
    # silent past consecutive_misses: proven by the count rule, and back only through PROBATION
    sim = _cut(back_after_s=0.5)
    out = [e for e in sim.events if e.at_s >= 4.0]
    assert out[0].to_state is NodeState.UNHEALTHY and "suspected until 3 consecutive misses" in out[0].reason
    assert sim.nh.state is NodeState.UNHEALTHY and sim.nh.ejection.cause is EjectionCause.HEARTBEAT
    assert sim.nh.reason.startswith("heartbeats resumed; clean period"), sim.nh.reason
    assert [e.to_state for e in out] == [NodeState.UNHEALTHY]
    # never back: proven at the third miss (~0.28 s), stays out
    sim = _cut(back_after_s=None)
    assert sim.nh.state is NodeState.UNHEALTHY and sim.nh.ejection.cause is EjectionCause.HEARTBEAT
    assert sim.nh.reason.startswith("heartbeat: "), sim.nh.reason


def test_a_node_whose_drops_keep_being_disproved_is_counted_out_by_the_next():
    from xds_server.health.model import EjectionCause, NodeState

    sim = _cut(back_after_s=0.065, max_suspicions=2, cuts=3)
    assert len(sim.nh.heartbeat.suspicion_clears) == 2  # the first two were disproved
    # the third: the whole miss threshold at once, proven, out until its clean period
    assert sim.nh.state is NodeState.UNHEALTHY and sim.nh.ejection.cause is EjectionCause.HEARTBEAT
    assert "3 consecutive misses" in next(e for e in sim.events if e.at_s >= 6.0).reason
