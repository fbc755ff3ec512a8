"""OpenAI-compatible inference servers: the generic adapter, and the module-level functions the
agent used before adapters existed (kept for callers and tests).

* :class:`OpenAICompatAdapter` probes ``POST /v1/completions`` (``max_tokens: 1``,
  ``temperature: 0``, ``stream: true``) and reads OpenAI SSE chunks (completions ``text`` or chat
  ``delta.content``; a role-only or empty chunk is not a token, a chunk that ends the choice with
  ``finish_reason`` "stop"/"length" is one: the engine ran a decode step even if it produced an
  end-of-sequence token with no text). Without a known cache-salt field it defeats prefix caching
  with a random prompt prefix. vLLM and SGLang subclass it.
* :func:`parse_metrics` reads both vLLM and SGLang metric names (first name found wins);
  :func:`micro_probe` is the vLLM probe (random ``cache_salt``); :func:`fetch_models` and
  :func:`fetch_metrics` are the plain GETs.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from node_probe.engines.base import (
    ENGINE_FATAL_PATTERN,
    PROBE_HEADER,
    ChunkError,
    ChunkToken,
    EngineAdapter,
    EngineLoadReading,
    EngineRequestError,
    MetricSpec,
    ProbeOutcome,
    ProbeRequest,
    fetch_metrics_text,
    get_text,
    is_engine_fatal_text,
    parse_with_spec,
    run_probe,
    sel,
    truncate,
)
from node_probe.proto import probe_pb2

__all__ = [
    "ENGINE_FATAL_PATTERN",
    "PROBE_HEADER",
    "EngineLoadReading",
    "EngineRequestError",
    "OpenAICompatAdapter",
    "ProbeOutcome",
    "fetch_metrics",
    "fetch_models",
    "is_engine_fatal_text",
    "micro_probe",
    "parse_metrics",
]

_GOOD_FINISH = frozenset({"stop", "length"})


def _choice_token(choice: Any) -> ChunkToken | None:
    if not isinstance(choice, dict):
        return None
    finish = choice.get("finish_reason")
    final = isinstance(finish, str) and finish in _GOOD_FINISH
    text = choice.get("text")
    if isinstance(text, str) and text:
        return ChunkToken(text, final)
    for key in ("delta", "message"):
        part = choice.get(key)
        if isinstance(part, dict):
            for name in ("content", "reasoning_content", "reasoning"):
                value = part.get(name)
                if isinstance(value, str) and value:
                    return ChunkToken(value, final)
    if final:
        # A finished choice with no text: the engine generated an end-of-sequence token.
        return ChunkToken("", True)
    return None


async def discover_openai_model(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float
) -> str:
    """First model id from ``GET /v1/models`` (raises :class:`EngineRequestError`)."""
    models = await fetch_models(session, base_url, timeout_s)
    if not models:
        raise EngineRequestError(
            probe_pb2.FAILURE_KIND_BAD_OUTPUT, "model discovery: no models listed", 200
        )
    return models[0]


class OpenAICompatAdapter(EngineAdapter):
    """Any OpenAI-compatible server (``/v1/completions``, ``/v1/models``, ``/health``).

    Metrics: vLLM and SGLang names (whichever the server exposes). Cache defeat: random prompt
    prefix (an unknown server may reject a ``cache_salt`` field).
    """

    kind = "openai"
    readiness_path = "/health"
    completion_path = "/v1/completions"
    metrics_spec = MetricSpec(
        running=(sel("vllm:num_requests_running"), sel("sglang:num_running_reqs")),
        waiting=(sel("vllm:num_requests_waiting"), sel("sglang:num_queue_reqs")),
        kv_usage=(sel("vllm:kv_cache_usage_perc"), sel("vllm:gpu_cache_usage_perc"),
                  sel("sglang:token_usage")),
        prefix_pairs=(
            (sel("vllm:prefix_cache_queries_total"), sel("vllm:prefix_cache_hits_total")),
            (sel("vllm:gpu_prefix_cache_queries_total"), sel("vllm:gpu_prefix_cache_hits_total")),
        ),
        prefix_gauges=(sel("vllm:gpu_prefix_cache_hit_rate"), sel("sglang:cache_hit_rate")),
        generation_tokens=(sel("vllm:generation_tokens_total"),),
        progress=((sel("vllm:generation_tokens_total"), sel("vllm:prompt_tokens_total")),),
        group_label="engine",
    )

    async def discover_model(self, session: aiohttp.ClientSession, base_url: str,
                             timeout_s: float) -> str | None:
        return await discover_openai_model(session, base_url, timeout_s)

    def probe_request(self, model: str | None, prompt: str, salt: str | None,
                      max_tokens: int) -> ProbeRequest:
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        if model is None:
            del body["model"]
        if salt is not None and self.cache_salt_field:
            body[self.cache_salt_field] = salt
        return ProbeRequest(self.completion_path, body)

    def read_chunk(self, doc: Any) -> ChunkToken | ChunkError | None:
        if not isinstance(doc, dict):
            return None
        if "error" in doc:
            err = doc["error"]
            return ChunkError(str(err.get("message") or err) if isinstance(err, dict) else str(err))
        choices = doc.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                token = _choice_token(choice)
                if token is not None:
                    return token
        return None

    def read_full_answer(self, doc: Any) -> str | None:
        if not isinstance(doc, dict):
            return None
        choices = doc.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                token = _choice_token(choice)
                if token is not None:
                    return token.text
        return None


class _VllmProbe(OpenAICompatAdapter):
    # The legacy micro_probe: vLLM's cache_salt, OpenAI metric names.
    kind = "vllm"
    cache_salt_field = "cache_salt"


_LEGACY = _VllmProbe()


def parse_metrics(text: str) -> EngineLoadReading:
    """Parse an OpenAI-compatible engine's ``/metrics`` text (vLLM or SGLang names).

    Supports vLLM V1 names (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_{queries,hits}_total``,
    ``vllm:generation_tokens_total``), the older ``vllm:gpu_cache_usage_perc`` and
    ``vllm:gpu_prefix_cache_*`` names (used only when the new name is absent, so a metric exposed
    under both names counts once), and SGLang's ``sglang:num_running_reqs``,
    ``sglang:num_queue_reqs``, ``sglang:token_usage``, ``sglang:cache_hit_rate``. With several
    ``engine`` (data-parallel) label values, running/waiting/token counts are summed and KV usage
    is the maximum; per-engine values are in ``groups``. NaN/Inf samples are ignored. Missing
    metrics give ``None``.

    Raises:
        ValueError: the text is not valid Prometheus exposition format.
    """
    return parse_with_spec(text, OpenAICompatAdapter.metrics_spec)


async def fetch_metrics(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float
) -> EngineLoadReading:
    """GET ``{base_url}/metrics`` and parse it with :func:`parse_metrics`.

    Raises:
        EngineRequestError: CONNECT (refused/reset/DNS), TIMEOUT, HTTP_STATUS (non-200),
            ENGINE_FATAL (non-200 whose body names a fatal error) or BAD_OUTPUT (unparseable).
    """
    url = base_url.rstrip("/") + "/metrics"
    text = await fetch_metrics_text(session, url, timeout_s)
    try:
        return parse_metrics(text)
    except ValueError as exc:
        raise EngineRequestError(
            probe_pb2.FAILURE_KIND_BAD_OUTPUT, f"GET {url}: unparseable metrics: {exc}", 200
        ) from exc


async def fetch_models(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float
) -> list[str]:
    """GET ``{base_url}/v1/models`` and return the served model ids, in the engine's order.

    Raises:
        EngineRequestError: CONNECT, TIMEOUT, HTTP_STATUS/ENGINE_FATAL (non-200) or BAD_OUTPUT
            (not an OpenAI model list).
    """
    url = base_url.rstrip("/") + "/v1/models"
    _, text = await get_text(session, url, timeout_s)
    try:
        doc = json.loads(text)
        return [str(item["id"]) for item in doc["data"] if isinstance(item, dict) and "id" in item]
    except (ValueError, KeyError, TypeError) as exc:
        raise EngineRequestError(
            probe_pb2.FAILURE_KIND_BAD_OUTPUT,
            f"GET {url}: not a model list: {truncate(text)}",
            200,
        ) from exc


async def micro_probe(
    session: aiohttp.ClientSession, base_url: str, model: str, timeout_s: float
) -> ProbeOutcome:
    """One vLLM-style 1-token probe: ``POST {base_url}/v1/completions`` with ``max_tokens: 1``,
    ``temperature: 0``, ``stream: true``, a short random prompt, a random ``cache_salt`` and the
    probe header. See :func:`node_probe.engines.base.run_probe` for timing and failure kinds."""
    return await run_probe(session, _LEGACY, base_url, model, timeout_s)
