"""What one publish of a large cluster costs the control plane's loop, by phase: the full decision
(cluster policy over every node, the ClusterLoadAssignment, the cache, the relay feed's
announcements) and the urgent lane's patch (the last assignment with a lost node out).

Usage: python benchmarks/publish_cost.py [--nodes N] [--changed K] [--publishes P]

A control plane in process (no sockets: in-memory probe sources, a manual clock, a routing
listener as the relay feed would register). N nodes are made HEALTHY, then before each full
publish K of them get a new RTT sample, heartbeat and probe (their records change, as with the
default 1 s RTT pings at 2,000 nodes: ~25 % per publish); before each urgent publish one node
reports a GPU fatal event (out on hard evidence). Prints the median milliseconds per publish and
per phase. One core, no other load: the loaded benchmark (dial_in.py) reads ~2.4x these.
"""
from __future__ import annotations

import argparse
import collections
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from xds_server.config import parse_config
from xds_server.control import publish as planner_module
from xds_server.feed import events as feed_events
from xds_server.server import ControlPlane
from xds_server.testing import InMemoryProbes, ManualClock
from xds_server.xds import publisher as publisher_module

PHASES = collections.defaultdict(list)


def _timed(owner: Any, name: str, label: str) -> None:
    """Wrap ``owner.name`` to add each call's wall time to ``PHASES[label]`` (ms)."""
    fn: Callable[..., Any] = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            PHASES[label].append((time.perf_counter() - t) * 1000.0)

    setattr(owner, name, wrapper)


def _plane(n: int) -> tuple[ControlPlane, ManualClock, InMemoryProbes]:
    cfg = parse_config({
        "xds": {"listen": "127.0.0.1:0", "coalesce_window_ms": 5, "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"failure_detector": "count", "ramp_start_percent": 100.0},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"10.0.{i // 250}.{i % 250 + 1}:8000"} for i in range(n)]}]})
    clock, probes = ManualClock(), InMemoryProbes()
    cp = ControlPlane(cfg, clock=clock, probe_sources=probes)
    cp.open()
    cp.routing_listeners.append(lambda change: None)  # the relay feed's place
    rng = random.Random(1)
    for r in range(30):
        for nid in cp.core.node_cfg:
            probes[nid].heartbeat()
            probes[nid].probe(ttft_ms=20.0)
            if r % 3 == 0:
                probes[nid].ping(rng.uniform(5.0, 15.0))
        clock.advance(0.1)
    return cp, clock, probes


def run(n: int, changed: int, publishes: int) -> dict[str, dict[str, float]]:
    cp, clock, probes = _plane(n)
    _timed(cp.core.planner, "publish", "decision (planner)")  # the rest: the hand-over (control/publish_turns.py)
    _timed(planner_module.hp, "cluster_routing", "policy walk")
    _timed(publisher_module, "build_cla", "ClusterLoadAssignment")
    _timed(publisher_module, "set_cla", "cache (validate, encode)")
    _timed(feed_events.RoutingNotifier, "announce_changes", "relay feed announcements")
    ids, rng, out = list(cp.core.node_cfg), random.Random(2), {}
    write = cp.core.on_publish
    slow = {"build_s": 0.0}

    def build_takes_time(p: Any) -> None:  # the loop's clock moves while a build runs: the gap
        write(p)
        clock._now += slow["build_s"]

    cp.core.on_publish = build_takes_time

    def beat_all() -> None:  # steady heartbeats (folded: no record changes), 50 ms on
        for nid in ids:
            probes[nid].heartbeat()
        clock.advance(0.05)

    for kind in ("full", "urgent"):
        total: list[float] = []
        phases: dict[str, list[float]] = collections.defaultdict(list)
        for k in range(publishes):
            beat_all()
            if kind == "full":
                for nid in rng.sample(ids, changed):
                    probes[nid].ping(rng.uniform(5.0, 15.0))
                    probes[nid].probe(ttft_ms=rng.uniform(15.0, 30.0))
                cp.core.mark_dirty("llm")
                run_it: Callable[[], object] = cp.core.publish
            else:
                slow["build_s"] = 0.02                   # a full build's gap (60 ms): the next comes early
                planner = cp.core.planner                # the last urgent publish's decision done, its gap over
                while planner.scheduled or clock.now() < planner.last_publish_s + planner.min_gap_s():
                    clock.advance(max(0.001, min(planner.due_s, planner.last_publish_s + planner.min_gap_s())
                                      - clock.now()))
                cp.core.mark_dirty("llm")
                cp.core.publish()                        # a full one, not early itself
                nid = ids[k]
                probes[nid].heartbeat(gpu_fatal="Xid 79")  # out on hard evidence: the urgent publish is armed

                def run_it() -> None:
                    clock.advance(max(0.0, cp.core.planner.due_s - clock.now()))
            marks = {label: len(v) for label, v in PHASES.items()}
            t = time.perf_counter()
            run_it()
            total.append((time.perf_counter() - t) * 1000.0)
            for label, v in PHASES.items():
                phases[label].append(sum(v[marks.get(label, 0):]))
            if kind == "urgent":
                assert cp.routing[ids[k]].health_status == "UNHEALTHY", "the lost node is published out"
        out[kind] = {"publish": statistics.median(total),
                     **{label: statistics.median(v) for label, v in phases.items()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--changed", type=int, default=500, help="records changed before each full publish")
    ap.add_argument("--publishes", type=int, default=30)
    args = ap.parse_args()
    for kind, phases in run(args.nodes, args.changed, args.publishes).items():
        print(f"{kind:7s} " + ", ".join(f"{label} {ms:.2f} ms" for label, ms in phases.items()))


if __name__ == "__main__":
    main()
