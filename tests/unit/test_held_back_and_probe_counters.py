"""Counters: a held-back ejection is one event per episode and a node flag; probe
failures are counted per node, kind and outcome (a Prometheus counter with bounded labels)."""
from __future__ import annotations

from test_control_core import all_healthy, config, in_memory, metric_samples

from xds_server.health import model as hm


def test_held_back_ejection_counted_once_over_40_recomputes_in_4s_and_shown_on_the_node():
    cp, clock, probes = in_memory(config(n=4))
    all_healthy(cp, clock, probes)
    soft = {"n0": {"requests_waiting": 500.0}, "n1": {"gpu_free_ratio": 0.01}, "n2": {"gpu_free_ratio": 0.02}}
    for _ in range(40):  # 4 s of heartbeats at 10 Hz, each one recomputes the cluster
        for nid in cp.core.node_cfg:
            probes[nid].heartbeat(**soft.get(nid, {}))
        clock.advance(0.1)
    assert cp.core.counters.events["held_back"] == 1
    held = [n for n in cp.core.node_cfg if cp.view.node(n)["held_back"]]
    assert held == ["n2"]  # cap 2 of 4: n0 and n1 out, n2 held back
    assert cp.view.node("n2")["eds_health_status"] == "HEALTHY"
    # the episode ends (GPU memory back) and a new one starts: counted again, once
    for free in (0.5, 0.02):
        for _ in range(10):
            probes["n2"].heartbeat(gpu_free_ratio=free)
            for nid in ("n0", "n1", "n3"):
                probes[nid].heartbeat(**soft.get(nid, {}))
            clock.advance(0.1)
        assert bool(cp.view.node("n2")["held_back"]) is (free == 0.02)
    assert cp.core.counters.events["held_back"] == 2


def test_probe_failures_counted_per_node_kind_and_outcome_besides_the_consecutive_count():
    cp, clock, probes = in_memory(config(n=3))
    all_healthy(cp, clock, probes)
    K = hm.ProbeResultKind
    probes["n0"].probe(kind=K.TIMEOUT)
    probes["n0"].probe(ttft_ms=20.0)
    probes["n0"].probe(kind=K.TIMEOUT)
    probes["n0"].probe(kind=K.HTTP_STATUS, http_status=429)
    probes["n1"].probe(ttft_ms=950.0)         # a token after the 800 ms deadline: a timeout
    probes["n1"].probe(ttft_ms=450.0)         # slow, within the deadline: not a failure
    s = metric_samples(cp, "sentinel_node_probe_results")  # every result; failures: not OK, not good/slow
    got = {(d["node"], d["kind"], d["outcome"]): v for k, v in s.items() for d in [dict(k)]
           if d["kind"] != "OK" and d["outcome"] not in ("good", "slow")}
    assert got == {("n0", "TIMEOUT", "fail"): 2.0, ("n0", "HTTP_STATUS", "busy"): 1.0,
                   ("n1", "TIMEOUT", "fail"): 1.0}
    assert cp.view.node("n0")["probe_failures"] == {"HTTP_STATUS/busy": 1, "TIMEOUT/fail": 2}
    assert cp.view.node("n0")["consecutive_probe_failures"] == 1
    assert cp.view.node("n2")["probe_failures"] == {}
