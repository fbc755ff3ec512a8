"""Seed 002's queue levels (``health.load.queue_warning`` 50, ``health.load.queue_critical`` 100) as events,
judged on each node's own heartbeats: with no Envoy reporting load (LRS off or silent) a queue of
150 still raises ``queue_critical``, once per change of level, never once per heartbeat."""
from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from xds_server.config import HealthConfig, parse_config
from xds_server.control.core import ControlCore
from xds_server.health import model as hm
from xds_server.health.queue_levels import QueueWatch, queue_level
from xds_server.process.clock import ManualClock

CFG = HealthConfig()


@given(st.lists(st.one_of(st.none(), st.floats(0, 300, allow_nan=False)), max_size=60))
def test_one_event_per_change_of_level_and_none_while_it_holds(waits):
    watch = QueueWatch()
    events = [watch.change("n0", w, CFG) for w in waits]
    levels = ["ok", *(queue_level(w, CFG) for w in waits)]
    expected = [f"queue_{b}" if a != b else None for a, b in itertools.pairwise(levels)]
    assert [e and e[0] for e in events] == expected
    assert watch.levels.get("n0", "ok") == levels[-1]


def test_boundaries_are_over_not_at():
    assert queue_level(50, CFG) == "ok" and queue_level(50.5, CFG) == "warning"
    assert queue_level(100, CFG) == "warning" and queue_level(101, CFG) == "critical"
    assert queue_level(None, CFG) == "ok"


def _core() -> ControlCore:
    cfg = parse_config({
        "xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0"},
        "clusters": [{"name": "llm", "nodes": [
            {"id": "n0", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:9001"}]}]})
    core = ControlCore(cfg, ManualClock())
    core.begin()
    return core


def test_a_queue_of_150_on_heartbeats_alone_raises_queue_critical_once_and_clears():
    core = _core()
    t = 0.0
    for waiting in [10.0] * 20 + [150.0] * 30 + [70.0] * 5 + [10.0] * 5:
        core.observe("n0", hm.HeartbeatObserved(requests_running=4.0, requests_waiting=waiting), t)
        t += 0.1
    kinds = [(e.node_id, e.kind) for e in core.events if e.kind.startswith("queue_")]
    assert kinds == [("n0", "queue_critical"), ("n0", "queue_warning"), ("n0", "queue_ok")]
    critical = next(e for e in core.events if e.kind == "queue_critical")
    assert critical.cluster == "llm" and "150 waiting, over 100 waiting" in critical.reason


def test_a_dropped_node_forgets_its_level():
    core = _core()
    core.observe("n0", hm.HeartbeatObserved(requests_waiting=150.0), 0.0)
    assert core.queues.levels == {"n0": "critical"}
    cfg = parse_config({"xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0"},
                        "clusters": [{"name": "llm", "nodes": []}]})
    core.reconfigure(cfg)
    assert core.queues.levels == {}
