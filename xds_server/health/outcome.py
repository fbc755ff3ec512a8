"""What a probe result means: its outcome class (good, slow, fail, fatal, busy) and a description.

Pure: reads the result, the node's engine telemetry (busy? evidence of progress?), the time and the config.
"""
from __future__ import annotations

from xds_server.config import HealthConfig
from xds_server.health.clocks import EPS_S, busy_confirm_s
from xds_server.health.records import NodeHealth, ProbeObserved, ProbeOutcome, ProbeResultKind

__all__ = ["answered_failure", "classify_probe", "is_refusal", "judge_busy_timeout", "refusal_evidence"]

_DETAIL_CHARS = 120       # agent-supplied detail kept in a reason
_FATAL_DETAIL_CHARS = 160


def _progress_evidence(nh: NodeHealth, now_s: float, cfg: HealthConfig, waited_s: float | None) -> str | None:
    """The agent's evidence that the engine progresses, as reason text, or None.

    Evidence: requests running, not stalled, and a progress signal moved at most
    ``busy.progress_window`` ago; for a probe that waited ``waited_s`` (s; a timeout waited
    ``probes.ttft_timeout``, a slow answer its TTFT) the signal must also have moved *during* that
    wait, so the text may say "progressing". An HTTP status is answered at once (``waited_s``
    None): the text gives the age instead ("last progress 0.3 s ago"), never "progressing".
    """
    e = nh.engine
    if (e.requests_running or 0) <= 0 or e.stalled or e.progress_at_s is None:
        return None
    age_s = max(0.0, now_s - e.progress_at_s)
    window_s = cfg.busy.progress_window.s
    if waited_s is not None:
        window_s = min(window_s, waited_s)
    if age_s > window_s:
        return None
    what = e.progress_detail[:_DETAIL_CHARS] or f"{e.requests_running:.0f} running"
    if waited_s is None:
        return f"last progress {age_s:.1f} s ago: {what}"
    return f"progressing: moved {age_s:.1f} s ago, within the probe's {waited_s:.1f} s wait: {what}"


def _with(text: str, detail: str) -> str:
    return text + (f": {detail[:_DETAIL_CHARS]}" if detail else "")


def classify_probe(nh: NodeHealth, obs: ProbeObserved, cfg: HealthConfig,
                   now_s: float) -> tuple[ProbeOutcome, str]:
    """A probe result's outcome class and a description for the reason line (at ``now_s``, s).

    A slow probe or a timeout while a progress signal moved during the probe's wait
    (``_progress_evidence``) is BUSY, described as ``"busy: saturated, <what>; progressing:
    moved 0.1 s ago, within the probe's 0.8 s wait: <evidence>"``; an HTTP status in
    ``saturated_http_statuses`` with evidence at most ``busy.progress_window`` old is BUSY
    with ``"last progress 0.3 s ago: <evidence>"``; a status in ``busy_http_statuses`` is always
    BUSY (the engine says it is full, fc07; :func:`is_refusal`). Without evidence a timeout is a
    failure, however many requests run: a hung engine is never called busy.
    """
    k = obs.kind
    if k is ProbeResultKind.OK:
        if obs.ttft_ms < cfg.probes.ttft_healthy.ms:
            return ProbeOutcome.GOOD, f"TTFT {obs.ttft_ms:.0f} ms"
        if obs.ttft_ms < cfg.probes.ttft_timeout.ms:
            out, what = ProbeOutcome.SLOW, f"probe TTFT {obs.ttft_ms:.0f} ms >= {cfg.probes.ttft_healthy.ms:.0f} ms"
        else:
            out, what = ProbeOutcome.FAIL, (f"inference timeout (TTFT {obs.ttft_ms:.0f} ms >= "
                                            f"{cfg.probes.ttft_timeout.ms:.0f} ms)")
    elif k is ProbeResultKind.ENGINE_FATAL:
        return ProbeOutcome.FATAL, f"engine fatal error: {obs.detail[:_FATAL_DETAIL_CHARS]}"
    elif k is ProbeResultKind.TIMEOUT:
        out, what = ProbeOutcome.FAIL, _with(f"inference timeout (no token within {cfg.probes.ttft_timeout.ms:.0f} ms)",
                                             obs.detail)
    elif k is ProbeResultKind.HTTP_STATUS:
        out, what = ProbeOutcome.FAIL, _with(f"HTTP {obs.http_status}", obs.detail)
    else:
        out, what = ProbeOutcome.FAIL, _with(k.value, obs.detail)
    http = k is ProbeResultKind.HTTP_STATUS
    waited_s = (None if http else
                obs.ttft_ms / 1000.0 if k is ProbeResultKind.OK else cfg.probes.ttft_timeout.s)
    evidence = _progress_evidence(nh, now_s, cfg, waited_s)
    if is_refusal(obs, cfg):
        tail = f"; {evidence}" if evidence else ""
        return ProbeOutcome.BUSY, f"busy: saturated, the engine refuses work ({what}){tail}"
    if evidence is not None and (k in (ProbeResultKind.TIMEOUT, ProbeResultKind.OK)
                                 or (http and obs.http_status in cfg.busy.saturated_http_statuses)):
        return ProbeOutcome.BUSY, f"busy: saturated, {what}; {evidence}"
    return out, what


def is_refusal(obs: ProbeObserved, cfg: HealthConfig) -> bool:
    """The engine refused the probe with a status in ``busy_http_statuses`` (it says it is full):
    busy, never a failure; a run of them only lasts ``busy.refusal_block`` before a soft block."""
    return obs.kind is ProbeResultKind.HTTP_STATUS and obs.http_status in cfg.busy.http_statuses


def refusal_evidence(nh: NodeHealth) -> str:
    """The current run of refusals as reason text, e.g. ``"busy: every probe answered HTTP 429
    for 12.0 s (5 probes, no good probe)"`` (from ``nh.probe``; generic when no run is recorded)."""
    p = nh.probe
    if p.refused_since_s is None or p.refused_last_s is None:
        return "busy: the engine refuses work"
    n = p.refused_probes
    return (f"busy: every probe answered HTTP {p.refused_status} for {p.refused_last_s - p.refused_since_s:.1f} s "
            f"({n} probe{'s' if n != 1 else ''}, no good probe)")


def answered_failure(obs: ProbeObserved) -> bool:
    """A failed probe that something answered as no loading engine does: an HTTP status other
    than 503 (what engines answer while loading), bad output or a fatal engine error."""
    k = obs.kind
    return (k is ProbeResultKind.HTTP_STATUS and obs.http_status != 503) or k in (
        ProbeResultKind.BAD_OUTPUT, ProbeResultKind.ENGINE_FATAL)


def judge_busy_timeout(nh: NodeHealth, now_s: float, cfg: HealthConfig) -> tuple[bool, str] | None:
    """A probe timeout with evidence of progress (``Probes.busy_timeout_s``: classified BUSY, not
    judged yet), judged at a heartbeat at ``now_s`` (s) from the engine record it just updated:
    ``(True, reason)`` once a progress signal moved after the timeout, or nothing runs any more
    (busy: saturated, never a failure; a hang keeps its requests running); ``(False, reason)``
    when the engine is reported stalled, shows no evidence while requests run, or nothing moved
    within :func:`~xds_server.health.clocks.busy_confirm_s` after it (a hang that began during
    the probe's wait: a failure, never called busy); None: not yet.
    "After" is more than half a heartbeat interval after it, so arrival jitter of the last move
    before the timeout is not read as a new one."""
    at, e = nh.probe.busy_timeout_s, nh.engine
    if at is None:
        return None
    timeout = f"inference timeout (no token within {cfg.probes.ttft_timeout.ms:.0f} ms)"
    moved = e.progress_at_s
    if (moved is not None and moved > at + cfg.heartbeat.interval.s / 2 and not e.stalled
            and (e.requests_running or 0) > 0):
        what = e.progress_detail[:_DETAIL_CHARS] or f"{e.requests_running:.0f} running"
        return True, (f"busy: saturated, {timeout}; progressing: moved {max(0.0, now_s - moved):.1f} s ago, "
                      f"after the probe timed out: {what}")
    waited = now_s - at
    if not e.stalled and (e.requests_running or 0) <= 0:  # a hang keeps its requests: this one drained
        return True, f"busy: saturated, {timeout}; nothing running {waited:.1f} s later: the load has drained"
    if e.stalled or moved is None or waited >= busy_confirm_s(nh, cfg) - EPS_S:
        since = "" if moved is None else f"; no progress for {max(0.0, now_s - moved):.1f} s"
        return False, f"{timeout}{since}, none in the {waited:.1f} s since it timed out: a hang, not load"
    return None
