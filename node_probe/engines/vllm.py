"""vLLM adapter (OpenAI-compatible server, ``vllm serve``).

* Probe: ``POST /v1/completions`` with ``max_tokens: 1``, ``temperature: 0``, ``stream: true`` and
  a fresh non-empty ``cache_salt`` (vLLM >= 0.9 mixes it into the first KV block hash, so the
  prefix cache cannot answer; an empty or non-string salt is a 400, see fixture 06c/06d).
* During startup the port refuses connections: there is no "loading" phase to read; ``GET /health``
  answers 200, and 503 once the engine is dead.
* Metrics (both generations): ``vllm:num_requests_running``/``_waiting``, KV usage from
  ``vllm:kv_cache_usage_perc`` or, on older servers, ``vllm:gpu_cache_usage_perc`` (never both
  added), prefix-cache counters ``vllm:prefix_cache_{queries,hits}_total`` or the older
  ``vllm:gpu_prefix_cache_*`` / ``vllm:gpu_prefix_cache_hit_rate``. Per-engine ``engine`` label
  values (data parallelism) are kept apart in ``groups`` so one stuck engine cannot hide behind
  a busy one. Progress for stall detection: ``vllm:generation_tokens_total`` +
  ``vllm:prompt_tokens_total`` per engine.
"""

from __future__ import annotations

from node_probe.engines.openai_compat import OPENAI_METRICS, OpenAICompatAdapter

__all__ = ["VLLM"]

#: vLLM (V1 and the older V0 metric names), salted with ``cache_salt``.
VLLM = OpenAICompatAdapter(kind="vllm", cache_salt_field="cache_salt", metrics_spec=OPENAI_METRICS)
