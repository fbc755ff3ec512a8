"""The heartbeat's telemetry parts checked at the agent edge: engine load and GPU readings.

Each check keeps what it last checked and gives the same (immutable) result again without
checking field by field when the part is the same as last time:

- :class:`LoadCheck`: the engine load is compared as a message with a kept copy (upb's compare,
  exact to the bit: ``0.0`` and ``-0.0`` differ, a NaN equals the same NaN), after the kept
  copy takes the heartbeat's ``generation_tokens_total`` and ``requests_finished_total``, the
  counters that move with every scrape of a busy engine and that are range-checked apart (the
  finished count is kept as :attr:`LoadCheck.finished`, for shedding). ~0.3 us instead of
  ~2-3 us of field reads and range checks.
- :class:`GpuCheck`: the GPU part is the same while its ``poll_seq`` repeats on the stream (the
  agent's promise, new with every NVML poll; a broken promise keeps the last *checked* readings,
  never unchecked ones); an unnumbered part (0) is compared as a message.

Bad fields go to the caller's ``bad`` list as :class:`BadField` ``(field, reason)`` (reasons:
see :mod:`xds_server.probing.edge`), also when a result is reused. Nothing here raises on agent
input; nothing here does I/O.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from node_probe.proto import probe_pb2
from xds_server.config import ProbeConfig
from xds_server.process.frozen import fast_init
from xds_server.process.untrusted import clip

__all__ = [
    "NVML_UNKNOWN",
    "BadField",
    "EngineLoadSummary",
    "GpuCheck",
    "GpuSummary",
    "LoadCheck",
    "number",
    "text",
]

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
_P_FINISHED = _P_LOAD + "requests_finished_total"
_P_GPU = "heartbeat.telemetry.gpu."
_P_READING = _P_GPU + "gpus."


@fast_init
@dataclass(frozen=True, slots=True)
class BadField:
    """One rejected, dropped or clamped field: dotted proto path and a reason."""

    field: str
    reason: str


def number(value: float, name: str, lo: float, hi: float, bad: list[BadField]) -> float | None:
    """``value`` if finite and within [lo, hi], else None (counted in ``bad``)."""
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


def text(value: str, name: str, max_chars: int, bad: list[BadField]) -> str:
    """``value`` clipped to ``max_chars`` (counted ``too_long`` in ``bad`` when it was longer)."""
    if len(value) > max_chars:
        bad.append(BadField(name, "too_long"))
        return clip(value, max_chars)
    return value


@fast_init
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


@fast_init
@dataclass(frozen=True, slots=True)
class GpuSummary:
    """NVML state name (``NVML_STATE_UNKNOWN`` for a value we do not know), GPU count, error text."""

    nvml: str
    gpus: int
    error: str

    def to_json(self) -> dict:
        return {"nvml": self.nvml, "gpus": self.gpus, "error": self.error or None}


def _same_zero_sign(last: EngineLoadSummary, waiting: float | None, running: float | None,
                    kv: float | None) -> bool:
    """``-0.0 == 0.0``: the kept summary is reused only when its zeros have the same sign too."""
    for a, b in ((last.requests_waiting, waiting), (last.requests_running, running),
                 (last.kv_cache_usage_ratio, kv)):
        if a == 0.0 and math.copysign(1.0, a) != math.copysign(1.0, b):  # type: ignore[arg-type]  # b == a: a float
            return False
    return True


class LoadCheck:
    """The engine load of one stream's heartbeats, checked against ``probe`` bounds.
    ``finished``: the last heartbeat's ``requests_finished_total`` when it had a valid one
    (a count >= 0; None: absent or bad)."""

    def __init__(self, probe: ProbeConfig) -> None:
        self.probe = probe
        self.finished: float | None = None
        # the last load message checked (our copy), whether it had generation_tokens_total and
        # requests_finished_total, its summary and its bad fields other than those counters'
        self._memo: tuple[probe_pb2.EngineLoad, bool, bool, EngineLoadSummary, tuple[BadField, ...]] | None = None

    def check(self, load: probe_pb2.EngineLoad, bad: list[BadField]) -> EngineLoadSummary:
        """The load's summary (the last one again when the load is the same but for its
        counters); bad fields appended to ``bad``."""
        memo = self._memo
        if memo is not None:
            kept, tokens_kept, finished_kept, summary, kept_bad = memo
            tokens = fin = 0.0
            if tokens_kept:
                tokens = kept.generation_tokens_total = load.generation_tokens_total
            if finished_kept:
                fin = kept.requests_finished_total = load.requests_finished_total
            if kept == load:
                self._counters(tokens, fin, finished_kept, bad)
                if kept_bad:
                    bad.extend(kept_bad)
                return summary
        load_bad: list[BadField] = []
        summary = self._check(load, load_bad, None if memo is None else memo[3])
        kept = probe_pb2.EngineLoad()
        kept.CopyFrom(load)  # our own copy: the caller may change its message
        tokens_kept = load.HasField("generation_tokens_total")
        finished_kept = load.HasField("requests_finished_total")
        self._memo = (kept, tokens_kept, finished_kept, summary, tuple(load_bad))
        bad.extend(load_bad)
        self._counters(load.generation_tokens_total if tokens_kept else 0.0,
                       load.requests_finished_total if finished_kept else 0.0, finished_kept, bad)
        return summary

    def _counters(self, tokens: float, fin: float, has_fin: bool, bad: list[BadField]) -> None:
        """Range-check the two counters (0.0 for one absent) and keep the finished count."""
        if not 0.0 <= tokens < math.inf:
            number(tokens, _P_TOKENS, 0.0, math.inf, bad)
        if 0.0 <= fin < math.inf:
            self.finished = fin if has_fin else None
        else:
            self.finished = None
            number(fin, _P_FINISHED, 0.0, math.inf, bad)

    def _check(self, load: probe_pb2.EngineLoad, bad: list[BadField],
               last: EngineLoadSummary | None) -> EngineLoadSummary:
        """Every field but the token counter; ``last`` again when nothing it keeps changed."""
        # A value in range is taken as is (``lo <= v <= hi`` is False for NaN and for an infinity
        # past a finite bound); anything else goes through number() for its reason.
        has = load.HasField
        hi = self.probe.limits.max_requests
        top = hi if hi < math.inf else sys.float_info.max  # an infinite bound still rejects inf
        waiting = running = kv = None
        if has("requests_waiting"):
            v = load.requests_waiting
            waiting = v if 0.0 <= v <= top else number(v, _P_WAITING, 0.0, hi, bad)
        if has("requests_running"):
            v = load.requests_running
            running = v if 0.0 <= v <= top else number(v, _P_RUNNING, 0.0, hi, bad)
        if has("kv_cache_usage_ratio"):
            v = load.kv_cache_usage_ratio
            kv = v if 0.0 <= v <= 1.0 else number(v, _P_KV, 0.0, 1.0, bad)
        if has("prefix_cache_hit_ratio") and not 0.0 <= load.prefix_cache_hit_ratio <= 1.0:
            number(load.prefix_cache_hit_ratio, _P_PREFIX, 0.0, 1.0, bad)
        max_text = self.probe.limits.max_text_chars
        metrics_error = text(load.metrics_error, _P_LOAD + "metrics_error", max_text, bad)
        metric = text(load.kv_cache_metric, _P_LOAD + "kv_cache_metric", max_text, bad)
        ok = load.metrics_ok
        if (last is not None and last.metrics_ok == ok and last.requests_waiting == waiting
                and last.requests_running == running and last.kv_cache_usage_ratio == kv
                and last.kv_cache_metric == metric and last.metrics_error == ("" if ok else metrics_error)
                and _same_zero_sign(last, waiting, running, kv)):
            return last
        return EngineLoadSummary(ok, waiting, running, kv, metric, "" if ok else metrics_error)


class GpuCheck:
    """The GPU part of one stream's heartbeats; fatal Xids from ``fatal_xids``."""

    def __init__(self, probe: ProbeConfig, fatal_xids: frozenset[int]) -> None:
        self.probe = probe
        self.fatal_xids = fatal_xids
        # the last part's poll_seq, the part as received (when not numbered), its checked result
        # and bad fields
        self._memo: tuple[int, probe_pb2.GpuTelemetry | None,
                          tuple[GpuSummary, float | None, str, tuple[BadField, ...]]] | None = None

    def stream_started(self) -> None:
        """A new stream: a poll_seq seen on an earlier one promises nothing."""
        self._memo = None

    def check(self, gpu: probe_pb2.GpuTelemetry, bad: list[BadField]) -> tuple[GpuSummary, float | None, str]:
        """(summary, free ratio of the least free GPU with both memory fields, first fatal event);
        the last result again while the part is unchanged (module docstring)."""
        memo = self._memo
        seq = gpu.poll_seq
        if memo is not None and (seq == memo[0] if seq else memo[1] is not None and memo[1] == gpu):
            summary, free, fatal, gpu_bad = memo[2]
        else:
            gpu_bad_list: list[BadField] = []
            summary, free, fatal = self._check(gpu, gpu_bad_list)
            gpu_bad = tuple(gpu_bad_list)
            kept = None
            if not seq:
                kept = probe_pb2.GpuTelemetry()
                kept.CopyFrom(gpu)  # our own copy: the caller may change its message
            self._memo = (seq, kept, (summary, free, fatal, gpu_bad))
        if gpu_bad:
            bad.extend(gpu_bad)
        return summary, free, fatal

    def _check(self, gpu: probe_pb2.GpuTelemetry, bad: list[BadField]) -> tuple[GpuSummary, float | None, str]:
        p = _P_GPU
        nvml = _NVML.get(gpu.state)
        if nvml is None:
            bad.append(BadField(p + "state", "unknown_enum"))
            nvml = NVML_UNKNOWN
        max_text = self.probe.limits.max_text_chars
        error = text(gpu.error, p + "error", max_text, bad)
        readings: Sequence[probe_pb2.GpuReading] = gpu.gpus
        count = len(readings)
        if count > self.probe.limits.max_gpus:
            bad.append(BadField(p + "gpus", "too_many"))
            readings = list(readings)[: self.probe.limits.max_gpus]
        free: float | None = None
        fatal = ""
        n_items = self.probe.limits.max_list_items
        for g in readings:
            if len(g.uuid) > max_text:
                bad.append(BadField(_P_READING + "uuid", "too_long"))
            if len(g.name) > max_text:
                bad.append(BadField(_P_READING + "name", "too_long"))
            # an unset optional reads 0, which is in every range below: no presence check needed
            v = g.utilization_ratio
            if not 0.0 <= v <= 1.0:
                number(v, _P_READING + "utilization_ratio", 0.0, 1.0, bad)
            v = g.temperature_c
            if not -273.15 <= v <= 1000.0:
                number(v, _P_READING + "temperature_c", -273.15, 1000.0, bad)
            v = g.power_w
            if not 0.0 <= v <= 1e6:
                number(v, _P_READING + "power_w", 0.0, 1e6, bad)
            xids: Sequence[int] = g.xid_events
            if len(xids) > n_items:
                bad.append(BadField(_P_READING + "xid_events", "too_many"))
                xids = list(xids)[:n_items]
            errors: Sequence[str] = g.errors
            if errors:
                errors = list(errors)
                if len(errors) > n_items:
                    bad.append(BadField(_P_READING + "errors", "too_many"))
                    errors = errors[:n_items]
                errors = [text(e, _P_READING + "errors", max_text, bad) for e in errors]
            total = g.memory_total_bytes  # unset reads 0, skipped as a total of 0 is
            if total > 0 and g.HasField("memory_used_bytes"):
                used = g.memory_used_bytes
                if used > total:
                    bad.append(BadField(_P_READING + "memory_used_bytes", "out_of_range"))
                r = max(0.0, 1.0 - used / total)
                free = r if free is None else min(free, r)
            if not fatal and (xids or errors):
                hits = [x for x in xids if x in self.fatal_xids]
                if hits:
                    fatal = f"GPU {g.index} Xid {hits[0]}"
                elif any("GpuIsLost" in e for e in errors):
                    fatal = f"GPU {g.index} lost (NVML GpuIsLost)"
        return GpuSummary(nvml, count, error), free, fatal
