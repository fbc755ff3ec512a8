"""What a probe result means: its outcome class (good, slow, fail, fatal, busy) and a description.

Pure: reads the result, the node's engine telemetry (busy? evidence of progress?), the time and the config.
"""
from __future__ import annotations

from xds_server.config import HealthConfig
from xds_server.health.records import NodeHealth, ProbeObserved, ProbeOutcome, ProbeResultKind

__all__ = ["classify_probe"]

_DETAIL_CHARS = 120       # agent-supplied detail kept in a reason
_FATAL_DETAIL_CHARS = 160


def _progress_evidence(nh: NodeHealth, now_s: float, cfg: HealthConfig) -> str | None:
    """The agent's evidence that the engine progresses, as reason text, or None: requests
    running, not stalled, and a progress signal moved at most ``busy_progress_window_ms`` ago."""
    e = nh.engine
    if (e.requests_running or 0) <= 0 or e.stalled or e.progress_at_s is None:
        return None
    if now_s - e.progress_at_s > cfg.busy_progress_window_ms / 1000.0:
        return None
    return e.progress_detail[:_DETAIL_CHARS] or f"{e.requests_running:.0f} running, progressing"


def _with(text: str, detail: str) -> str:
    return text + (f": {detail[:_DETAIL_CHARS]}" if detail else "")


def classify_probe(nh: NodeHealth, obs: ProbeObserved, cfg: HealthConfig,
                   now_s: float) -> tuple[ProbeOutcome, str]:
    """A probe result's outcome class and a description for the reason line (at ``now_s``, s).

    A slow probe, a timeout or an HTTP status in ``saturated_http_statuses`` while the agent
    shows evidence of progress (``_progress_evidence``) is BUSY, described as
    ``"busy: <what>; progressing: <evidence>"``; a status in ``busy_http_statuses`` is always
    BUSY (the engine says it is full, fc07). Without evidence a timeout is a failure, however
    many requests run: a hung engine is never called busy.
    """
    k = obs.kind
    if k is ProbeResultKind.OK:
        if obs.ttft_ms < cfg.ttft_healthy_ms:
            return ProbeOutcome.GOOD, f"TTFT {obs.ttft_ms:.0f} ms"
        if obs.ttft_ms < cfg.ttft_timeout_ms:
            out, what = ProbeOutcome.SLOW, f"probe TTFT {obs.ttft_ms:.0f} ms >= {cfg.ttft_healthy_ms:.0f} ms"
        else:
            out, what = ProbeOutcome.FAIL, (f"inference timeout (TTFT {obs.ttft_ms:.0f} ms >= "
                                            f"{cfg.ttft_timeout_ms:.0f} ms)")
    elif k is ProbeResultKind.ENGINE_FATAL:
        return ProbeOutcome.FATAL, f"engine fatal error: {obs.detail[:_FATAL_DETAIL_CHARS]}"
    elif k is ProbeResultKind.TIMEOUT:
        out, what = ProbeOutcome.FAIL, _with(f"inference timeout (no token within {cfg.ttft_timeout_ms:.0f} ms)",
                                             obs.detail)
    elif k is ProbeResultKind.HTTP_STATUS:
        out, what = ProbeOutcome.FAIL, _with(f"HTTP {obs.http_status}", obs.detail)
    else:
        out, what = ProbeOutcome.FAIL, _with(k.value, obs.detail)
    http = k is ProbeResultKind.HTTP_STATUS
    evidence = _progress_evidence(nh, now_s, cfg)
    if http and obs.http_status in cfg.busy_http_statuses:
        tail = f"; progressing: {evidence}" if evidence else ""
        return ProbeOutcome.BUSY, f"busy: saturated, the engine refuses work ({what}){tail}"
    if evidence is not None and (
            k in (ProbeResultKind.TIMEOUT, ProbeResultKind.OK) or (http and obs.http_status in cfg.saturated_http_statuses)):
        return ProbeOutcome.BUSY, f"busy: saturated, {what}; progressing: {evidence}"
    return out, what
