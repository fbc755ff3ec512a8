"""Engine adapters: one module per engine family.

Each adapter knows how to read the engine's load from its ``/metrics`` text, how to run a
1-token micro-inference probe against it, and how to discover the served model. The agent
(:mod:`node_probe.agent`) only talks to engines through these functions.

Only the OpenAI-compatible family (vLLM, and SGLang's OpenAI server for the load gauges) exists
today: :mod:`node_probe.engines.openai_compat`.
"""

from node_probe.engines.openai_compat import (
    EngineLoadReading,
    EngineRequestError,
    ProbeOutcome,
    fetch_metrics,
    fetch_models,
    micro_probe,
    parse_metrics,
)

__all__ = [
    "EngineLoadReading",
    "EngineRequestError",
    "ProbeOutcome",
    "fetch_metrics",
    "fetch_models",
    "micro_probe",
    "parse_metrics",
]
