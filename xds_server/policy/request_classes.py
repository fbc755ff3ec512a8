"""Which request classes to shed, lowest first. Pure.

With request classes on (``lrs.shed.classes``) each class of a cluster is its own Envoy cluster
over the same nodes, with its own ``drop_overloads``. :func:`~xds_server.policy.overload_drop.shed_step`
decides how much of the cluster's total demand to drop (the excess); :func:`allocate` spreads it
over the classes: the lowest class (sheddable) is dropped first, up to its maximum share, then the
next (standard), then the highest (critical) only for what the lower ones cannot cover.

Shapes: ``demands`` are each class's offered requests over the same window (issued + dropped, per
s or per window: any unit, the same for all), lowest class first; ``max_ratios`` the most of each
class that may be dropped (0..1); the answer is each class's drop ratio (0..1). A negative, NaN or
infinite input counts as 0 (never raises).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["allocate", "class_percents"]


def _clean(x: float) -> float:
    return x if math.isfinite(x) and x > 0 else 0.0


def allocate(excess_ratio: float, demands: Sequence[float], max_ratios: Sequence[float]) -> list[float]:
    """Drop ratio (0..1) per class, lowest class first, so that the requests dropped,
    ``sum(ratio[k] x demands[k])``, equal ``excess_ratio x sum(demands)`` (0..1 of the total) when
    the classes' maxima allow it (all of them at their maximum otherwise), and a class is dropped
    only once every lower class with demand is dropped at its maximum."""
    d = [_clean(x) for x in demands]
    m = [min(1.0, _clean(x)) for x in max_ratios] + [0.0] * max(0, len(d) - len(max_ratios))
    left = min(1.0, _clean(excess_ratio)) * sum(d)
    out = []
    for dk, mk in zip(d, m, strict=False):
        r = min(mk, left / dk) if dk > 0 else 0.0  # (not take / dk: a tiny demand must not underflow)
        out.append(r)
        if dk > 0:  # below its maximum, this class took all that was left (no rounding remainder)
            left = max(0.0, left - mk * dk) if r >= mk else 0.0
    return out


def class_percents(excess_percent: float, demands: Sequence[float], max_percents: Sequence[float],
                   step_percent: float, held: Sequence[float] = ()) -> list[float]:
    """:func:`allocate` in percent (0..100), each class's share rounded to the nearest
    ``step_percent`` and never above its maximum; a class at its maximum keeps the maximum
    exactly, one with nothing to drop is 0. ``held``: the shares published now; a class keeps its
    held share while the new one is less than a step away from it (hysteresis: noise in the
    demand mix does not rewrite the assignments), so each share is within a step of the exact one."""
    ratios = allocate(excess_percent / 100.0, demands, [p / 100.0 for p in max_percents])
    step = step_percent if math.isfinite(step_percent) and step_percent > 0 else 1.0
    out = []
    for k, (r, mx) in enumerate(zip(ratios, max_percents, strict=False)):
        p = r * 100.0
        cap = min(100.0, _clean(mx))
        if p >= cap - 1e-9 or p <= 0:
            out.append(cap if p > 0 else 0.0)
        elif k < len(held) and 0 < held[k] <= cap and abs(p - held[k]) < step:
            out.append(held[k])
        else:
            out.append(min(cap, round(p / step) * step))
    return out
