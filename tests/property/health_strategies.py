"""Observation strategies shared by the health model's property tests (fast path, Tick back-off)."""
from __future__ import annotations

from hypothesis import strategies as st

from xds_server.health.model import (
    DrainRequested,
    FailStaticEnded,
    PingObserved,
    ProbeObserved,
    StreamClosed,
    Tick,
)
from xds_server.health.model import (
    ProbeResultKind as K,
)

FAST_RECOVERY = {"probation_clean_s": 0.5, "probation_clean_max_s": 2.0, "ramp_step_percent": 25.0, "ramp_step_s": 0.2,
                     "probation_min_probes": 1, "good_probes_to_recover": 2}
"""HealthConfig fields: short clean period, ramp and HEALTHY run, so random sequences reach every state."""

probe = st.builds(ProbeObserved, st.sampled_from([K.OK] * 6 + list(K)), st.sampled_from([10.0, 10.0, 900.0, 6000.0]),
                  st.sampled_from([0, 200, 429, 503]))


def observations(heartbeat: st.SearchStrategy, *, with_tick: bool) -> st.SearchStrategy:
    """Mostly ``heartbeat``, then probes, a closed stream, pings, drains, fail-static ends and,
    ``with_tick``, Ticks (a test that delivers Ticks itself leaves them out)."""
    return st.one_of(
        *[heartbeat] * 6, probe, probe, *([st.just(Tick())] if with_tick else []),
        st.builds(StreamClosed, st.just("x"), st.booleans()),
        st.builds(PingObserved, st.sampled_from([1.0, 2.0, 300.0])),
        st.builds(DrainRequested, st.booleans()), st.builds(FailStaticEnded, st.floats(0, 5)),
    )
