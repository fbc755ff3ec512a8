"""SGLang adapter (``python -m sglang.launch_server``, OpenAI-compatible endpoints).

* Probe: ``POST /v1/completions`` (OpenAI SSE), greedy, 1 token. Prefix caching (RadixAttention,
  token granularity) is defeated with a random prompt prefix: ``cache_salt`` exists only in
  recent SGLang releases, and older ones reject unknown fields.
* Readiness: ``GET /health`` (newer versions run a tiny generation there and answer 503 while
  starting or shutting down).
* Metrics (need ``--enable-metrics``): ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
  ``sglang:token_usage`` (KV), ``sglang:cache_hit_rate``; series per tensor-parallel rank are
  counted once (max), data-parallel ranks (``dp_rank``) are summed. ``sglang:generation_tokens_total``
  advances only when a request *finishes*, so it cannot prove per-step progress: stall detection
  is off for SGLang and the agent keeps probing at the idle cadence even when the engine is busy.
"""

from __future__ import annotations

from node_probe.engines.openai_compat import OpenAICompatAdapter
from node_probe.engines.prometheus import MetricSpec, sel

__all__ = ["SGLANG"]

#: SGLang's OpenAI-compatible server: no salt field (a random prefix instead), no progress counter.
SGLANG = OpenAICompatAdapter(
    kind="sglang",
    cache_salt_field=None,
    metrics_spec=MetricSpec(
        running=(sel("sglang:num_running_reqs"),),
        waiting=(sel("sglang:num_queue_reqs"),),
        kv_usage=(sel("sglang:token_usage"),),
        prefix_gauges=(sel("sglang:cache_hit_rate"),),
        generation_tokens=(sel("sglang:generation_tokens_total"),),
        progress=(),
        group_label="dp_rank",
    ),
)
