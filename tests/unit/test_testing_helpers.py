"""The pure helpers of xds_server.testing: Envoy admin parsing, wait_for and the re-exported ManualClock."""
from __future__ import annotations

import pytest

from xds_server.testing import EnvoyHost, ManualClock, parse_envoy_clusters, parse_envoy_stats, wait_for


def _host(port: int, **health: object) -> dict:
    h: dict = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
               "health_status": health}
    return h


# Shape of Envoy's GET /clusters?format=json (admin.v3.Clusters), trimmed to the fields we read.
CLUSTERS = {"cluster_statuses": [
    {"name": "other", "host_statuses": [_host(9000, eds_health_status="HEALTHY")]},
    {"name": "llm", "host_statuses": [
        {**_host(8001, eds_health_status="HEALTHY"), "weight": 70, "priority": 1,
         "stats": [{"name": "rq_total", "value": "5", "type": "COUNTER"}, {"name": "rq_error", "type": "COUNTER"},
                   {"name": "cx_active", "value": "1", "type": "GAUGE"}]},
        _host(8002, eds_health_status="UNHEALTHY", failed_outlier_check=True),
        _host(8003, failed_outlier_check=True, pending_dynamic_removal=False),
        _host(8004),
    ]},
]}


def test_parse_envoy_clusters_reads_one_cluster_with_defaults():
    hosts = parse_envoy_clusters(CLUSTERS, "llm")
    assert hosts == [
        EnvoyHost(8001, "HEALTHY", (), 70, 1, requests=5, errors=0),
        EnvoyHost(8002, "UNHEALTHY", ("failed_outlier_check",), 1, 0),
        EnvoyHost(8003, "HEALTHY", ("failed_outlier_check",), 1, 0),
        EnvoyHost(8004, "HEALTHY", (), 1, 0),
    ]
    # routed, or why not: the EDS status first, then Envoy's own flag
    assert [h.status for h in hosts] == ["HEALTHY", "UNHEALTHY", "failed_outlier_check", "HEALTHY"]
    assert parse_envoy_clusters(CLUSTERS, "absent") == []
    assert parse_envoy_clusters({}, "llm") == []


def test_parse_envoy_stats_keeps_integers_only():
    text = ("cluster.llm.upstream_rq_retry: 3\ncluster.llm.upstream_rq_retry_overflow: 0\n"
            "cluster.llm.upstream_rq_time: P0(nan,1.0) P25(nan,2.0)\n")
    assert parse_envoy_stats(text) == {"cluster.llm.upstream_rq_retry": 3,
                                       "cluster.llm.upstream_rq_retry_overflow": 0}


async def test_wait_for_sync_and_async_predicates_and_timeout():
    calls = []

    def sync_pred():
        calls.append(1)
        return len(calls) >= 3 and "done"

    assert await wait_for(sync_pred, timeout_s=2.0, step_s=0.001) == "done"
    assert len(calls) == 3

    async def async_pred():
        return 42

    assert await wait_for(async_pred) == 42
    with pytest.raises(AssertionError, match=r"never: not met within 0.05 s"):
        await wait_for(lambda: False, timeout_s=0.05, step_s=0.01, what=lambda: "never")


def test_manual_clock_moves_only_forward_when_told_and_runs_due_timers():
    clock = ManualClock(10.0)
    fired: list[float] = []
    clock.call_at(10.2, lambda: fired.append(clock()))
    assert clock() == 10.0 == clock.now()
    clock.advance(0.25)
    assert clock() == 10.25 and fired == [10.2]
    with pytest.raises(ValueError, match="dt_s"):
        clock.advance(-1)
    assert clock() == 10.25
