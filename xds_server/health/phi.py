"""Phi-accrual failure detection over heartbeat inter-arrival times (pure math, no clock reads).

Hayashibara, Défago, Yared, Katayama, "The phi accrual failure detector" (SRDS 2004), as used by
Akka and Cassandra: instead of a fixed timeout, the detector outputs a suspicion level

    phi(t) = -log10( P(next heartbeat arrives later than t) )

where the inter-arrival distribution is estimated from the node's own history. Following Akka,
the distribution is normal with a floor on its standard deviation (``min_std_ms``) and an
``acceptable_pause_ms`` added to the mean. The mean and variance are kept as exponentially
weighted moving estimates (constant memory and O(1) per heartbeat instead of a sample window).

phi = 8 means a 1e-8 chance that a heartbeat this late is still coming (Akka's and Cassandra's
default conviction threshold is 8).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Protocol

from xds_server.process.frozen import fast_init

__all__ = ["ArrivalStats", "Arrivals", "fold", "phi", "suspicion_delay_ms", "update"]


class Arrivals(Protocol):
    """What the phi functions read of an inter-arrival estimate: an :class:`ArrivalStats`, or
    the numbers of one folded in place (:class:`xds_server.health.beats.BeatRun`)."""

    @property
    def mean_ms(self) -> float: ...
    @property
    def var_ms2(self) -> float: ...
    @property
    def samples(self) -> int: ...


@fast_init
@dataclass(frozen=True, slots=True)
class ArrivalStats:
    """EWMA estimate of heartbeat inter-arrival times: mean and variance in ms / ms^2."""

    mean_ms: float
    var_ms2: float
    samples: int = 0


def update(stats: ArrivalStats, interval_ms: float, alpha: float) -> ArrivalStats:
    """Fold one observed inter-arrival interval (ms) into the estimate (EWMA, weight ``alpha``)."""
    return ArrivalStats(*fold(stats.mean_ms, stats.var_ms2, stats.samples, interval_ms, alpha))


def fold(mean_ms: float, var_ms2: float, samples: int, interval_ms: float, alpha: float) -> tuple[float, float, int]:
    """:func:`update` on bare numbers: ``(mean_ms, var_ms2, samples)`` after one more interval
    (ms). The one home of the EWMA arithmetic, so an estimate folded in place
    (:class:`xds_server.health.beats.BeatRun`) is bit for bit the one ``update`` builds."""
    diff = interval_ms - mean_ms
    return mean_ms + alpha * diff, (1.0 - alpha) * (var_ms2 + alpha * diff * diff), samples + 1


def phi(stats: ArrivalStats, elapsed_ms: float, min_std_ms: float, acceptable_pause_ms: float = 0.0) -> float:
    """Suspicion level after ``elapsed_ms`` of silence since the last heartbeat (>= 0)."""
    std = max(math.sqrt(max(stats.var_ms2, 0.0)), min_std_ms)
    z = (elapsed_ms - stats.mean_ms - acceptable_pause_ms) / std
    p_later = 0.5 * math.erfc(z / math.sqrt(2.0))
    if p_later <= 0.0:
        return math.inf
    return -math.log10(p_later)


_Z_MEMO = 64
"""Normal quantiles kept, one per distinct phi threshold (a process has one per config)."""


@lru_cache(maxsize=_Z_MEMO)
def _z_for(threshold: float) -> float:
    return NormalDist().inv_cdf(1.0 - 10.0 ** (-threshold))


def suspicion_delay_ms(stats: Arrivals, threshold: float, min_std_ms: float,
                       acceptable_pause_ms: float = 0.0) -> float:
    """Silence (ms after the last heartbeat) at which ``phi`` reaches ``threshold``.

    The inverse of :func:`phi`, so a caller can arm one timer instead of polling.
    Raises ValueError for a threshold outside (0, 15] (beyond ~15 the normal quantile loses
    precision in double arithmetic).
    """
    if not 0.0 < threshold <= 15.0:
        raise ValueError(f"phi threshold must be in (0, 15], got {threshold}")
    var = stats.var_ms2
    std = math.sqrt(0.0 if 0.0 > var else var)  # max(var, 0.0) and max(std, min_std_ms) below, without
    if min_std_ms > std:                         # the calls (this runs once per heartbeat)
        std = min_std_ms
    return stats.mean_ms + acceptable_pause_ms + _z_for(threshold) * std
