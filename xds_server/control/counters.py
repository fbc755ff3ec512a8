"""The control plane's counters, in one place (read by the admin view and ``/metrics``).

Every label set is bounded: node ids come from the config file, xDS types are
``Cluster``/``ClusterLoadAssignment``/``unknown``, request kinds come from the ADS verdicts,
bad agent fields are (field, reason) pairs named by :mod:`xds_server.agent_edge`.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = ["Counters"]


@dataclass
class Counters:
    """Counts since start.

    ``heartbeats`` / ``malformed``: per node id. ``bad_fields``: per (field, reason), e.g.
    ``("inference_result.ttft_ms", "not_finite")``. ``handler_errors``: exceptions while handling
    one agent message, per where ("message", "tick", "stream_closed"); each was skipped. ``xds_requests``: per (type, kind);
    ``xds_responses`` / ``xds_nacks``: per type. ``events``: per event kind (``to_<STATE>`` for
    transitions).
    """

    heartbeats: collections.Counter[str] = field(default_factory=collections.Counter)
    malformed: collections.Counter[str] = field(default_factory=collections.Counter)
    bad_fields: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    handler_errors: collections.Counter[str] = field(default_factory=collections.Counter)
    xds_requests: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    xds_responses: collections.Counter[str] = field(default_factory=collections.Counter)
    xds_nacks: collections.Counter[str] = field(default_factory=collections.Counter)
    events: collections.Counter[str] = field(default_factory=collections.Counter)
