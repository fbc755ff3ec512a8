"""Probing: everything between an agent's stream and a health-model observation (stage 1 of
docs/DESIGN.md section 1: observations -> health -> decisions -> resources).

An agent message enters :mod:`~xds_server.probing.session` (one gRPC stream per agent, timed on
our monotonic clock), is checked field by field at :mod:`~xds_server.probing.edge` (with
:mod:`~xds_server.probing.telemetry` for its load and GPU parts) and leaves as an
:class:`~xds_server.health.model.Observation` handed to the sink of the
:mod:`~xds_server.probing.sources` seam. Around it: :mod:`~xds_server.probing.timers` (the
detection timers), :mod:`~xds_server.probing.stall_hold` and :mod:`~xds_server.probing.silence`
(our own event-loop stalls and the hold they put on silence verdicts),
:mod:`~xds_server.probing.workers` (the same sessions in worker processes) and
:mod:`~xds_server.probing.memory` (sources driven by test code). Nothing here imports the
decision layer (:mod:`xds_server.control`); the wiring shell (:mod:`xds_server.server`) connects
the two.
"""
from xds_server.probing.edge import AgentEdge, TelemetrySummary
from xds_server.probing.memory import InMemoryProbes, InMemoryProbeSource
from xds_server.probing.session import ProbeSession, grpc_probe_source
from xds_server.probing.sources import ObservationSink, ProbeSource, ProbeSourceContext, ProbeSourceFactory
from xds_server.probing.workers import WorkerPool

__all__ = [
    "AgentEdge",
    "InMemoryProbeSource",
    "InMemoryProbes",
    "ObservationSink",
    "ProbeSession",
    "ProbeSource",
    "ProbeSourceContext",
    "ProbeSourceFactory",
    "TelemetrySummary",
    "WorkerPool",
    "grpc_probe_source",
]
