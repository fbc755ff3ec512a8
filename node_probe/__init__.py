"""node_probe: agent that runs beside an LLM inference engine."""
