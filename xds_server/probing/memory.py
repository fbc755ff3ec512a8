"""In-memory probe sources: drive a control plane's nodes from test code, no agent, no sockets.

Shape::

    probes = InMemoryProbes()
    clock = ManualClock()
    cp = ControlPlane(config, clock=clock, probe_sources=probes)
    cp.open()                                  # no ports; ``await cp.start()`` serves as usual
    probes["gpu-a"].heartbeat()                # HeartbeatObserved at clock.now()
    probes["gpu-a"].probe(ttft_ms=20.0)        # a good micro-probe
    clock.advance(0.5)                         # missed heartbeats are counted by Tick timers

Each source arms one Tick timer on the injected clock at the time the sink asks for, as the
gRPC source does, so silence is detected exactly as in production.
"""
from __future__ import annotations

from xds_server.config import NodeConfig
from xds_server.health import model as hm
from xds_server.probing.sources import ProbeSourceContext
from xds_server.process.clock import Timer

__all__ = ["InMemoryProbeSource", "InMemoryProbes"]


class InMemoryProbeSource:
    """One node fed by hand. ``connected`` follows :meth:`heartbeat` / :meth:`close`."""

    def __init__(self, node: NodeConfig, ctx: ProbeSourceContext) -> None:
        self.node = node
        self.ctx = ctx
        self.connected = False
        self.lag_deferrals = 0
        self.last_telemetry = None
        self.started = False
        self._timer: Timer | None = None
        self._last_hb: tuple[str, hm.HeartbeatObserved] | None = None

    def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.started = False
        self._cancel()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def emit(self, obs: hm.Observation) -> float | None:
        """Feed ``obs`` at ``clock.now()``; (re)arm the Tick timer; returns the next check time."""
        at = self.ctx.sink(self.node.id, obs, self.ctx.clock.now())
        self._cancel()
        if at is not None and self.started:
            self._timer = self.ctx.clock.call_at(at, self._tick)
        return at

    def _tick(self) -> None:
        self._timer = None
        self.emit(hm.Tick())

    def heartbeat(self, **fields) -> float | None:
        """A heartbeat (``fields``: those of :class:`~xds_server.health.model.HeartbeatObserved`).
        The same fields as the last heartbeat give the same observation object, as the agent
        edge gives it for unchanged telemetry (so the control plane's steady lane folds it)."""
        self.connected = True
        last = self._last_hb
        key = repr(sorted(fields.items()))  # exact: -0.0 is not 0.0 here
        if last is None or last[0] != key:
            last = self._last_hb = (key, hm.HeartbeatObserved(**fields))
        return self.emit(last[1])

    def probe(self, ttft_ms: float = 20.0, kind: hm.ProbeResultKind = hm.ProbeResultKind.OK,
              http_status: int = 0, detail: str = "") -> float | None:
        """A micro-probe result (default: good, 20 ms TTFT)."""
        return self.emit(hm.ProbeObserved(kind=kind, ttft_ms=ttft_ms, http_status=http_status, detail=detail))

    def ping(self, rtt_ms: float) -> float | None:
        """A Pong with this RTT, ms."""
        return self.emit(hm.PingObserved(rtt_ms=rtt_ms))

    def close(self, detail: str = "stream ended by agent") -> float | None:
        """The stream to the agent ended."""
        self.connected = False
        return self.emit(hm.StreamClosed(detail))


class InMemoryProbes:
    """A probe-source factory that keeps what it made: ``probes[node_id]``."""

    def __init__(self) -> None:
        self.sources: dict[str, InMemoryProbeSource] = {}

    def __call__(self, node: NodeConfig, ctx: ProbeSourceContext) -> InMemoryProbeSource:
        s = InMemoryProbeSource(node, ctx)
        self.sources[node.id] = s
        return s

    def __getitem__(self, node_id: str) -> InMemoryProbeSource:
        return self.sources[node_id]
