"""What a probe result means: its outcome class (good, slow, fail, fatal, busy) and a description.

Pure: reads the result, the node's engine telemetry (busy? tokens advancing?) and the config.
"""
from __future__ import annotations

from xds_server.config import HealthConfig
from xds_server.health.records import NodeHealth, ProbeObserved, ProbeOutcome, ProbeResultKind

__all__ = ["classify_probe"]

_DETAIL_CHARS = 120       # agent-supplied detail kept in a reason
_FATAL_DETAIL_CHARS = 160


def _busy_progressing(nh: NodeHealth) -> bool:
    """The engine is busy and its token counter advances (agent says running > 0, not stalled)."""
    return (nh.engine.requests_running or 0) > 0 and not nh.engine.stalled


def _with(text: str, detail: str) -> str:
    return text + (f": {detail[:_DETAIL_CHARS]}" if detail else "")


def classify_probe(nh: NodeHealth, obs: ProbeObserved, cfg: HealthConfig) -> tuple[ProbeOutcome, str]:
    """A probe result's outcome class and a description for the reason line.

    A failure while the engine is busy and progressing is BUSY (saturated) when it is a timeout
    or an HTTP status in ``saturated_http_statuses``; a status in ``busy_http_statuses`` is
    always BUSY (fc07).
    """
    k = obs.kind
    if k is ProbeResultKind.OK:
        if obs.ttft_ms < cfg.ttft_healthy_ms:
            return ProbeOutcome.GOOD, f"TTFT {obs.ttft_ms:.0f} ms"
        if obs.ttft_ms < cfg.ttft_timeout_ms:
            return ProbeOutcome.SLOW, f"probe TTFT {obs.ttft_ms:.0f} ms >= {cfg.ttft_healthy_ms:.0f} ms"
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
    saturated = (http and obs.http_status in cfg.busy_http_statuses) or (_busy_progressing(nh) and (
        k in (ProbeResultKind.TIMEOUT, ProbeResultKind.OK) or (http and obs.http_status in cfg.saturated_http_statuses)))
    if saturated:
        return ProbeOutcome.BUSY, (f"saturated ({what}; {nh.engine.requests_running or 0:.0f} running, "
                                   "tokens advancing)")
    return out, what
