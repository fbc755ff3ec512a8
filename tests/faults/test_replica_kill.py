"""The fault matrix's control-plane replica row, small count: two replicas (docs/replicas.md: each
agent dials both, Envoy's xds_cluster lists both), kill -9 of the one Envoy's ADS stream is on
under mixed traffic, restart. ``benchmarks/fault_matrix.py --agents dial-in --only replica_kill``
runs it with full counts. Run with -s to see the row.
"""
from __future__ import annotations

import pytest
from fault_checks import running_rig

from xds_server.testing import format_table, replica_kill

pytestmark = pytest.mark.envoy


@pytest.fixture(scope="module")
def rig():
    yield from running_rig(agents="dial-in", replicas=2)


async def test_a_replica_killed_under_traffic_loses_nothing_and_its_agents_come_back(rig, http):
    rows, info = await replica_kill(rig, http, times=1, down_s=1.0)
    print("\n" + format_table(rows))
    print(info)
    for r in rows:
        assert r.stats.requests_ok > 0 and r.stats.streams_ok > 0, r
        assert r.stats.failed == 0 and r.stats.cut == 0, r
    (kill,) = info["kills"]
    # the survivor judged on alone: every node HEALTHY throughout, nothing ejected
    assert all(states == ["HEALTHY"] for states in kill["survivor_states"].values()), kill
    assert kill["survivor"]["ejections"] == 0 and info["survivor_left_healthy"] == [], kill
    assert kill["survivor"]["fail_static_episodes"] == 0, kill
    # Envoy moved to the survivor and routed every node throughout
    assert kill["envoy_moved_s"] < 5.0, kill
    assert info["unrouted"] == [], info
    assert all(states == ["HEALTHY"] for states in info["envoy_states_seen"].values()), info
    # every agent dialled the restarted replica again within its back-off (at most 5 s)
    assert kill["agents_back_s"] <= 6.0, kill
