"""The per-stream request budget (pure token bucket): hypothesis over arbitrary request sizes
and arrival times."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.xds.budget import RequestBudget


def test_a_full_bucket_admits_one_request_of_any_size_then_waits_for_the_debt():
    b = RequestBudget(rate_bytes_per_s=1000, burst_bytes=4000, min_cost_bytes=100, now_s=0.0)
    assert b.wait_s(0.0) == 0.0
    b.charge(10_000, 0.0)                        # a reconnect naming everything: admitted
    assert b.wait_s(0.0) == pytest.approx(6.0)   # 6,000 bytes of debt at 1,000 B/s
    assert b.wait_s(5.0) == pytest.approx(1.0)
    assert b.wait_s(6.0) == 0.0


def test_tiny_requests_cost_at_least_the_minimum():
    b = RequestBudget(rate_bytes_per_s=1000, burst_bytes=1000, min_cost_bytes=100, now_s=0.0)
    admitted = 0
    while b.wait_s(0.0) == 0.0:
        b.charge(1, 0.0)
        admitted += 1
    assert admitted == 11  # 1,000 B of burst / 100 B each, plus the one that overdraws


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError):
        RequestBudget(0, 1, 0, 0.0)
    with pytest.raises(ValueError):
        RequestBudget(1, 0, 0, 0.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 2, allow_nan=False), st.integers(0, 50_000)), max_size=100),
       st.integers(100, 10_000), st.integers(1_000, 100_000), st.integers(0, 2_000))
def test_bytes_admitted_never_exceed_burst_plus_rate_times_elapsed_plus_one_request(reqs, rate, burst, min_cost):
    """Whatever a client sends and whenever, the bytes the server processes over [0, t] are at
    most burst + rate x t + one request (the one that may overdraw)."""
    b = RequestBudget(rate, burst, min_cost, now_s=0.0)
    now = 0.0
    charged = 0.0
    biggest = 0.0
    for gap, size in reqs:
        now += gap
        wait = b.wait_s(now)
        assert wait >= 0.0
        now += wait  # the shell sleeps this long before processing
        assert b.wait_s(now) == pytest.approx(0.0, abs=1e-9)
        cost = max(size, min_cost)
        b.charge(size, now)
        charged += cost
        biggest = max(biggest, cost)
        assert charged <= burst + rate * now + biggest + 1e-6
