"""When the control core's publishes run: the one the planner armed, the warm-up gate's timeout,
and a long decision's hand-over, a moment after the decision.

At 2,000 endpoints a full publish holds the loop ~18 ms on an idle core and 30-100 ms on a loaded
one: the decision (the policy walk over every node) about 60 %, the hand-over (assignment, cache,
relay feed) the rest (benchmarks/RESULTS.md). A lost stream's read that arrived meanwhile waited
for both before its coroutine ran (and its drop's confirmation began). When an armed publish's
full decision alone took longer than ``xds.publish.coalesce_window``,
:meth:`ControlCore.publish <xds_server.control.core.ControlCore.publish>` parks it here and a timer
hands it over :data:`HAND_OVER_AFTER_S` later. The loop meanwhile takes the I/O that arrived
during the decision and runs the coroutine steps it wakes (each a loop turn of its own, a few
microseconds when the loop is idle: a timer due at once would run before them; uvloop rounds a
timer under 0.5 ms to "at once" too). A patch (the urgent lane) is never parked. What runs
meanwhile may mark a cluster dirty and arm a publish; every publish starts with :meth:`settle`,
which hands a parked decision over first, so Envoy never gets a decision after a newer one.

Shape::

    turns = PublishTurns(clock, publish, finish, open_gates)  # publish(): the armed one; finish(out, decided_s)
    turns.arm(at_s)                    # the armed publish at at_s (replaces one armed before)
    turns.open_gates_at(at_s)          # open_gates() at at_s: xds.publish.warmup_timeout (replaces one before)
    turns.settle()                     # at a publish's start: parked decision handed over, armed one cancelled
    turns.park(out, decided_s)         # finish(out, decided_s) HAND_OVER_AFTER_S later
    turns.parked                       # a decision waits for its hand-over
    turns.end()                        # parked decision handed over, no timer left
"""
from __future__ import annotations

from collections.abc import Callable

from xds_server.control.publish import ClusterPublish
from xds_server.process.clock import Clock, Timer

__all__ = ["HAND_OVER_AFTER_S", "PublishTurns"]

HAND_OVER_AFTER_S = 0.001
"""How long after its decision a parked hand-over runs (s). Ours: the least a timer of uvloop waits
(it rounds to ms), and far more than the few loop turns a read's coroutine takes to run once its
I/O is in; far less than the 15 ms ``probe.dial_in.drop_confirm`` that read then starts."""


class PublishTurns:
    """The armed publish's timer, the warm-up gate's, and at most one parked decision with its own
    (module docstring)."""

    def __init__(self, clock: Clock, publish: Callable[[], object],
                 finish: Callable[[list[ClusterPublish], float], None], open_gates: Callable[[], None]) -> None:
        self._clock, self._publish, self._finish, self._open_gates = clock, publish, finish, open_gates
        self._armed: Timer | None = None
        self._gates: Timer | None = None
        self._parked: tuple[list[ClusterPublish], float] | None = None
        self._parked_timer: Timer | None = None

    @property
    def parked(self) -> bool:
        """A decision waits for its hand-over."""
        return self._parked is not None

    def arm(self, at_s: float) -> None:
        """Run the armed publish at ``at_s`` (the clock's s), in place of one armed before."""
        if self._armed is not None:
            self._armed.cancel()
        self._armed = self._clock.call_at(at_s, self._publish)

    def open_gates_at(self, at_s: float) -> None:
        """Open the warm-up gates at ``at_s`` (the clock's s), in place of a time set before."""
        if self._gates is not None:
            self._gates.cancel()
        self._gates = self._clock.call_at(at_s, self._gates_open)

    def _gates_open(self) -> None:
        self._gates = None
        self._open_gates()

    def settle(self) -> None:
        """A publish starts: an armed publish is cancelled, a parked decision handed over now."""
        if self._armed is not None:
            self._armed.cancel()
            self._armed = None
        self.flush()

    def park(self, out: list[ClusterPublish], decided_s: float) -> None:
        """Hand ``out`` (decided in ``decided_s`` s of the clock) over :data:`HAND_OVER_AFTER_S`
        from now; a decision parked before is handed over first."""
        self.flush()
        self._parked = (out, decided_s)
        self._parked_timer = self._clock.call_at(self._clock.now() + HAND_OVER_AFTER_S, self.flush)

    def flush(self) -> None:
        """Hand the parked decision over now (nothing when none is parked)."""
        if self._parked_timer is not None:
            self._parked_timer.cancel()
            self._parked_timer = None
        parked, self._parked = self._parked, None
        if parked is not None:
            self._finish(*parked)

    def end(self) -> None:
        """The core stops: a parked decision is handed over, no timer stays armed."""
        self.settle()
        if self._gates is not None:
            self._gates.cancel()
            self._gates = None
