"""What one open probe stream knows, and the two liveness modes (``probe.liveness``).

Heartbeat liveness (the default): the agent's heartbeat every interval is the node's liveness;
its arrival gaps feed the misses and phi accrual. Transport liveness, asked for in the Hello
(:func:`hello`) and taken by an agent that echoes ``Heartbeat.liveness`` TRANSPORT: HTTP/2 PINGs
answered inside gRPC's C core are the liveness (``probe.channel_options``); heartbeats come on
change and every ``probe.transport.telemetry_refresh``. Heartbeats of such a stream reach the
health model ``vouched``: while it is open no miss is counted and no Tick is due for one. A Tick
that does come (a ramp step, a probe timeout waiting for progress evidence) gets the stream's
last heartbeat again (:func:`reasserted`: the transport still answers, so the node is as it last
said, its progress evidence aged); the stream failing on an unanswered PING
(:func:`liveness_lost`) is the whole miss threshold at once. A stream whose agent does not
echo (an older agent) is judged by heartbeats, whatever the control plane asked.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import grpc

from node_probe.proto import probe_pb2
from xds_server.config import ProbeConfig
from xds_server.health.records import HeartbeatObserved

__all__ = ["ProbeCall", "StreamState", "call_metadata", "hello", "liveness_lost", "reasserted", "silent_after_s"]


class ProbeCall(Protocol):
    """One open probe stream as a session drives it: the client side of ``NodeProbe.Watch``, or
    an agent's ``ProbeHub.Connect`` stream (:class:`~xds_server.probing.dial_in.InboundCall`)."""

    async def read(self) -> Any: ...

    async def write(self, message: probe_pb2.ControlMessage) -> None: ...

    def cancel(self) -> bool: ...


class StreamState:
    """What one open Watch stream knows: the pings in flight (seq -> sent at, ``time.monotonic``
    s: uvloop's loop clock counts whole milliseconds, too coarse for a LAN's RTT), the last
    Ping.seq sent, whether a heartbeat came yet, the last heartbeat's arrival (loop s; the
    stream's opening until the first), whether the agent runs transport liveness on it, and its
    last heartbeat's observation (``obs``) with that arrival (``obs_s``)."""

    __slots__ = ("got_any", "had_hb", "last_hb", "obs", "obs_s", "ping_seq", "pings", "transport")

    def __init__(self, opened_s: float) -> None:
        self.pings: dict[int, float] = {}
        self.ping_seq = 0
        self.got_any = False
        self.had_hb = False
        self.last_hb = opened_s
        self.transport = False
        self.obs: HeartbeatObserved | None = None
        self.obs_s = opened_s


def hello(control_plane_id: str, probe: ProbeConfig) -> probe_pb2.ControlMessage:
    """The stream's first message: who we are and the liveness we ask for."""
    transport = probe.liveness == "transport"
    return probe_pb2.ControlMessage(hello=probe_pb2.Hello(
        control_plane_id=control_plane_id,
        liveness=probe_pb2.LIVENESS_TRANSPORT if transport else probe_pb2.LIVENESS_HEARTBEAT,
        telemetry_refresh_ms=round(probe.transport.telemetry_refresh.ms) if transport else 0))


def call_metadata(probe: ProbeConfig) -> tuple[tuple[str, str], ...]:
    """The Watch call's metadata: transport liveness asked before the agent's first heartbeat (the
    Hello says it again once read; an agent that knows neither ignores both)."""
    if probe.liveness != "transport":
        return ()
    refresh_ms = round(probe.transport.telemetry_refresh.ms)
    return (("x-sentinel-liveness", "transport"), ("x-sentinel-telemetry-refresh-ms", str(refresh_ms)))


def silent_after_s(probe: ProbeConfig) -> float:
    """A stream open this long (s) without a heartbeat is closed and redialled: the configured
    ``channel.silent_stream_redial``, at least three telemetry refreshes in transport liveness."""
    ms = probe.channel.silent_stream_redial.ms
    return (max(ms, 3.0 * probe.transport.telemetry_refresh.ms) if probe.liveness == "transport" else ms) / 1000.0


def reasserted(obs: HeartbeatObserved, obs_s: float, now_s: float) -> HeartbeatObserved:
    """The stream's last heartbeat ``obs`` (arrived at ``obs_s``) said again at ``now_s`` (loop s):
    the same object when nothing in it ages, else with its progress evidence aged by the gap."""
    if obs.progress_age_ms is None:
        return obs
    return replace(obs, progress_age_ms=obs.progress_age_ms + max(0.0, now_s - obs_s) * 1000.0)


def liveness_lost(err: grpc.aio.AioRpcError) -> bool:
    """The stream failed because an HTTP/2 PING went unanswered within its deadline (gRPC 1.85:
    UNAVAILABLE, "Stream removed (ping timeout)"; a killed peer reads "Socket closed")."""
    return err.code() is grpc.StatusCode.UNAVAILABLE and "ping timeout" in (err.details() or "").lower()
