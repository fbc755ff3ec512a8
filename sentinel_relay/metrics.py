"""The relay's Prometheus metrics (one registry per process; worker i serves its own).

- ``sentinel_relay_requests_total{mode}``: mode = rescue (armed) or passthrough.
- ``sentinel_relay_rescues_total{trigger,outcome}``: trigger = health, reset, stall, error;
  outcome = resumed (continued and completed), failed (the error event was sent), refused
  (cannot be continued), hedged (a non-streaming request re-issued on an ejection).
- ``sentinel_relay_client_pause_seconds``: the gap the client saw between the last chunk before
  a fault and the first chunk after the rescue (s).
- ``sentinel_relay_in_flight{node}``: requests streaming from each node (host:port).
- ``sentinel_relay_wasted_tokens_total{kind}``: prefill = context re-sent to a rescue attempt.
- ``sentinel_relay_feed_connected``: 1 while the routing feed stream is up.
- ``sentinel_relay_prompts_sampled_total``, ``sentinel_relay_prompts_sent_total{answer}``,
  ``sentinel_relay_prompts_dropped_total{reason}``, ``sentinel_relay_prompt_submit_failures_total{code}``:
  live prompt sampling (``--sample-prompts``; :mod:`sentinel_relay.prompts` names the labels).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["RelayMetrics"]

# Pause buckets (s): from a kill seen by a reset (tens of ms) to a stall timeout (seconds).
_PAUSE_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("sentinel_relay_requests", "Requests by mode", ["mode"], registry=r)
        self.rescues = Counter("sentinel_relay_rescues", "Rescues by trigger and outcome",
                               ["trigger", "outcome"], registry=r)
        self.pause = Histogram("sentinel_relay_client_pause_seconds",
                               "Gap the client saw across a rescue (s)", buckets=_PAUSE_BUCKETS,
                               registry=r)
        self.in_flight = Gauge("sentinel_relay_in_flight", "Streams in flight per node", ["node"],
                               registry=r)
        self.wasted = Counter("sentinel_relay_wasted_tokens", "GPU tokens redone", ["kind"],
                              registry=r)
        self.feed_connected = Gauge("sentinel_relay_feed_connected",
                                    "1 while the routing feed stream is up", registry=r)
        self.prompts_sampled = Counter("sentinel_relay_prompts_sampled",
                                       "Prompts sampled for switch-back validation (--sample-prompts)", registry=r)
        self.prompts_sent = Counter("sentinel_relay_prompts_sent", "Sampled prompts sent, by the control "
                                    "plane's answer (accepted, refused)", ["answer"], registry=r)
        self.prompts_dropped = Counter("sentinel_relay_prompts_dropped", "Prompts drawn but not sent, by reason",
                                       ["reason"], registry=r)
        self.prompt_submit_failures = Counter("sentinel_relay_prompt_submit_failures",
                                              "SubmitPrompts calls that failed, by gRPC status", ["code"], registry=r)
