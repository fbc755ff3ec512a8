"""Auto-detection of the engine family behind a URL (``--engine-kind auto``).

Order: the metric prefixes on ``/metrics`` (``vllm:``, ``sglang:``, ``tgi_``, ``nv_trt_llm_`` /
``nv_inference_``), then endpoints only one family serves (Triton's ``/v2/health/ready``, TGI's
``/info`` with a ``model_id``), then the ``owned_by`` of ``/v1/models`` (vLLM, SGLang). An engine
that answers HTTP but matches none of these is probed as a generic OpenAI-compatible server.
"""

from __future__ import annotations

import json
import re

import aiohttp

from node_probe.engines.http_helpers import EngineRequestError, get_text
from node_probe.proto import probe_pb2

__all__ = ["detect_engine_kind", "kind_from_metrics"]

_PREFIXES = (
    ("vllm", re.compile(r"^vllm:", re.MULTILINE)),
    ("sglang", re.compile(r"^sglang:", re.MULTILINE)),
    ("tgi", re.compile(r"^tgi_", re.MULTILINE)),
    ("triton", re.compile(r"^nv_(?:trt_llm|inference)_", re.MULTILINE)),
)


def kind_from_metrics(text: str) -> str | None:
    """Engine kind named by the sample prefixes of a ``/metrics`` page, ``None`` if unknown."""
    for kind, pattern in _PREFIXES:
        if pattern.search(text):
            return kind
    return None


async def _try(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, str] | None:
    """(status, body) of a GET, ``None`` when it did not answer (refused, timeout)."""
    try:
        return await get_text(session, url, timeout_s, ok_statuses=tuple(range(100, 600)))
    except EngineRequestError:
        return None


async def detect_engine_kind(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float,
    metrics_url: str | None = None,
) -> str:
    """Return the engine kind ("vllm", "sglang", "tgi", "triton" or "openai").

    Raises:
        EngineRequestError: the engine refuses connections (CONNECT), so nothing can be
            detected yet.
    """
    base = base_url.rstrip("/")
    try:
        status, text = await get_text(session, metrics_url or base + "/metrics", timeout_s,
                                      ok_statuses=tuple(range(100, 600)))
    except EngineRequestError as err:
        if err.kind == probe_pb2.FAILURE_KIND_CONNECT:
            raise
        status, text = 0, ""  # a /metrics that hangs or breaks: try the other signs
    if status == 200:
        kind = kind_from_metrics(text)
        if kind is not None:
            return kind
    ready = await _try(session, base + "/v2/health/ready", timeout_s)
    if ready is not None and ready[0] not in (404, 405):
        return "triton"
    info = await _try(session, base + "/info", timeout_s)
    if info is not None and info[0] == 200:
        try:
            doc = json.loads(info[1])
        except ValueError:
            doc = None
        if isinstance(doc, dict) and "model_id" in doc:
            return "tgi"
    models = await _try(session, base + "/v1/models", timeout_s)
    if models is not None and models[0] == 200:
        try:
            owners = {str(m.get("owned_by", "")).lower() for m in json.loads(models[1])["data"]}
        except (ValueError, KeyError, TypeError, AttributeError):
            owners = set()
        for kind in ("vllm", "sglang"):
            if kind in owners:
                return kind
    return "openai"
