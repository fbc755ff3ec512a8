"""The control plane's health-side counters, in one place (read by the admin view and
``/metrics``); the xDS server keeps its own counters with it (:mod:`xds_server.xds.stats`).

Every label set is bounded: node ids come from the config file, bad agent fields are
(field, reason) pairs named by :mod:`xds_server.probing.edge`, handler errors are keyed by where.
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
    ``probe_results``: every micro-probe result received, per (node id, kind, outcome): kind a
    :class:`~xds_server.health.records.ProbeResultKind` value ("TIMEOUT" also for a token later
    than ``probes.ttft_timeout``), outcome the model's
    :class:`~xds_server.health.records.ProbeOutcome` ("good", "slow", "fail", "busy", "fatal");
    the failures are the results whose outcome is not good or slow.
    ``ejections``: per (node id, cause): each move to UNHEALTHY by its
    :class:`~xds_server.health.records.EjectionCause` value, and "outlier" for each
    cluster-policy outlier ejection.
    ``transport_drops``: dial-in streams whose transport ended under us, per verdict: "node" (its
    node's whole miss threshold), "redialled" (the agent dialled again within
    ``probe.dial_in.drop_confirm``: no verdict), "stall" (read within a hold after a stall of ours
    at least as long as the PING timeout: ours), "burst" (one of many at once: ours, one miss),
    "returned" (its agent dialled back later, while agents kept dialling in after a burst judged
    ours: the nodes not heard since held again; first dials hold too, and are not counted here).
    ``silent_streams``: dial-in streams open without a heartbeat for their silence bound, per
    verdict: "node" (ended: the agent's own loop is judged), "burst" (many at once: ours, kept open).
    ``rtt_not_taken``: RTT pings that gave no sample, per why: "late" (not sent: our loop ran
    ``health.rtt.self_lag_max`` late within one loop-watch period, so the round trip would time our
    queue), "ours" (the round trip spanned a stall or queue of ours), "gap" (outstanding across a
    heartbeat gap).
    """

    heartbeats: collections.Counter[str] = field(default_factory=collections.Counter)
    malformed: collections.Counter[str] = field(default_factory=collections.Counter)
    bad_fields: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    handler_errors: collections.Counter[str] = field(default_factory=collections.Counter)
    events: collections.Counter[str] = field(default_factory=collections.Counter)
    config_reloads: collections.Counter[str] = field(default_factory=collections.Counter)
    probe_results: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    ejections: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    transport_drops: collections.Counter[str] = field(default_factory=collections.Counter)
    silent_streams: collections.Counter[str] = field(default_factory=collections.Counter)
    rtt_not_taken: collections.Counter[str] = field(default_factory=collections.Counter)

    def probe_failures(self, node_id: str) -> dict[tuple[str, str], int]:
        """The node's probe results that were failures, per (kind, outcome): any kind but OK
        (a late token is already TIMEOUT) whose outcome is not good or slow (cumulative,
        besides the model's consecutive count)."""
        return {(kind, outcome): v for (nid, kind, outcome), v in sorted(self.probe_results.items())
                if nid == node_id and kind != "OK" and outcome not in ("good", "slow")}
