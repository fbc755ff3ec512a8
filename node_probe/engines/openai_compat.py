"""OpenAI-compatible inference servers: :class:`OpenAICompatAdapter` (the wire format vLLM and
SGLang share, see ``vllm.VLLM`` and ``sglang.SGLANG``) and :data:`OPENAI`, the generic value.

:class:`OpenAICompatAdapter` probes ``POST /v1/completions`` (``max_tokens: 1``,
``temperature: 0``, ``stream: true``) and reads OpenAI SSE chunks (completions ``text`` or chat
``delta.content``; a role-only or empty chunk is not a token, a chunk that ends the choice with
``finish_reason`` "stop"/"length" is one: the engine ran a decode step even if it produced an
end-of-sequence token with no text). Without a known cache-salt field it defeats prefix caching
with a random prompt prefix. The model is discovered with :func:`fetch_models` (``GET /v1/models``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from node_probe.engines.base import ChunkError, ChunkToken, EngineAdapter, ProbeRequest
from node_probe.engines.http_helpers import EngineRequestError, get_text, truncate
from node_probe.engines.prometheus import MetricSpec, sel
from node_probe.proto import probe_pb2

__all__ = ["OPENAI", "OPENAI_METRICS", "OpenAICompatAdapter", "fetch_models"]

#: vLLM (V1 and the older V0 names) and SGLang load metrics, whichever the server exposes (the
#: first name found wins, so a metric exposed under both names counts once); data-parallel
#: ``engine`` label values are kept apart. Progress: vLLM generated + prompt tokens.
OPENAI_METRICS = MetricSpec(
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
    finished=(sel("vllm:request_success_total"),),
    progress=((sel("vllm:generation_tokens_total"), sel("vllm:prompt_tokens_total")),),
    group_label="engine",
)

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


@dataclass(frozen=True, kw_only=True)
class OpenAICompatAdapter(EngineAdapter):
    """An OpenAI-compatible server (``/v1/completions``, ``/v1/models``).

    Attributes (beyond :class:`EngineAdapter`'s):
        completion_path: the probe's endpoint.
    """

    kind: str = "openai"
    metrics_spec: MetricSpec = OPENAI_METRICS
    completion_path: str = "/v1/completions"

    async def discover_model(self, session: aiohttp.ClientSession, base_url: str,
                             timeout_s: float) -> str | None:
        """The first model id of ``GET /v1/models`` (raises :class:`EngineRequestError`)."""
        models = await fetch_models(session, base_url, timeout_s)
        if not models:
            raise EngineRequestError(
                probe_pb2.FAILURE_KIND_BAD_OUTPUT, "model discovery: no models listed", 200
            )
        return models[0]

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


#: Any other OpenAI-compatible server (what ``auto`` falls back to). Metrics: vLLM and SGLang
#: names. Cache defeat: random prompt prefix (an unknown server may reject a ``cache_salt`` field).
OPENAI = OpenAICompatAdapter()
