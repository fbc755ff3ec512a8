"""A cluster-policy decision that held the loop longer than the coalescing window is handed over a
moment later: a read that arrived during the decision runs first (on asyncio's loop and uvloop's),
a node lost meanwhile is taken out on top of the decision, a patch is never parked, and no publish,
direct or armed, ever hands over before a parked decision."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest
from test_control_core import all_healthy, config, in_memory

from xds_server.config import parse_config
from xds_server.control.core import ControlCore
from xds_server.control.publish import ClusterPublish
from xds_server.process import event_loop
from xds_server.process.clock import LoopClock


def recording(cp) -> list[ClusterPublish]:
    """Every publish handed to on_publish, in order."""
    seen: list[ClusterPublish] = []
    write = cp.core.on_publish

    def rec(p: ClusterPublish) -> None:
        seen.append(p)
        write(p)

    cp.core.on_publish = rec
    return seen


def slow_decisions(cp, clock, walk_s: float) -> None:
    """Every full decision takes ``walk_s`` of the clock (the loop's clock moves while the policy
    walks 2,000 nodes: ~11 ms idle, 20-60 ms loaded, benchmarks/RESULTS.md); patches take none."""
    decide = cp.core.planner.publish

    def slow(*a, **k):
        out = decide(*a, **k)
        if any(not p.patched for p in out):
            clock._now += walk_s
        return out

    cp.core.planner.publish = slow


def started(walk_s: float):
    cp, clock, probes = in_memory(config(n=3, xds={"coalesce_window_ms": 5, "warmup_timeout_ms": 0}))
    all_healthy(cp, clock, probes)
    slow_decisions(cp, clock, walk_s)
    return cp, clock, probes, recording(cp)


def test_a_long_decision_is_parked_and_a_node_lost_meanwhile_is_taken_out_on_top_of_it():
    cp, clock, probes, seen = started(0.02)
    before = dict(cp.core.routing)
    cp.core.mark_dirty("llm")                    # after a quiet gap: due at once
    clock.advance(0.0)                           # the armed publish decides; its walk moves the clock
    assert seen == [] and cp.core.routing == before and cp.core._turns.parked  # decided, not handed over
    probes["n1"].heartbeat(gpu_fatal="Xid 79")   # read before the hand-over: its patch is armed
    clock.advance(0.01)                          # the patch's publish hands the parked decision over first
    assert [p.patched for p in seen][:2] == [(), ("n1",)]   # the decision first, the patch on top of it
    assert cp.core.routing["n1"].health_status == "UNHEALTHY"
    assert cp.core.routing["n0"].health_status == "HEALTHY"


def test_a_parked_decision_is_handed_over_after_its_hops_with_nothing_else_to_run():
    cp, clock, _probes, seen = started(0.02)
    cp.core.mark_dirty("llm")
    clock.advance(0.0)
    assert seen == [] and cp.core._turns.parked
    clock.advance(0.0)                           # the hops, each a timer due at once, then the hand-over
    assert [p.patched for p in seen] == [()] and not cp.core._turns.parked


def test_a_short_decision_is_handed_over_at_once():
    cp, clock, _probes, seen = started(0.004)    # under the 5 ms window
    cp.core.mark_dirty("llm")
    clock.advance(0.0)
    assert len(seen) == 1 and not cp.core._turns.parked


def test_a_direct_publish_and_the_end_hand_a_parked_decision_over_first():
    for how in ("drain", "end"):
        cp, clock, _probes, seen = started(0.02)
        cp.core.mark_dirty("llm")
        clock.advance(0.0)
        assert seen == [] and cp.core._turns.parked, how
        if how == "drain":
            cp.core.drain("n2", True, "maintenance")         # publishes at once, as asked
            assert len(seen) == 2 and seen[0].routing["n2"].health_status == "HEALTHY", how
            assert seen[1].routing["n2"].health_status == "DRAINING", how
        else:
            cp.core.end()
            assert len(seen) == 1 and seen[0].patched == (), how
        assert not cp.core._turns.parked, how


def test_a_patch_is_never_parked_however_long_it_takes():
    cp, clock, probes, seen = started(0.0)
    decide = cp.core.planner.publish

    def slow_patch(*a, **k):
        out = decide(*a, **k)
        clock._now += 0.02                        # a patch of 2,000 endpoints on a loaded core
        return out

    cp.core.planner.publish = slow_patch
    probes["n1"].heartbeat(gpu_fatal="Xid 79")
    clock.advance(0.0)
    assert [p.patched for p in seen] == [("n1",)] and not cp.core._turns.parked


def test_a_hand_over_that_raises_leaves_the_next_change_armed():
    cp, clock, probes, _seen = started(0.02)
    write = cp.core.on_publish
    fail = [True]

    def flaky(p):
        if fail.pop() if fail else False:
            raise RuntimeError("cache write failed")
        write(p)

    cp.core.on_publish = flaky
    cp.core.mark_dirty("llm")
    clock.advance(0.0)                            # decided, parked
    probes["n1"].heartbeat(gpu_fatal="Xid 79")    # its patch settles the parked decision first: that raises
    with pytest.raises(RuntimeError, match="cache write failed"):
        clock.advance(0.01)
    probes["n2"].heartbeat(gpu_fatal="Xid 79")    # the next change is armed and published
    clock.advance(0.5)
    assert cp.core.routing["n1"].health_status == cp.core.routing["n2"].health_status == "UNHEALTHY"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_read_that_arrives_during_a_long_decision_runs_before_its_hand_over(loop):
    order: list[str] = []

    async def main() -> None:
        running = asyncio.get_running_loop()
        cfg = parse_config(config(n=3, xds={"coalesce_window_ms": 5, "warmup_timeout_ms": 0}))
        core = ControlCore(cfg, LoopClock(), on_publish=lambda p: order.append("hand-over"))
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        decide = core.planner.publish

        def slow(*a, **k):                        # the warm-up timeout's publish: a full decision
            out = decide(*a, **k)
            if not order:
                theirs.send(b"x")                 # the lost stream's bytes arrive during the walk
                time.sleep(0.02)                  # the walk holds the loop
                order.append("decided")
            return out

        core.planner.publish = slow

        async def read() -> None:
            await running.sock_recv(ours, 1)
            order.append("read")

        reader = asyncio.create_task(read())
        await asyncio.sleep(0)                    # waiting on its socket
        core.begin()                              # the gate opens at once: an armed publish
        try:
            await asyncio.wait_for(reader, 2.0)
            await asyncio.sleep(0.05)
        finally:
            core.end()
            ours.close()
            theirs.close()

    event_loop.run(main(), loop)
    assert order[:3] == ["decided", "read", "hand-over"]
