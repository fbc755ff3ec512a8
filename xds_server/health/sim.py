"""A discrete-event driver for the pure health model (tests, benchmarks, and users' what-ifs).

:class:`NodeSim` plays what a probe session would deliver: heartbeats at a period, probe results
at a cadence, pings, and the Ticks the model asks for through :func:`next_check_s`, all in
time order on a virtual clock. No I/O, no real time.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from xds_server.config import HealthConfig
from xds_server.health.model import (
    EngineState,
    Event,
    HeartbeatObserved,
    NodeHealth,
    NodeState,
    Observation,
    PingObserved,
    ProbeObserved,
    ProbeResultKind,
    Tick,
    initial,
    next_check_s,
    step,
)

__all__ = ["NodeSim"]

ProbeFn = Callable[[float], ProbeObserved | None]
HeartbeatFn = Callable[[float], HeartbeatObserved | None]


def _good(_: float) -> ProbeObserved:
    return ProbeObserved(ProbeResultKind.OK, ttft_ms=20.0)


def _ready(_: float) -> HeartbeatObserved:
    return HeartbeatObserved(engine_state=EngineState.READY)


@dataclass
class NodeSim:
    """Virtual-time driver for one node. Times in seconds.

    ``heartbeat(t)`` returns the heartbeat sent at t or None (silent); ``probe(t)`` likewise
    for probe results; pings every ``ping_every_s`` with ``rtt_ms``.
    """

    cfg: HealthConfig = field(default_factory=HealthConfig)
    node_id: str = "n"
    heartbeat_every_s: float = 0.1
    probe_every_s: float = 1.0
    ping_every_s: float = 1.0
    rtt_ms: float = 1.0
    heartbeat: HeartbeatFn = _ready
    probe: ProbeFn = _good
    now: float = 0.0
    nh: NodeHealth = field(init=False)
    events: list[Event] = field(default_factory=list)
    states: list[tuple[float, NodeState]] = field(default_factory=list)  # (time, state entered)

    def __post_init__(self) -> None:
        self.nh = initial(self.node_id, self.now)
        self._next_hb = self.now
        self._next_probe = self.now + self.probe_every_s / 2
        self._next_ping = self.now + 0.05
        self._next_tick: float | None = None

    def apply(self, obs: Observation, at: float | None = None) -> list[Event]:
        """Apply one observation at ``at`` (default: now)."""
        t = self.now if at is None else at
        self.now = t
        self.nh, evs = step(self.nh, obs, t, self.cfg)
        self.events.extend(evs)
        for e in evs:
            self.states.append((t, e.to_state))
        self._next_tick = next_check_s(self.nh, self.cfg)
        return evs

    def run_until(self, t_end: float) -> NodeHealth:
        """Advance to ``t_end``, delivering everything due in time order."""
        while True:
            cands = [(self._next_hb, 0), (self._next_probe, 1), (self._next_ping, 2)]
            if self._next_tick is not None:
                cands.append((self._next_tick, 3))
            t, kind = min(cands)
            if t > t_end:
                self.now = t_end
                return self.nh
            if kind == 0:
                self._next_hb = t + self.heartbeat_every_s
                hb = self.heartbeat(t)
                if hb is not None:
                    self.apply(hb, t)
            elif kind == 1:
                self._next_probe = t + self.probe_every_s
                p = self.probe(t)
                if p is not None:
                    self.apply(p, t)
            elif kind == 2:
                self._next_ping = t + self.ping_every_s
                if self.heartbeat(t) is not None:
                    self.apply(PingObserved(self.rtt_ms), t)
            else:
                self._next_tick = None
                self.apply(Tick(), t)
                if self._next_tick is not None and self._next_tick <= t:
                    raise RuntimeError(f"next_check_s did not advance: {self._next_tick} <= {t} ({self.nh})")
