"""Engine adapters: one value per engine family, chosen by ``--engine-kind`` or detected.

Each adapter (an :class:`~node_probe.engines.base.EngineAdapter` value) knows its completion
endpoint and body for a 1-token probe, how its stream carries a token or an error, its load
metrics (:class:`~node_probe.engines.prometheus.MetricSpec`) and how it defeats prefix caching.

==========  ==============================================================================
kind        adapter
==========  ==============================================================================
vllm        :data:`~node_probe.engines.vllm.VLLM` (OpenAI format, ``cache_salt``, both KV names)
sglang      :data:`~node_probe.engines.sglang.SGLANG` (OpenAI format, random prefix)
tgi         :data:`~node_probe.engines.tgi.TGI` (:class:`TgiAdapter`, ``/generate_stream``)
triton      :data:`~node_probe.engines.triton.TRITON` (:class:`TritonAdapter`, TensorRT-LLM,
            generate extension)
openai      :data:`~node_probe.engines.openai_compat.OPENAI` (any other OpenAI-compatible
            server; what ``auto`` falls back to)
==========  ==============================================================================

Modules by job: ``base`` (the adapter contract), ``prometheus`` (``/metrics`` text to an
:class:`EngineLoadReading`), ``http_helpers`` (bounded GETs, :class:`EngineRequestError`),
``sse_probe`` (:func:`run_probe`, the streaming micro-probe), ``detect`` (``auto``), one module
per engine family.
"""

from node_probe.engines.base import EngineAdapter
from node_probe.engines.detect import detect_engine_kind, kind_from_metrics
from node_probe.engines.http_helpers import EngineRequestError
from node_probe.engines.openai_compat import OPENAI, OpenAICompatAdapter
from node_probe.engines.prometheus import EngineLoadReading, GroupLoad
from node_probe.engines.sglang import SGLANG
from node_probe.engines.sse_probe import PROBE_HEADER, PROBE_HEADER_VALUE, ProbeOutcome, run_probe
from node_probe.engines.tgi import TGI, TgiAdapter
from node_probe.engines.triton import TRITON, TritonAdapter
from node_probe.engines.vllm import VLLM

#: Adapter per ``--engine-kind`` value.
ADAPTERS: dict[str, EngineAdapter] = {a.kind: a for a in (VLLM, SGLANG, TGI, TRITON, OPENAI)}

#: Accepted ``--engine-kind`` values.
ENGINE_KINDS = ("auto", *ADAPTERS)


def get_adapter(kind: str) -> EngineAdapter:
    """The adapter for ``kind`` (raises ``KeyError`` for an unknown kind)."""
    return ADAPTERS[kind]


__all__ = [
    "ADAPTERS",
    "ENGINE_KINDS",
    "OPENAI",
    "PROBE_HEADER",
    "PROBE_HEADER_VALUE",
    "SGLANG",
    "TGI",
    "TRITON",
    "VLLM",
    "EngineAdapter",
    "EngineLoadReading",
    "EngineRequestError",
    "GroupLoad",
    "OpenAICompatAdapter",
    "ProbeOutcome",
    "TgiAdapter",
    "TritonAdapter",
    "detect_engine_kind",
    "get_adapter",
    "kind_from_metrics",
    "run_probe",
]
