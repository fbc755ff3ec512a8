"""How much load a pool of engine slots takes with the queue-wait tail under a budget. Pure.

The survivors of a cluster behind Envoy's least-request balancing act close to one queue over
all their slots (checked by simulation: four 16-slot engines at 69 % utilization gave no queue
wait at the p99, as the benchmark's unloaded phase measured). For ``c`` slots each finishing a
request in ``1 / mu`` s on average, Poisson arrivals at ``lam`` per s wait longer than ``t`` s
with probability ``C(c, lam / mu) x exp(-(c x mu - lam) x t)`` (Erlang C, M/M/c). Exponential
service is the conservative choice for LLM requests, whose lengths vary widely; deterministic
service (the simulator's) waits about half as long, so the rate found here admits a few points
less than such engines could take (benchmarks/RESULTS.md).

Shape::

    erlang_c(c=32, a=24.0)                       # P(an arrival waits), 0..1
    wait_tail(c=32, lam=24.0, mu=1.25, t_s=0.1)  # P(wait > t_s), 0..1
    max_rate(c=32, mu=1.25, t_s=0.1, tail=0.01)  # arrivals per s with P(wait > t_s) <= tail
"""
from __future__ import annotations

import math

__all__ = ["erlang_c", "max_rate", "wait_tail"]

_MAX_SLOTS = 100_000
"""Slots counted at most (a pool beyond this behaves as this one; bounds the O(c) recursion)."""


def erlang_c(c: int, a: float) -> float:
    """The probability that an arrival waits in an M/M/c queue with offered load ``a`` (erlangs,
    ``lam / mu``): 1.0 at or beyond ``c``; 0.0 for ``c < 1`` is not a queue (raises ValueError).
    Computed through the Erlang B recursion, stable for any ``c``."""
    if c < 1:
        raise ValueError("c: at least one slot")
    if not a > 0:
        return 0.0
    if a >= c:
        return 1.0
    b = 1.0
    for k in range(1, min(c, _MAX_SLOTS) + 1):
        b = a * b / (k + a * b)
    return min(1.0, c * b / (c - a * (1.0 - b)))


def wait_tail(c: int, lam: float, mu: float, t_s: float) -> float:
    """P(an arrival waits longer than ``t_s``) for ``c`` slots at ``mu`` requests per s each and
    Poisson arrivals at ``lam`` per s (1.0 when ``lam >= c x mu``)."""
    if lam >= c * mu:
        return 1.0
    return erlang_c(c, lam / mu) * math.exp(-(c * mu - lam) * max(t_s, 0.0))


def max_rate(c: int, mu: float, t_s: float, tail: float = 0.01) -> float:
    """The largest arrival rate (per s) whose wait exceeds ``t_s`` with probability at most
    ``tail`` (bisection to 0.1 % of ``c x mu``); 0.0 when there are no slots or no service."""
    if c < 1 or not mu > 0 or not math.isfinite(mu):
        return 0.0
    c = min(c, _MAX_SLOTS)
    lo, hi = 0.0, c * mu
    while hi - lo > 1e-3 * c * mu:
        mid = (lo + hi) / 2.0
        if wait_tail(c, mid, mu, t_s) <= tail:
            lo = mid
        else:
            hi = mid
    return lo
