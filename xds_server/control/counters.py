"""The control plane's health-side counters, in one place (read by the admin view and
``/metrics``); the xDS server keeps its own counters with it (:mod:`xds_server.xds.stats`).

Every label set is bounded: node ids come from the config file, bad agent fields are
(field, reason) pairs named by :mod:`xds_server.agent_edge`, handler errors are keyed by where.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = ["Counters"]


@dataclass
class Counters:
    """Counts since start.

    ``heartbeats`` / ``malformed``: per node id. ``bad_fields``: per (field, reason), e.g.
    ``("inference_result.ttft_ms", "not_finite")``. ``handler_errors``: exceptions while
    handling one agent message or timer, per where ("message", "tick", "stream_closed"); each
    was skipped. ``events``: per event kind (``to_<STATE>`` for transitions).
    ``config_reloads``: per result ("ok", "invalid").
    ``probe_failures``: probe results that were not good, per (node id, result kind, outcome):
    kind a :class:`~xds_server.health.model.ProbeResultKind` value ("TIMEOUT" also for a token
    later than the deadline), outcome "fail", "busy" or "fatal" (cumulative, besides the
    model's consecutive count).
    """

    heartbeats: collections.Counter[str] = field(default_factory=collections.Counter)
    malformed: collections.Counter[str] = field(default_factory=collections.Counter)
    bad_fields: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    handler_errors: collections.Counter[str] = field(default_factory=collections.Counter)
    events: collections.Counter[str] = field(default_factory=collections.Counter)
    config_reloads: collections.Counter[str] = field(default_factory=collections.Counter)
    probe_failures: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
