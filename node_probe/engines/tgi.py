"""Hugging Face Text Generation Inference adapter (``text-generation-launcher``).

* Probe: ``POST /generate_stream`` with ``{"inputs": PROMPT, "parameters": {"max_new_tokens": 1,
  "do_sample": false, "details": false}}`` (``do_sample: false`` is greedy; TGI rejects a
  temperature of 0). Chunks are ``data:{"index":1,"token":{"id":..,"text":"..","special":..},
  "generated_text":..}``; an error arrives as ``data:{"error":"...","error_type":"..."}``. A
  token chunk counts even when its text is empty (a special token is still a decode step).
  TGI caches prefixes (v3): a random prompt prefix defeats it. No model id is needed.
* Metrics (``/metrics``, names from ``docs/source/reference/metrics.md``): ``tgi_queue_size``
  (waiting), ``tgi_batch_current_size`` (running), generated tokens from
  ``tgi_request_generated_tokens_sum`` (observed when a request ends). There is no KV-usage
  metric. Progress for stall detection: ``tgi_batch_inference_success`` (one per successful
  prefill or decode forward of the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from node_probe.engines.base import ChunkError, ChunkToken, EngineAdapter, ProbeRequest
from node_probe.engines.prometheus import MetricSpec, sel

__all__ = ["TGI", "TgiAdapter"]


@dataclass(frozen=True, kw_only=True)
class TgiAdapter(EngineAdapter):
    """Hugging Face TGI (native ``/generate_stream`` API)."""

    kind: str = "tgi"
    needs_model: bool = False
    metrics_spec: MetricSpec = MetricSpec(  # noqa: RUF009 - frozen, tuples only: safe to share
        running=(sel("tgi_batch_current_size"),),
        waiting=(sel("tgi_queue_size"),),
        generation_tokens=(sel("tgi_request_generated_tokens_sum"),),
        finished=(sel("tgi_request_duration_count"),),  # a histogram: its count is requests finished
        progress=((sel("tgi_batch_inference_success"),),),
        group_label=None,
    )

    def probe_request(self, model: str | None, prompt: str, salt: str | None,
                      max_tokens: int) -> ProbeRequest:
        return ProbeRequest("/generate_stream", {
            "inputs": prompt,
            "parameters": {"max_new_tokens": max_tokens, "do_sample": False, "details": False},
        })

    def read_chunk(self, doc: Any) -> ChunkToken | ChunkError | None:
        if not isinstance(doc, dict):
            return None
        if doc.get("error"):
            return ChunkError(str(doc["error"]))
        token = doc.get("token")
        if isinstance(token, dict) and "id" in token:
            text = token.get("text")
            return ChunkToken(text if isinstance(text, str) else "",
                              doc.get("generated_text") is not None)
        return None

    def read_full_answer(self, doc: Any) -> str | None:
        if isinstance(doc, list) and doc:
            doc = doc[0]
        if isinstance(doc, dict) and isinstance(doc.get("generated_text"), str):
            return doc["generated_text"]
        return None


TGI = TgiAdapter()
