"""The agent edge: every field of an ``AgentMessage`` checked once, by type, before use.

Numbers must be finite and in range, enums known, strings and lists bounded. A bad field is
dropped (read as unknown), clamped, or rejects its message, and is reported as a
:class:`BadField` ``(field, reason)`` from a bounded set, so it can be a metric label. Nothing
here raises on agent input; nothing here does I/O.

Shape::

    edge = AgentEdge(health_cfg, probe_cfg)
    checked, bad = edge.check(agent_message)
    # checked: CheckedHeartbeat | CheckedPong | CheckedResult | None (message rejected)
    # bad: [BadField("inference_result.ttft_ms", "not_finite"), ...]

Reasons: ``not_finite``, ``negative``, ``out_of_range``, ``unknown_enum``, ``too_long`` (string
clipped), ``too_many`` (list cut), ``empty`` (no payload), ``mismatch``.
Bounds come from :class:`~xds_server.config.ProbeConfig` (each with its default and source).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from node_probe.proto import probe_pb2
from xds_server.config import HealthConfig, ProbeConfig
from xds_server.health.model import EngineState, HeartbeatObserved, ProbeObserved, ProbeResultKind
from xds_server.probing.telemetry import (
    BadField,
    EngineLoadSummary,
    GpuCheck,
    GpuSummary,
    LoadCheck,
    number,
    text,
)
from xds_server.process.frozen import fast_init

__all__ = [
    "REASONS",
    "AgentEdge",
    "BadField",
    "Checked",
    "CheckedHeartbeat",
    "CheckedPong",
    "CheckedResult",
    "EngineLoadSummary",
    "GpuSummary",
    "TelemetrySummary",
]

REASONS = frozenset({"not_finite", "negative", "out_of_range", "unknown_enum", "too_long", "too_many",
                     "empty", "mismatch"})

_FAILURE = {
    probe_pb2.FAILURE_KIND_UNSPECIFIED: ProbeResultKind.OK,
    probe_pb2.FAILURE_KIND_TIMEOUT: ProbeResultKind.TIMEOUT,
    probe_pb2.FAILURE_KIND_CONNECT: ProbeResultKind.CONNECT,
    probe_pb2.FAILURE_KIND_HTTP_STATUS: ProbeResultKind.HTTP_STATUS,
    probe_pb2.FAILURE_KIND_ENGINE_FATAL: ProbeResultKind.ENGINE_FATAL,
    probe_pb2.FAILURE_KIND_BAD_OUTPUT: ProbeResultKind.BAD_OUTPUT,
}
_ENGINE_STATE = {
    probe_pb2.ENGINE_STATE_UNSPECIFIED: EngineState.COLD,
    probe_pb2.ENGINE_STATE_COLD: EngineState.COLD,
    probe_pb2.ENGINE_STATE_WARMING: EngineState.WARMING,
    probe_pb2.ENGINE_STATE_READY: EngineState.READY,
    probe_pb2.ENGINE_STATE_FAILED: EngineState.FAILED,
}
@fast_init
@dataclass(frozen=True, slots=True)
class TelemetrySummary:
    """What the control plane keeps of a heartbeat's telemetry (for ``/nodes``): only checked values."""

    engine_state: EngineState
    stalled: bool
    stall_detail: str
    load: EngineLoadSummary
    gpu: GpuSummary

    def to_json(self) -> dict:
        """The ``engine_load`` and ``gpu`` parts of a ``/nodes`` entry."""
        return {"engine_load": self.load.to_json(), "gpu": self.gpu.to_json()}


@fast_init
@dataclass(frozen=True, slots=True)
class CheckedHeartbeat:
    """A heartbeat: the model's observation and the telemetry summary (the last heartbeat's
    object again when its values are the same)."""

    observation: HeartbeatObserved
    telemetry: TelemetrySummary


@fast_init
@dataclass(frozen=True, slots=True)
class CheckedPong:
    seq: int


@fast_init
@dataclass(frozen=True, slots=True)
class CheckedResult:
    """A micro-probe result for the model (``detail`` clipped, ``ttft_ms`` finite and in range)."""

    observation: ProbeObserved


Checked = CheckedHeartbeat | CheckedPong | CheckedResult


class AgentEdge:
    """Checks agent messages against ``probe`` bounds; fatal Xids from ``health.load.fatal_xids``."""

    def __init__(self, health: HealthConfig, probe: ProbeConfig) -> None:
        self.health = health
        self.probe = probe
        self.load = LoadCheck(probe)
        self.gpu = GpuCheck(probe, frozenset(health.load.fatal_xids))
        self._last_hb: CheckedHeartbeat | None = None

    def stream_started(self) -> None:
        """A new stream: a GPU poll_seq seen on an earlier one promises nothing."""
        self.gpu.stream_started()

    # -- field helpers (append to ``bad``) --------------------------------------------------------

    def _text(self, value: str, name: str, bad: list[BadField]) -> str:
        return text(value, name, self.probe.limits.max_text_chars, bad)

    _number = staticmethod(number)

    # -- messages ---------------------------------------------------------------------------------

    def check(self, msg: probe_pb2.AgentMessage, *,
              vouched: bool = False) -> tuple[Checked | None, list[BadField]]:
        """Validate one message. Returns (checked message or None when rejected, bad fields).
        ``vouched``: a heartbeat came on a stream whose transport carries liveness
        (``HeartbeatObserved.vouched``)."""
        bad: list[BadField] = []
        which = msg.WhichOneof("msg")
        if which == "heartbeat":
            return self._heartbeat(msg.heartbeat, bad, vouched), bad
        if which == "pong":
            return CheckedPong(msg.pong.seq), bad
        if which == "inference_result":
            return self._result(msg.inference_result, bad), bad
        bad.append(BadField("agent_message", "empty"))
        return None, bad

    def _heartbeat(self, hb: probe_pb2.Heartbeat, bad: list[BadField], vouched: bool) -> CheckedHeartbeat:
        tel = hb.telemetry
        max_text = self.probe.limits.max_text_chars
        interval = hb.interval_ms
        if interval and not 1 <= interval <= 3_600_000:
            bad.append(BadField("heartbeat.interval_ms", "out_of_range"))
        if len(hb.node_id) > max_text:
            bad.append(BadField("heartbeat.node_id", "too_long"))
        engine_state = _ENGINE_STATE.get(tel.engine_state)
        if engine_state is None:
            bad.append(BadField("heartbeat.telemetry.engine_state", "unknown_enum"))
            engine_state = EngineState.COLD  # unknown reads as COLD: not routed until a known state arrives
        stall_detail = tel.stall_detail
        if len(stall_detail) > max_text:
            stall_detail = self._text(stall_detail, "heartbeat.telemetry.stall_detail", bad)
        load = self.load.check(tel.engine_load, bad)
        gpu, free, fatal = self.gpu.check(tel.gpu, bad)
        progress_age_ms: float | None = None
        if tel.HasField("progress_age_ms"):
            progress_age_ms = self._number(tel.progress_age_ms, "heartbeat.telemetry.progress_age_ms",
                                           0.0, 3_600_000.0, bad)
        progress_detail = tel.progress_detail
        if len(progress_detail) > max_text:
            progress_detail = self._text(progress_detail, "heartbeat.telemetry.progress_detail", bad)
        stalled = tel.stalled
        if progress_age_ms is None:
            progress_detail = ""
        last = self._last_hb
        if last is not None:
            o, t = last.observation, last.telemetry
            if (t.load is load and t.gpu is gpu and o.engine_state is engine_state and o.stalled == stalled
                    and o.stall_detail == stall_detail and o.gpu_free_ratio == free and o.gpu_fatal == fatal
                    and o.progress_age_ms is None and progress_age_ms is None and o.vouched is vouched):
                # the same values as the last heartbeat: its (immutable) result again
                if self._same_free_sign(o.gpu_free_ratio, free):
                    return last
        obs = HeartbeatObserved(
            engine_state=engine_state, stalled=stalled, stall_detail=stall_detail,
            requests_running=load.requests_running, requests_waiting=load.requests_waiting,
            gpu_free_ratio=free, gpu_fatal=fatal, progress_age_ms=progress_age_ms,
            progress_detail=progress_detail, vouched=vouched)
        out = CheckedHeartbeat(obs, TelemetrySummary(engine_state, stalled, stall_detail, load, gpu))
        self._last_hb = out
        return out

    @staticmethod
    def _same_free_sign(a: float | None, b: float | None) -> bool:
        return a is None or b is None or a != 0.0 or math.copysign(1.0, a) == math.copysign(1.0, b)

    def _result(self, r: probe_pb2.InferenceResult, bad: list[BadField]) -> CheckedResult | None:
        p = "inference_result."
        detail = self._text(r.detail, p + "detail", bad)
        self._text(r.trigger, p + "trigger", bad)
        if r.headers_ms:
            self._number(r.headers_ms, p + "headers_ms", 0.0, math.inf, bad)
        status = r.http_status
        if not 0 <= status <= 999:
            bad.append(BadField(p + "http_status", "out_of_range"))
            status = 0
        if r.ok:
            ttft = self._number(r.ttft_ms, p + "ttft_ms", 0.0, self.probe.limits.max_ttft.ms, bad)
            if ttft is None:
                return None  # an "ok" probe without a believable TTFT says nothing
            return CheckedResult(ProbeObserved(kind=ProbeResultKind.OK, ttft_ms=ttft, http_status=status,
                                               detail=detail))
        kind = _FAILURE.get(r.failure)
        if kind is None:
            bad.append(BadField(p + "failure", "unknown_enum"))
            kind = ProbeResultKind.BAD_OUTPUT
        elif kind is ProbeResultKind.OK:
            kind = ProbeResultKind.BAD_OUTPUT  # ok=false without a failure kind
        if r.ttft_ms and not math.isfinite(r.ttft_ms):
            bad.append(BadField(p + "ttft_ms", "not_finite"))
        return CheckedResult(ProbeObserved(kind=kind, ttft_ms=0.0, http_status=status, detail=detail))
