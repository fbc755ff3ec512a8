"""When the control core's publishes run: the one the planner armed, the warm-up gate's timeout,
and a long decision's hand-over, a few loop turns after the decision.

At 2,000 endpoints a full publish holds the loop ~18 ms on an idle core and 30-100 ms on a loaded
one: the decision (the policy walk over every node) about 60 %, the hand-over (assignment, cache,
relay feed) the rest (benchmarks/RESULTS.md). A lost stream's read that arrived meanwhile waited
for both before its coroutine ran (and its drop's confirmation began). When an armed publish's
full decision alone took longer than ``xds.publish.coalesce_window``,
:meth:`ControlCore.publish <xds_server.control.core.ControlCore.publish>` parks it here, and its
hand-over runs :data:`HAND_OVER_HOPS` loop turns later: each hop a timer due at once that arms the
next. The I/O that arrived during the decision is taken in the first of those turns, and the
coroutines it wakes run before the last hop (asyncio: a turn's I/O callbacks, then its due
timers, and their wake-ups in the next turn; uvloop turns a timer due at once into a call_soon,
run before the turn's I/O poll, so it needs one hop more). No wait on the clock: a delay of 1 ms
was overtaken on a loaded machine (the timer was due before the I/O was polled). A patch (the
urgent lane) is never parked. What runs meanwhile may mark a cluster dirty and arm a publish;
every publish starts with :meth:`settle`, which hands a parked decision over first, so Envoy never
gets a decision after a newer one.

Shape::

    turns = PublishTurns(clock, publish, finish, open_gates)  # publish(): the armed one; finish(out, decided_s)
    turns.arm(at_s)                    # the armed publish at at_s (replaces one armed before)
    turns.open_gates_at(at_s)          # open_gates() at at_s: xds.publish.warmup_timeout (replaces one before)
    turns.settle()                     # at a publish's start: parked decision handed over, armed one cancelled
    turns.park(out, decided_s)         # finish(out, decided_s) HAND_OVER_HOPS loop turns later
    turns.parked                       # a decision waits for its hand-over
    turns.end()                        # parked decision handed over, no timer left
"""
from __future__ import annotations

from collections.abc import Callable

from xds_server.control.publish import ClusterPublish
from xds_server.process.clock import Clock, Timer

__all__ = ["HAND_OVER_HOPS", "PublishTurns"]

HAND_OVER_HOPS = 3
"""Loop turns between a parked decision and its hand-over: the I/O that arrived during the decision
is taken, and the coroutines it woke run, on asyncio's loop and uvloop's (module docstring; tested
on both: tests/unit/test_decision_next_turn.py). Each turn costs what the loop had queued."""


def _cancel(timer: Timer | None) -> None:
    """Cancel ``timer`` if there is one."""
    if timer is not None:
        timer.cancel()


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
        _cancel(self._armed)
        self._armed = self._clock.call_at(at_s, self._publish)

    def open_gates_at(self, at_s: float) -> None:
        """Open the warm-up gates at ``at_s`` (the clock's s), in place of a time set before."""
        _cancel(self._gates)
        self._gates = self._clock.call_at(at_s, self._gates_open)

    def _gates_open(self) -> None:
        self._gates = None
        self._open_gates()

    def settle(self) -> None:
        """A publish starts: an armed publish is cancelled, a parked decision handed over now."""
        _cancel(self._armed)
        self._armed = None
        self.flush()

    def park(self, out: list[ClusterPublish], decided_s: float) -> None:
        """Hand ``out`` (decided in ``decided_s`` s of the clock) over :data:`HAND_OVER_HOPS` loop
        turns from now; a decision parked before is handed over first."""
        self.flush()
        self._parked = (out, decided_s)
        self._hop(HAND_OVER_HOPS)

    def _hop(self, left: int) -> None:
        """One loop turn more towards the hand-over: ``left`` hops to go (0: hand it over)."""
        if left == 0:
            self._parked_timer = None
            self.flush()
        else:
            self._parked_timer = self._clock.call_at(self._clock.now(), self._hop, left - 1)

    def flush(self) -> None:
        """Hand the parked decision over now (nothing when none is parked)."""
        _cancel(self._parked_timer)
        self._parked_timer = None
        parked, self._parked = self._parked, None
        if parked is not None:
            self._finish(*parked)

    def end(self) -> None:
        """The core stops: a parked decision is handed over, no timer stays armed."""
        self.settle()
        _cancel(self._gates)
        self._gates = None
