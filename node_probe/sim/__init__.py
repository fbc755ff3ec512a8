"""Simulated OpenAI-compatible LLM engine (vLLM-shaped) with a deterministic model and faults.

Used by ``xds-server demo``, by integration tests that put a real Envoy in front of several
simulated engines, and by the relay's tests, which compare a rescued stream with an
uninterrupted one token for token. Run one with ``node-probe sim-engine --port 8000``.

- :mod:`node_probe.sim.model`: tokenizer, chat template and greedy decoder. The next token is a
  function of the whole context, so continuing from ``prompt ids + first k generated ids`` (or
  the assistant text so far with ``continue_final_message``) gives exactly the rest.
- :mod:`node_probe.sim.protocol`: request fields and their validation (vLLM's errors).
- :mod:`node_probe.sim.app`: the HTTP wire format (vLLM 0.32 captures in
  ``tests/fixtures/vllm-0.32.0-cpu``), including ``return_token_ids``.
- :mod:`node_probe.sim.faults`: fault modes set with ``POST /sim/fault``: ``hang``, ``slow``,
  ``error``, ``queue``, and the mid-stream ``freeze_after``, ``reset_after``, ``fail_after``,
  ``error_after``, ``hang_after_headers``.
- :mod:`node_probe.sim.engine`: per-engine state and vLLM-named Prometheus metrics.
- :mod:`node_probe.sim.capacity`: the batch (``--max-num-seqs``, default unlimited): at most N
  requests decode at once, the rest (probes too) wait in arrival order and count as waiting.

Every response carries ``x-served-by: <replica_id>``; a request carrying a non-empty
``x-sentinel-probe`` header (:data:`PROBE_HEADER`) is counted as a probe in ``GET /sim/stats``
and is never hit by the per-request faults.
"""

from node_probe.sim.app import (
    CUDA_ERROR_MESSAGE,
    ENGINE_DEAD_MESSAGE,
    GENERATION_ERROR_MESSAGE,
    PROBE_HEADER,
    SERVED_BY_HEADER,
    SIM_ENGINE_KEY,
    build_app,
)
from node_probe.sim.cli import main
from node_probe.sim.engine import SimConfig, SimEngine
from node_probe.sim.faults import DEFAULT_QUEUE_WAITING, DEFAULT_SLOW_TTFT_MS, FAULT_MODES

__all__ = [
    "CUDA_ERROR_MESSAGE", "DEFAULT_QUEUE_WAITING", "DEFAULT_SLOW_TTFT_MS", "ENGINE_DEAD_MESSAGE",
    "FAULT_MODES", "GENERATION_ERROR_MESSAGE", "PROBE_HEADER", "SERVED_BY_HEADER",
    "SIM_ENGINE_KEY", "SimConfig", "SimEngine", "build_app", "main",
]
