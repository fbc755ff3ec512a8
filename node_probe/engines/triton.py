"""NVIDIA Triton Inference Server adapter, for TensorRT-LLM models (``tensorrtllm_backend``).

* Probe: the generate extension, ``POST /v2/models/{model}/generate_stream`` with
  ``{"text_input": PROMPT, "max_tokens": 1, "top_k": 1, "stream": true, "bad_words": "",
  "stop_words": ""}`` (``top_k: 1`` is greedy). Chunks are ``data: {"model_name":..,
  "text_output":"..",...}``; errors ``data: {"error":"..."}``. KV-cache block reuse is defeated
  with a random prompt prefix. The model is configured or discovered with
  ``POST /v2/repository/index`` (``ensemble``, then ``tensorrt_llm_bls``, then the first READY).
* Readiness: ``GET /v2/health/ready`` (KServe v2; per model ``/v2/models/{m}/ready``).
* Metrics: Triton serves them on its own port (8002 by default), so the metrics URL is the
  engine URL with port 8002 unless ``--metrics-url`` says otherwise. TensorRT-LLM batch-manager
  gauges: ``nv_trt_llm_request_metrics{request_type="scheduled"|"active"|"waiting"}``, KV from
  ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}`` or used/max blocks, and
  ``nv_inference_pending_request_count`` for the queue when the batcher reports no "waiting".
  Progress for stall detection: ``nv_trt_llm_general_metrics{general_type="iteration_counter"}``
  per ``model``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from node_probe.engines.base import ChunkError, ChunkToken, EngineAdapter, ProbeRequest
from node_probe.engines.http_helpers import EngineRequestError, get_text, truncate
from node_probe.engines.prometheus import MetricSpec, sel
from node_probe.proto import probe_pb2

__all__ = ["TRITON", "TRITON_METRICS_PORT", "TritonAdapter"]

#: Triton's default metrics port.
TRITON_METRICS_PORT = 8002
_PREFERRED_MODELS = ("ensemble", "tensorrt_llm_bls")


@dataclass(frozen=True, kw_only=True)
class TritonAdapter(EngineAdapter):
    """Triton with a TensorRT-LLM model (generate extension)."""

    kind: str = "triton"
    metrics_spec: MetricSpec = MetricSpec(  # noqa: RUF009 - frozen, tuples only: safe to share
        running=(sel("nv_trt_llm_request_metrics", request_type="scheduled"),
                 sel("nv_trt_llm_request_metrics", request_type="active")),
        waiting=(sel("nv_trt_llm_request_metrics", request_type="waiting"),
                 sel("nv_inference_pending_request_count")),
        kv_usage=(sel("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="fraction"),),
        kv_used_total=((sel("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used"),
                        sel("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max")),),
        progress=((sel("nv_trt_llm_general_metrics", general_type="iteration_counter"),),),
        group_label="model",
    )

    def metrics_url(self, base_url: str, override: str | None = None) -> str:
        if override:
            return override
        parts = urlsplit(base_url)
        host = parts.hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return urlunsplit((parts.scheme, f"{host}:{TRITON_METRICS_PORT}", self.metrics_path, "", ""))

    async def discover_model(self, session: aiohttp.ClientSession, base_url: str,
                             timeout_s: float) -> str | None:
        url = base_url.rstrip("/") + "/v2/repository/index"
        _, text = await get_text(session, url, timeout_s, method="POST")
        try:
            entries = json.loads(text)
            names = [str(e["name"]) for e in entries
                     if isinstance(e, dict) and "name" in e and e.get("state", "READY") == "READY"]
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineRequestError(probe_pb2.FAILURE_KIND_BAD_OUTPUT,
                                     f"POST {url}: not a repository index: {truncate(text)}",
                                     200) from exc
        for preferred in _PREFERRED_MODELS:
            if preferred in names:
                return preferred
        if not names:
            raise EngineRequestError(probe_pb2.FAILURE_KIND_BAD_OUTPUT,
                                     "model discovery: no READY model in the repository", 200)
        return names[0]

    def probe_request(self, model: str | None, prompt: str, salt: str | None,
                      max_tokens: int) -> ProbeRequest:
        return ProbeRequest(f"/v2/models/{model}/generate_stream", {
            "text_input": prompt,
            "max_tokens": max_tokens,
            "top_k": 1,
            "stream": True,
            "bad_words": "",
            "stop_words": "",
        })

    def read_chunk(self, doc: Any) -> ChunkToken | ChunkError | None:
        if not isinstance(doc, dict):
            return None
        if doc.get("error"):
            return ChunkError(str(doc["error"]))
        text = doc.get("text_output")
        if isinstance(text, str) and text:
            return ChunkToken(text, bool(doc.get("sequence_end")))
        return None

    def read_full_answer(self, doc: Any) -> str | None:
        if isinstance(doc, dict) and isinstance(doc.get("text_output"), str):
            return doc["text_output"]
        return None


TRITON = TritonAdapter()
