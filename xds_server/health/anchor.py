"""Anchor PROBATION ramp steps on the Unix clock, so replicas step together. Pure.

Two replicas watching the same agents see a node enter PROBATION within a few ms of each other
(the same probe result reaches both), but each would step its ramp ``probation.ramp_step`` after its own
entry time, so for a few ms of every step they would publish different weights (and versions),
and a ramp started at t and one started at t + 5 ms would never line up. Snapping the ramp's
step time (``Ramp.step_at_s``) to the nearest multiple of ``probation.ramp_step`` of *Unix* time makes
both replicas step at the same instants (within their clock skew; NTP keeps it to ms) and hold
the same percentage in between.

Shape::

    nh = anchor_ramp(nh, step_s=cfg.probation.ramp_step.s, wall_offset_s=clock.wall() - clock.now())

Times: ``step_at_s`` is monotonic seconds (the health model's clock); ``wall_offset_s`` is Unix
seconds minus monotonic seconds. The residual difference: when the two entries straddle a point
halfway between grid points (probability ~ arrival skew / ``probation.ramp_step``, e.g. 5 ms / 1 s =
0.5 %), the replicas are one step apart for that ramp.
"""
from __future__ import annotations

from dataclasses import replace

from xds_server.health.records import NodeHealth, NodeState

__all__ = ["anchor_ramp", "grid_point"]

_EPS_S = 1e-6


def grid_point(t_s: float, step_s: float, wall_offset_s: float) -> float:
    """The monotonic time nearest ``t_s`` whose Unix time is a multiple of ``step_s`` (s > 0)."""
    return round((t_s + wall_offset_s) / step_s) * step_s - wall_offset_s


def anchor_ramp(nh: NodeHealth, step_s: float, wall_offset_s: float) -> NodeHealth:
    """``nh`` with its PROBATION ramp's ``step_at_s`` on the Unix-time grid of ``step_s``.

    Unchanged (the same object) when the node is not in PROBATION, has no ramp step time, or the
    step time is on the grid already (every later step keeps it there: steps advance it by
    whole ``step_s``). A ramp entered or held at t steps next at the grid point nearest t, plus
    ``step_s``.
    """
    at = nh.ramp.step_at_s
    if nh.state is not NodeState.PROBATION or at is None or step_s <= 0:
        return nh
    snapped = grid_point(at, step_s, wall_offset_s)
    if abs(snapped - at) <= _EPS_S:
        return nh
    return replace(nh, ramp=replace(nh.ramp, step_at_s=snapped))
