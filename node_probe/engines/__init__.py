"""Engine adapters: one module per engine family, chosen by ``--engine-kind`` or detected.

Each adapter (:class:`~node_probe.engines.base.EngineAdapter`) knows its completion endpoint and
body for a 1-token probe, how its stream carries a token or an error, its readiness endpoint, its
load metrics (:class:`~node_probe.engines.base.MetricSpec`) and how it defeats prefix caching.

==========  ==============================================================================
kind        adapter
==========  ==============================================================================
vllm        :class:`~node_probe.engines.vllm.VllmAdapter` (``cache_salt``, both KV names)
sglang      :class:`~node_probe.engines.sglang.SglangAdapter`
tgi         :class:`~node_probe.engines.tgi.TgiAdapter` (``/generate_stream``)
triton      :class:`~node_probe.engines.triton.TritonAdapter` (TensorRT-LLM, generate ext.)
openai      :class:`~node_probe.engines.openai_compat.OpenAICompatAdapter` (any other
            OpenAI-compatible server; what ``auto`` falls back to)
==========  ==============================================================================
"""

from node_probe.engines.base import (
    EngineAdapter,
    EngineLoadReading,
    EngineRequestError,
    GroupLoad,
    ProbeOutcome,
    run_probe,
)
from node_probe.engines.detect import detect_engine_kind, kind_from_metrics
from node_probe.engines.openai_compat import (
    OpenAICompatAdapter,
    fetch_metrics,
    fetch_models,
    micro_probe,
    parse_metrics,
)
from node_probe.engines.sglang import SglangAdapter
from node_probe.engines.tgi import TgiAdapter
from node_probe.engines.triton import TritonAdapter
from node_probe.engines.vllm import VllmAdapter

#: Adapter per ``--engine-kind`` value.
ADAPTERS: dict[str, EngineAdapter] = {
    "vllm": VllmAdapter(),
    "sglang": SglangAdapter(),
    "tgi": TgiAdapter(),
    "triton": TritonAdapter(),
    "openai": OpenAICompatAdapter(),
}

#: Accepted ``--engine-kind`` values.
ENGINE_KINDS = ("auto", *ADAPTERS)


def get_adapter(kind: str) -> EngineAdapter:
    """The adapter for ``kind`` (raises ``KeyError`` for an unknown kind)."""
    return ADAPTERS[kind]


__all__ = [
    "ADAPTERS",
    "ENGINE_KINDS",
    "EngineAdapter",
    "EngineLoadReading",
    "EngineRequestError",
    "GroupLoad",
    "OpenAICompatAdapter",
    "ProbeOutcome",
    "SglangAdapter",
    "TgiAdapter",
    "TritonAdapter",
    "VllmAdapter",
    "detect_engine_kind",
    "fetch_metrics",
    "fetch_models",
    "get_adapter",
    "kind_from_metrics",
    "micro_probe",
    "parse_metrics",
    "run_probe",
]
