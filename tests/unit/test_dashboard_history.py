"""The dashboard's recent history kept by the control plane (pure ring of
samples): bounded by its capacity whatever is added, oldest first, every node's series aligned
with the shared times, a node added later has an empty past, a removed one is forgotten."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.admin.display import DISPLAY_STATES
from xds_server.admin.history import History, HistoryRow


def row(node: str, state: str = "HEALTHY", weight: int | None = 100, rtt: float | None = 1.5) -> HistoryRow:
    return HistoryRow(node, "llm", state, weight, 100, rtt, None if rtt is None else rtt * 10)


def test_samples_come_back_oldest_first_with_not_routed_and_unknown_as_minus_one():
    h = History(capacity=3, interval_s=2.0)
    for i in range(5):
        h.add(100.0 + i, [row("a", "UNHEALTHY" if i == 4 else "HEALTHY", None if i == 4 else 100 - i, float(i))])
    doc = h.to_json()
    assert doc["t"] == [102.0, 103.0, 104.0] and doc["window_s"] == 6.0 and doc["interval_s"] == 2.0
    a = doc["nodes"]["a"]
    assert [doc["states"][s] for s in a["state"]] == ["HEALTHY", "HEALTHY", "UNHEALTHY"]
    assert a["weight"] == [98, 97, -1] and a["rtt_ms"] == [2.0, 3.0, 4.0] and a["ttft_ms"] == [20.0, 30.0, 40.0]
    h.add(105.0, [row("a", rtt=None), row("b")])  # b joins: no past; a's RTT unknown
    doc = h.to_json()
    assert doc["nodes"]["b"]["state"] == [-1, -1, DISPLAY_STATES.index("HEALTHY")]
    assert doc["nodes"]["a"]["rtt_ms"][-1] == -1
    h.add(106.0, [row("b")])  # a removed by a reload: forgotten
    assert set(h.to_json()["nodes"]) == {"b"}


def test_bad_sizes_are_refused_naming_them():
    with pytest.raises(ValueError, match="capacity"):
        History(0, 1.0)


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(1, 20), steps=st.lists(st.sets(st.sampled_from("abcde")), max_size=60))
def test_bounded_and_aligned_whatever_nodes_come_and_go(cap, steps):
    h = History(cap, 1.0)
    for i, nodes in enumerate(steps):
        h.add(float(i), [row(n, DISPLAY_STATES[i % len(DISPLAY_STATES)], i) for n in sorted(nodes)])
    doc = h.to_json()
    n = min(cap, len(steps))
    assert len(h) == n and doc["t"] == [float(i) for i in range(len(steps) - n, len(steps))]
    assert set(doc["nodes"]) == (set(steps[-1]) if steps else set())
    for series in doc["nodes"].values():
        for key in ("state", "weight", "rtt_ms", "ttft_ms"):
            assert len(series[key]) == n
        if n:
            assert series["weight"][-1] == len(steps) - 1  # the last sample is the newest


def test_a_large_fleet_gets_every_kth_sample_ending_with_the_newest():
    h = History(capacity=20, interval_s=2.0)
    for i in range(25):
        h.add(float(i), [row(f"n{k}", weight=i) for k in range(100)])
    assert h.added == 25
    doc = h.to_json(max_values=2000)  # 5 values per series for 100 nodes x 4 series
    assert doc["interval_s"] == 8.0 and doc["t"] == [8.0, 12.0, 16.0, 20.0, 24.0]
    assert doc["nodes"]["n7"]["weight"] == [8, 12, 16, 20, 24]
    assert len(h.to_json()["t"]) == 20  # small enough: every sample
