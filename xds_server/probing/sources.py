"""Where observations come from: the probe-source seam of the control plane.

A probe source watches one node and feeds :class:`~xds_server.health.model.Observation` values
into ``ctx.sink(node_id, observation, now_s)``, arming its own timer for the next
:class:`~xds_server.health.model.Tick` at the time the sink returns. The real factory,
:func:`~xds_server.probing.session.grpc_probe_source`, dials the node's agent;
:class:`~xds_server.probing.workers.WorkerPool` runs those sessions in worker processes;
:class:`~xds_server.probing.memory.InMemoryProbes` drives nodes from test code. The wiring shell
(:mod:`xds_server.server`) picks one; the decision layer sees only the sink it hands out.

Shape::

    factory(node: NodeConfig, ctx: ProbeSourceContext) -> ProbeSource
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from xds_server.config import AgentTlsConfig, HealthConfig, NodeConfig, ProbeConfig
from xds_server.health.model import Observation
from xds_server.process.clock import Clock
from xds_server.process.counters import Counters

__all__ = ["ObservationSink", "ProbeSource", "ProbeSourceContext", "ProbeSourceFactory"]

ObservationSink = Callable[[str, Observation, float], "float | None"]
"""``sink(node_id, observation, now_s) -> tick_due_s``: when the next Tick is due (monotonic s), or None."""


class ProbeSource(Protocol):
    """One node's observation feed, as the control plane and its admin view use it.

    ``connected``: the stream to the agent is up. ``last_telemetry``: the latest validated
    telemetry (:class:`~xds_server.probing.edge.TelemetrySummary`) or None.
    ``lag_deferrals``: detection timers deferred because the event loop was late.
    """

    connected: bool

    @property
    def lag_deferrals(self) -> int: ...

    @property
    def last_telemetry(self) -> Any: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass(frozen=True)
class ProbeSourceContext:
    """What a probe source gets from the control plane: thresholds, the sink, the clock, the
    counters (malformed messages and bad fields are counted there), the server id and how agents
    are dialled (``tls``, the config's ``tls.agents``)."""

    health: HealthConfig
    probe: ProbeConfig
    sink: ObservationSink
    clock: Clock
    counters: Counters = field(default_factory=Counters)
    control_plane_id: str = "xds-sentinel"
    tls: AgentTlsConfig = field(default_factory=AgentTlsConfig)


ProbeSourceFactory = Callable[[NodeConfig, ProbeSourceContext], ProbeSource]

