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
import sys
from dataclasses import dataclass
from typing import Union

from node_probe.proto import probe_pb2
from xds_server.config import HealthConfig, ProbeConfig
from xds_server.health.model import EngineState, HeartbeatObserved, ProbeObserved, ProbeResultKind
from xds_server.untrusted import clip

__all__ = ["AgentEdge", "BadField", "Checked", "CheckedHeartbeat", "CheckedPong", "CheckedResult",
           "EngineLoadSummary", "GpuSummary", "REASONS", "TelemetrySummary"]

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
_NVML = {
    probe_pb2.NVML_STATE_UNSPECIFIED: "NVML_STATE_UNSPECIFIED",
    probe_pb2.NVML_STATE_OK: "NVML_STATE_OK",
    probe_pb2.NVML_STATE_ABSENT: "NVML_STATE_ABSENT",
    probe_pb2.NVML_STATE_ERROR: "NVML_STATE_ERROR",
}
NVML_UNKNOWN = "NVML_STATE_UNKNOWN"
_P_LOAD = "heartbeat.telemetry.engine_load."
_P_WAITING = _P_LOAD + "requests_waiting"
_P_RUNNING = _P_LOAD + "requests_running"
_P_KV = _P_LOAD + "kv_cache_usage_ratio"
_P_PREFIX = _P_LOAD + "prefix_cache_hit_ratio"
_P_TOKENS = _P_LOAD + "generation_tokens_total"
_P_GPU = "heartbeat.telemetry.gpu."
_P_READING = _P_GPU + "gpus."


def _copy(gpu: probe_pb2.GpuTelemetry) -> probe_pb2.GpuTelemetry:
    kept = probe_pb2.GpuTelemetry()
    kept.CopyFrom(gpu)
    return kept


def _same_zero_sign(last: "EngineLoadSummary", waiting: float | None, running: float | None,
                    kv: float | None) -> bool:
    """``-0.0 == 0.0``: the kept summary is reused only when its zeros have the same sign too."""
    for a, b in ((last.requests_waiting, waiting), (last.requests_running, running),
                 (last.kv_cache_usage_ratio, kv)):
        if a == 0.0 and math.copysign(1.0, a) != math.copysign(1.0, b):  # type: ignore[arg-type]
            return False
    return True


@dataclass(frozen=True, slots=True)
class BadField:
    """One rejected, dropped or clamped field: dotted proto path and a reason from :data:`REASONS`."""

    field: str
    reason: str


@dataclass(frozen=True, slots=True)
class EngineLoadSummary:
    """Validated engine load: counts >= 0 (None = unknown), ratio 0..1, metric name clipped."""

    metrics_ok: bool
    requests_waiting: float | None
    requests_running: float | None
    kv_cache_usage_ratio: float | None
    kv_cache_metric: str
    metrics_error: str = ""   # why the agent could not read the engine's /metrics (clipped)

    def to_json(self) -> dict:
        return {"metrics_ok": self.metrics_ok, "requests_waiting": self.requests_waiting,
                "requests_running": self.requests_running, "kv_cache_usage_ratio": self.kv_cache_usage_ratio,
                "kv_cache_metric": self.kv_cache_metric or None, "metrics_error": self.metrics_error or None}


@dataclass(frozen=True, slots=True)
class GpuSummary:
    """NVML state name (``NVML_STATE_UNKNOWN`` for a value we do not know), GPU count, error text."""

    nvml: str
    gpus: int
    error: str

    def to_json(self) -> dict:
        return {"nvml": self.nvml, "gpus": self.gpus, "error": self.error or None}


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


@dataclass(frozen=True, slots=True)
class CheckedHeartbeat:
    """A heartbeat: ``seq``, the model's observation and the telemetry summary."""

    seq: int
    observation: HeartbeatObserved
    telemetry: TelemetrySummary


@dataclass(frozen=True, slots=True)
class CheckedPong:
    seq: int


@dataclass(frozen=True, slots=True)
class CheckedResult:
    """A micro-probe result for the model (``detail`` clipped, ``ttft_ms`` finite and in range)."""

    observation: ProbeObserved


Checked = Union[CheckedHeartbeat, CheckedPong, CheckedResult]


class AgentEdge:
    """Checks agent messages against ``probe`` bounds; fatal Xids from ``health.fatal_xids``."""

    def __init__(self, health: HealthConfig, probe: ProbeConfig) -> None:
        self.health = health
        self.probe = probe
        self._fatal_xids = frozenset(health.fatal_xids)
        # Kept from the last heartbeat: the GPU part's poll_seq, the part as received (when not
        # numbered), its checked result and bad fields; the engine-load summary (reused while
        # equal: no object per heartbeat).
        self._gpu_memo: tuple[int, probe_pb2.GpuTelemetry | None,
                              tuple[GpuSummary, float | None, str, tuple[BadField, ...]]] | None = None
        self._last_load: EngineLoadSummary | None = None
        self._last_hb: CheckedHeartbeat | None = None

    def stream_started(self) -> None:
        """A new stream: a GPU poll_seq seen on an earlier one promises nothing."""
        self._gpu_memo = None

    # -- field helpers (append to ``bad``) --------------------------------------------------------

    def _text(self, value: str, name: str, bad: list[BadField]) -> str:
        if len(value) > self.probe.max_text_chars:
            bad.append(BadField(name, "too_long"))
            return clip(value, self.probe.max_text_chars)
        return value

    @staticmethod
    def _number(value: float, name: str, lo: float, hi: float, bad: list[BadField]) -> float | None:
        """``value`` if finite and within [lo, hi], else None (counted)."""
        if not math.isfinite(value):
            bad.append(BadField(name, "not_finite"))
            return None
        if value < lo:
            bad.append(BadField(name, "negative" if lo == 0 and value < 0 else "out_of_range"))
            return None
        if value > hi:
            bad.append(BadField(name, "out_of_range"))
            return None
        return value

    # -- messages ---------------------------------------------------------------------------------

    def check(self, msg: probe_pb2.AgentMessage) -> tuple[Checked | None, list[BadField]]:
        """Validate one message. Returns (checked message or None when rejected, bad fields)."""
        bad: list[BadField] = []
        which = msg.WhichOneof("msg")
        if which == "heartbeat":
            return self._heartbeat(msg.heartbeat, bad), bad
        if which == "pong":
            return CheckedPong(msg.pong.seq), bad
        if which == "inference_result":
            return self._result(msg.inference_result, bad), bad
        bad.append(BadField("agent_message", "empty"))
        return None, bad

    def _heartbeat(self, hb: probe_pb2.Heartbeat, bad: list[BadField]) -> CheckedHeartbeat:
        tel = hb.telemetry
        max_text = self.probe.max_text_chars
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
        load = self._load(tel.engine_load, bad)
        # GPU readings move once per NVML poll (1 s), heartbeats every 100 ms: an unchanged GPU part
        # (the last poll_seq again, the agent's promise: a broken one keeps the last checked readings,
        # never unchecked ones; an equal message when not numbered) is not checked again.
        gpu_msg = tel.gpu
        memo = self._gpu_memo
        seq = gpu_msg.poll_seq
        if memo is not None and (seq == memo[0] if seq else memo[1] is not None and memo[1] == gpu_msg):
            gpu, free, fatal, gpu_bad = memo[2]
        else:
            gpu_bad = []
            gpu, free, fatal = self._gpu(gpu_msg, gpu_bad)
            kept = None if seq else _copy(gpu_msg)  # our own copy: the caller may change its message
            self._gpu_memo = (seq, kept, (gpu, free, fatal, tuple(gpu_bad)))
        if gpu_bad:
            bad.extend(gpu_bad)
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
                    and o.progress_age_ms is None and progress_age_ms is None):
                # the same values as the last heartbeat: its (immutable) observation and summary
                if self._same_free_sign(o.gpu_free_ratio, free):
                    return CheckedHeartbeat(hb.seq, o, t)
        obs = HeartbeatObserved(
            engine_state=engine_state, stalled=stalled, stall_detail=stall_detail,
            requests_running=load.requests_running, requests_waiting=load.requests_waiting,
            gpu_free_ratio=free, gpu_fatal=fatal, progress_age_ms=progress_age_ms,
            progress_detail=progress_detail)
        out = CheckedHeartbeat(hb.seq, obs, TelemetrySummary(engine_state, stalled, stall_detail, load, gpu))
        self._last_hb = out
        return out

    @staticmethod
    def _same_free_sign(a: float | None, b: float | None) -> bool:
        return a is None or b is None or a != 0.0 or math.copysign(1.0, a) == math.copysign(1.0, b)

    def _load(self, load: probe_pb2.EngineLoad, bad: list[BadField]) -> EngineLoadSummary:
        """The engine load, checked; the last summary again when nothing it keeps changed."""
        # A value in range is taken as is (``lo <= v <= hi`` is False for NaN and for an infinity
        # past a finite bound); anything else goes through _number for its reason.
        num = self._number
        has = load.HasField
        hi = self.probe.max_requests
        top = hi if hi < math.inf else sys.float_info.max  # an infinite bound still rejects inf
        waiting = running = kv = None
        if has("requests_waiting"):
            v = load.requests_waiting
            waiting = v if 0.0 <= v <= top else num(v, _P_WAITING, 0.0, hi, bad)
        if has("requests_running"):
            v = load.requests_running
            running = v if 0.0 <= v <= top else num(v, _P_RUNNING, 0.0, hi, bad)
        if has("kv_cache_usage_ratio"):
            v = load.kv_cache_usage_ratio
            kv = v if 0.0 <= v <= 1.0 else num(v, _P_KV, 0.0, 1.0, bad)
        if has("prefix_cache_hit_ratio") and not 0.0 <= load.prefix_cache_hit_ratio <= 1.0:
            num(load.prefix_cache_hit_ratio, _P_PREFIX, 0.0, 1.0, bad)
        if has("generation_tokens_total") and not 0.0 <= load.generation_tokens_total < math.inf:
            num(load.generation_tokens_total, _P_TOKENS, 0.0, math.inf, bad)
        max_text = self.probe.max_text_chars
        metrics_error = load.metrics_error
        if len(metrics_error) > max_text:
            metrics_error = self._text(metrics_error, _P_LOAD + "metrics_error", bad)
        metric = load.kv_cache_metric
        if len(metric) > max_text:
            metric = self._text(metric, _P_LOAD + "kv_cache_metric", bad)
        ok = load.metrics_ok
        last = self._last_load
        if (last is not None and last.metrics_ok == ok and last.requests_waiting == waiting
                and last.requests_running == running and last.kv_cache_usage_ratio == kv
                and last.kv_cache_metric == metric and last.metrics_error == ("" if ok else metrics_error)
                and _same_zero_sign(last, waiting, running, kv)):
            return last
        self._last_load = out = EngineLoadSummary(ok, waiting, running, kv, metric, "" if ok else metrics_error)
        return out

    def _gpu(self, gpu: probe_pb2.GpuTelemetry, bad: list[BadField]) -> tuple[GpuSummary, float | None, str]:
        """(summary, free ratio of the least free GPU with both memory fields, first fatal event)."""
        p = _P_GPU
        nvml = _NVML.get(gpu.state)
        if nvml is None:
            bad.append(BadField(p + "state", "unknown_enum"))
            nvml = NVML_UNKNOWN
        error = self._text(gpu.error, p + "error", bad)
        readings = gpu.gpus
        count = len(readings)
        if count > self.probe.max_gpus:
            bad.append(BadField(p + "gpus", "too_many"))
            readings = list(readings)[: self.probe.max_gpus]
        free: float | None = None
        fatal = ""
        n_items = self.probe.max_list_items
        max_text = self.probe.max_text_chars
        num = self._number
        for g in readings:
            if len(g.uuid) > max_text:
                bad.append(BadField(_P_READING + "uuid", "too_long"))
            if len(g.name) > max_text:
                bad.append(BadField(_P_READING + "name", "too_long"))
            has = g.HasField
            if has("utilization_ratio"):
                num(g.utilization_ratio, _P_READING + "utilization_ratio", 0.0, 1.0, bad)
            if has("temperature_c"):
                num(g.temperature_c, _P_READING + "temperature_c", -273.15, 1000.0, bad)
            if has("power_w"):
                num(g.power_w, _P_READING + "power_w", 0.0, 1e6, bad)
            xids = g.xid_events
            if len(xids) > n_items:
                bad.append(BadField(_P_READING + "xid_events", "too_many"))
                xids = list(xids)[:n_items]
            errors = g.errors
            if errors:
                errors = list(errors)
                if len(errors) > n_items:
                    bad.append(BadField(_P_READING + "errors", "too_many"))
                    errors = errors[:n_items]
                errors = [self._text(e, _P_READING + "errors", bad) for e in errors]
            if has("memory_total_bytes") and has("memory_used_bytes"):
                total = g.memory_total_bytes
                if total > 0:
                    used = g.memory_used_bytes
                    if used > total:
                        bad.append(BadField(_P_READING + "memory_used_bytes", "out_of_range"))
                    r = max(0.0, 1.0 - used / total)
                    free = r if free is None else min(free, r)
            if not fatal and (xids or errors):
                hits = [x for x in xids if x in self._fatal_xids]
                if hits:
                    fatal = f"GPU {g.index} Xid {hits[0]}"
                elif any("GpuIsLost" in e for e in errors):
                    fatal = f"GPU {g.index} lost (NVML GpuIsLost)"
        return GpuSummary(nvml, count, error), free, fatal

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
            ttft = self._number(r.ttft_ms, p + "ttft_ms", 0.0, self.probe.max_ttft_ms, bad)
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
