"""The pace of RTT pings (xds_server.probing.rtt_pace): never more often than ping_interval, and
all streams of a process together within ping_budget pings a second."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from xds_server.config.health import RttConfig
from xds_server.probing.rtt_pace import PingPace, paced_interval_s

intervals = st.floats(min_value=0.001, max_value=600.0)
streams = st.integers(min_value=0, max_value=100_000)
budgets = st.one_of(st.just(0.0), st.floats(min_value=1.0, max_value=100_000.0))  # as the config allows


@given(intervals, streams, budgets)
def test_prop_a_stream_never_pings_more_often_than_its_interval(interval, pinging, budget):
    assert paced_interval_s(interval, pinging, budget) >= interval


@given(intervals, streams, budgets)
def test_prop_the_streams_together_stay_within_the_budget_or_at_their_own_interval(interval, pinging, budget):
    paced = paced_interval_s(interval, pinging, budget)
    rate = pinging / paced
    if budget > 0 and pinging / interval > budget:
        assert rate <= budget * (1 + 1e-9) and rate >= budget * (1 - 1e-9)  # stretched: exactly the budget
    else:
        assert paced == interval  # within the budget (or none): the configured interval


@given(intervals, streams, streams, budgets)
def test_prop_more_streams_never_ping_each_one_more_often(interval, a, b, budget):
    lo, hi = sorted((a, b))
    assert paced_interval_s(interval, lo, budget) <= paced_interval_s(interval, hi, budget)


def test_a_budget_under_one_ping_a_second_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match="ping_budget") as e:
        RttConfig.model_validate({"ping_budget": 0.5})
    assert "must be 0 (no budget) or at least 1 ping a second, got 0.5" in str(e.value)
    with pytest.raises(ValidationError, match="ping_budget"):
        RttConfig.model_validate({"ping_budget": -1})
    assert RttConfig.model_validate({"ping_budget": 0}).ping_budget == 0


def test_worked_examples():
    assert paced_interval_s(1.0, 2000, 400.0) == 5.0   # the default budget at 2,000 nodes
    assert paced_interval_s(1.0, 400, 400.0) == 1.0    # up to 400 nodes: every second
    assert paced_interval_s(1.0, 2000, 0.0) == 1.0     # no budget


def test_one_pace_per_loop_counts_the_pinging_streams_and_jitters_each_wait():
    async def main() -> tuple[int, int, float, list[float]]:
        loop = asyncio.get_running_loop()
        rtt = RttConfig.model_validate({"ping_interval": "1s", "ping_budget": 100, "ping_jitter": 0.2})
        paces = [PingPace.acquire(loop) for _ in range(300)]
        assert all(p is paces[0] for p in paces)
        waits = [paces[0].wait_s(rtt) for _ in range(200)]
        mean = paces[0].interval_s(rtt)
        for p in paces[:100]:
            p.release()
        return paces[0].pinging, len(paces), mean, waits + [paces[0].interval_s(rtt)]

    pinging, acquired, mean, waits = asyncio.run(main())
    assert acquired == 300 and pinging == 200
    assert mean == 3.0                                    # 300 streams at 100 pings a second
    assert all(2.4 <= w <= 3.6 for w in waits[:-1])       # 3 s x [0.8, 1.2]
    assert len({round(w, 6) for w in waits[:-1]}) > 100   # jittered, not one value
    assert waits[-1] == 2.0                               # 200 streams left
