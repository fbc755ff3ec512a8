"""Readers that show no heartbeat leave the steady nodes' heartbeat runs open: a publish and the
dashboard's history sample read the records with folded heartbeats not settled, so each node's
next heartbeat still folds (settling made it take the full health step)."""
from __future__ import annotations

from test_control_core import all_healthy, config, in_memory


def steady(n: int = 4):
    cp, clock, probes = in_memory(config(n=n, xds={"coalesce_window_ms": 0, "warmup_timeout_ms": 0}))
    all_healthy(cp, clock, probes)
    for _ in range(3):
        for nid in cp.core.node_cfg:
            probes[nid].heartbeat()
        clock.advance(0.1)
    return cp, clock, probes


def test_a_publish_leaves_the_steady_heartbeat_runs_open():
    cp, _, _ = steady()
    runs = dict(cp.core.health.runs)
    assert runs, "steady heartbeats fold into runs"
    oldest = min(r.last_s for r in runs.values())
    assert cp.core.health.oldest_heartbeat_s() == oldest
    cp.core.mark_dirty("llm")
    cp.core.publish()
    assert cp.core.health.runs == runs                      # nothing settled
    settled = [cp.core.health[n].heartbeat.last_s for n in cp.core.node_cfg]  # reads settle them
    assert oldest == min(x for x in settled if x is not None)
    assert not cp.core.health.runs


def test_a_history_sample_leaves_the_runs_open_and_shows_what_a_settled_read_shows():
    cp, _, _ = steady()
    runs = dict(cp.core.health.runs)
    assert len(runs) == 4
    rows = cp.view.history_rows(cp.view.node_ids())
    assert cp.core.health.runs == runs
    shown = {r.node_id: (r.state, r.weight, r.rtt_ms, r.ttft_ms) for r in rows}
    assert shown == {n: (d.state, d.shown_weight, cp.core.health[n].rtt.ewma_ms, cp.core.health[n].probe.last_ttft_ms)
                     for n in cp.core.node_cfg if (d := cp.view.display(n))}
