"""Our own event-loop stalls, and the hold they put on verdicts about a node's silence. Pure:
times are arguments (the event loop's monotonic clock, s); nothing here reads a clock.

A *stall* is a stretch in which our event loop ran nothing else: a SIGSTOP, a VM pause, a long GC,
a starved CPU. A burst of agent streams dropped or silent at once, judged ours
(:mod:`~xds_server.probing.drop_burst`), is noted as one too (:func:`noted`): a process starved
while its loop kept running shows no late sampler run.

A sampler (:class:`~xds_server.probing.silence.LoopStallWatch`) runs every ``period_s``; when it
runs ``gap_s`` later than due, the loop stalled that long and woke at that run. During our stall
the agents kept sending: their heartbeats wait unread in our sockets, and a stream cut meanwhile
(a keepalive that we could not answer) is found cut only when we wake, to be redialled. So a
node's silence across our own stall is no evidence about the node: after a stall at least
``stall_s`` long (one heartbeat miss window: ``health.heartbeat.interval`` +
``heartbeat.grace``), a verdict on a node's silence (a Tick counting misses, a closed or
silent stream) is held until the node's first heartbeat after we woke, or for as long as the
stall lasted, at most ``hold_s`` (``probe.stalls.stall_hold``), whichever comes first. A node that
really died during our stall is ejected then, at most that late; a short stall (a loaded host)
delays a verdict only by its own length.

:class:`StallHistory` keeps the stalls that can still decide a hold: in waking order with
strictly decreasing gaps (a later stall at least as long as an earlier one holds every node the
earlier one holds, and longer), those older than ``keep_s`` dropped. A stall shorter than
``min_gap_s`` is not recorded, but one we are waking from right now (the sampler, due long ago,
has not run yet) is seen from the sampler's last run.

Shape::

    h = StallHistory(alive_s=now_s)
    h = ran(h, now_s, period_s=0.05, min_gap_s=0.05, keep_s=60.0)   # each sampler run
    h = noted(h, now_s, gap_s=1.0, keep_s=60.0)     # a burst of drops or silences: ours too
    held_until(h, now_s, period_s=0.05, stall_s=0.18, hold_s=1.0, heard_s=last_hb_s)  # s or None
    stalled_between(h, sent_s, now_s, period_s=0.05)   # a ping's RTT spans our own stall: drop it
    late_between(runs, overdue_s(h, now_s, 0.05), sent_s, now_s, period_s=0.05, min_late_s=0.02)  # ... or our queue
    unscheduled_s(late_s=0.3, cpu_s=0.29)    # 0.01: a 300 ms collection was our work, not a stop

A ping's round trip measured across our own stall measures the stall, not the network: a pong
that waited unread while we were stopped for 5 s read as a 5,000 ms RTT, which lifted a healthy
node's EWMA RTT to ~1 s and had it ejected as an RTT outlier. :func:`stalled_between` says which
round trips to drop. A loop that runs every callback late without ever stopping (a queue of work:
2,000 agents dialling in at once, 1 s RTT pings on two busy cores) adds its lateness to every round
trip it reads, unevenly: at 2,000 nodes the median round trip read 11-30 ms and healthy nodes at
65-90 ms were outlier-ejected. :func:`late_between` says which round trips waited on that queue,
from the sampler's late runs (``runs``: (woke_s, late_s), oldest first).

A PING is answered, and its answer read, in gRPC's own threads, not on our loop. Whether a dropped
agent stream was cut by a stall of ours (:mod:`~xds_server.probing.dial_in`) asks only how long
our loop's thread did not run at all (:func:`unscheduled_s`: a run's lateness less the CPU the
thread used meanwhile). A stopped or starved process misses its PINGs' answers; a loop busy with
its own work (a collection, the 45 ms publish of 2,000 endpoints) does not, and a drop during it is
the node's.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Stall", "StallHistory", "held_until", "late_between", "noted", "overdue_s", "ran", "stalled_between",
           "stalls_at", "unscheduled_s"]


@dataclass(frozen=True, slots=True)
class Stall:
    """One stall of our event loop: it ran again at ``woke_s`` after running nothing for
    ``gap_s`` beyond its sampling period (s)."""

    woke_s: float
    gap_s: float


@dataclass(frozen=True, slots=True)
class StallHistory:
    """The sampler's last run (``alive_s``, s), the stalls that matter (``stalls``: waking order,
    gaps strictly decreasing) and how many stalls were recorded in all (``count``)."""

    alive_s: float
    stalls: tuple[Stall, ...] = ()
    count: int = 0


def ran(h: StallHistory, now_s: float, period_s: float, min_gap_s: float, keep_s: float) -> StallHistory:
    """The sampler ran at ``now_s``, due ``period_s`` after its last run: record a stall when it
    ran at least ``min_gap_s`` late; drop stalls that woke more than ``keep_s`` ago. A clock that
    reads earlier than ``alive_s`` (never, for a monotonic one) records nothing."""
    gap = now_s - h.alive_s - period_s
    kept = tuple(s for s in h.stalls if s.woke_s >= now_s - keep_s)
    if gap >= min_gap_s:
        kept = tuple(s for s in kept if s.gap_s > gap) + (Stall(now_s, gap),)
        return StallHistory(now_s, kept, h.count + 1)
    return StallHistory(max(h.alive_s, now_s), kept, h.count)


def noted(h: StallHistory, now_s: float, gap_s: float, keep_s: float) -> StallHistory:
    """``h`` with a stall of ours that the sampler cannot see recorded at ``now_s`` as ``gap_s``
    long: a burst of agent streams dropped or silent at once (our process starved while its loop
    kept running). Stalls that woke more than ``keep_s`` ago, or no longer than it, are dropped."""
    kept = tuple(s for s in h.stalls if s.woke_s >= now_s - keep_s and s.gap_s > gap_s)
    return StallHistory(h.alive_s, kept + (Stall(now_s, gap_s),), h.count + 1)


def stalls_at(h: StallHistory, now_s: float, period_s: float) -> tuple[Stall, ...]:
    """The recorded stalls, and the one we are waking from at ``now_s`` when the sampler is late
    (its run still pending: a stall not recorded yet)."""
    pending = now_s - h.alive_s - period_s
    return h.stalls + (Stall(now_s, pending),) if pending > 0 else h.stalls


def held_until(h: StallHistory, now_s: float, period_s: float, stall_s: float, hold_s: float,
               heard_s: float | None) -> float | None:
    """When a verdict on a node's silence may be made, if not at ``now_s``: the latest end of a
    hold still running, or None. Each stall at least ``stall_s`` long that the node was not
    heard after (``heard_s``: the arrival of its last heartbeat, None when none) holds it from
    waking for the stall's length, at most ``hold_s``."""
    end = None
    for s in stalls_at(h, now_s, period_s):
        if s.gap_s >= stall_s and (heard_s is None or heard_s < s.woke_s):
            at = s.woke_s + min(hold_s, s.gap_s)
            if at > now_s and (end is None or at > end):
                end = at
    return end


def stalled_between(h: StallHistory, since_s: float, now_s: float, period_s: float,
                    min_gap_s: float | None = None) -> bool:
    """Whether our loop stalled at least ``min_gap_s`` (default ``period_s``: the sampler's own
    period, what it records) between ``since_s`` and ``now_s`` (s): a stall that woke after
    ``since_s``, recorded or the one we are waking from at ``now_s``. The latest recorded stall is
    always kept (a later stall drops only the earlier ones no longer than it), so a stall in the
    span is never forgotten while it is younger than the history's ``keep_s``."""
    least = period_s if min_gap_s is None else min_gap_s
    return any(s.woke_s > since_s and s.gap_s >= least for s in stalls_at(h, now_s, period_s))


def overdue_s(h: StallHistory, now_s: float, period_s: float) -> float:
    """How late the sampler's next run is at ``now_s`` (s; negative: not due yet): the lateness of
    the stall we are waking from, before the sampler has run to record it."""
    return now_s - h.alive_s - period_s


def unscheduled_s(late_s: float, cpu_s: float) -> float:
    """Of a sampler run ``late_s`` late, how long our loop's thread surely did not run (s, >= 0):
    the lateness less all the CPU the thread used since the sampler's run before (``cpu_s``). A loop
    busy with our own work (a collection, a publish) used the CPU it was late by; a process
    stopped (SIGSTOP, a VM pause) or starved of CPU did not."""
    return max(0.0, late_s - cpu_s)


def late_between(runs: Sequence[tuple[float, float]], pending_s: float, since_s: float, now_s: float,
                 period_s: float, min_late_s: float) -> bool:
    """Whether our loop ran at least ``min_late_s`` late around a round trip from ``since_s`` to
    ``now_s`` (s): a sampler run (``runs``: (woke_s, late_s) of its late runs, oldest first) that
    woke within one ``period_s`` before the ping or after it, or the run due by ``now_s`` and still
    pending (``pending_s``: its lateness so far, :func:`overdue_s`). The sampler runs once a
    period, so a round trip shorter than that may have no run of its own; a queue of ours lasts
    longer than one callback, and the run before it shows it."""
    if pending_s >= min_late_s:
        return True
    for woke_s, late_s in reversed(runs):
        if woke_s <= since_s - period_s:
            return False
        if late_s >= min_late_s and woke_s - late_s < now_s:
            return True
    return False
