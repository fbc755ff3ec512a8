"""The queueing model behind shedding with the engines' counts (xds_server.policy.queueing, pure):
Erlang C against its closed forms, the admitted rate keeps the wait tail at its bound, and more
slots or a longer budget never admit less (hypothesis); checked against a simulated queue."""
from __future__ import annotations

import heapq
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xds_server.policy.queueing import erlang_c, max_rate, wait_tail


def test_erlang_c_closed_forms():
    for a in (0.1, 0.5, 0.9):
        assert erlang_c(1, a) == pytest.approx(a)  # M/M/1: an arrival waits with probability rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # 2 a^2 / (2 + a) / (2 - a) ... at a = 1: 1/3
    assert erlang_c(4, 0.0) == 0.0 and erlang_c(4, 4.0) == 1.0 and erlang_c(4, 9.0) == 1.0
    with pytest.raises(ValueError):
        erlang_c(0, 1.0)


@given(st.integers(1, 400), st.floats(0.05, 20), st.floats(0.0, 5.0), st.floats(1e-4, 0.5))
def test_the_rate_found_keeps_the_tail_and_more_slots_or_budget_never_admit_less(c, mu, t, tail):
    lam = max_rate(c, mu, t, tail)
    assert 0.0 <= lam < c * mu
    assert wait_tail(c, lam, mu, t) <= tail + 1e-12
    assert max_rate(c + 1, mu, t, tail) >= lam - 1e-3 * c * mu
    assert max_rate(c, mu, t + 0.1, tail) >= lam - 1e-3 * c * mu


def _simulated_p99_wait(c: int, service_s: float, lam: float, n: int = 60_000) -> float:
    """One FIFO queue over c slots, exponential service, Poisson arrivals."""
    rng, t, free, waits = random.Random(7), 0.0, [0.0] * c, []
    for _ in range(n):
        t += rng.expovariate(lam)
        start = max(t, heapq.heappop(free))
        waits.append(start - t)
        heapq.heappush(free, start + rng.expovariate(1 / service_s))
    waits.sort()
    return waits[int(0.99 * n)]


@pytest.mark.parametrize(("c", "service_s", "budget_s"), [(32, 0.8, 0.1), (4, 0.2, 0.2), (16, 0.8, 0.4)])
def test_at_the_rate_found_a_simulated_queue_waits_past_the_budget_about_1_in_100(c, service_s, budget_s):
    lam = max_rate(c, 1 / service_s, budget_s, 0.01)
    p99 = _simulated_p99_wait(c, service_s, lam)
    assert 0.5 * budget_s <= p99 <= 1.5 * budget_s, (lam, p99)
    assert math.isfinite(lam) and lam > 0
