"""Admission by free slots: while a cluster is overloaded, Envoy admits a request only when the
routable nodes have a slot for it (or a place in the short queue their wait budget drains), and
answers the rest at once. Pure.

A random drop (``drop_overloads``) sheds a share of arrivals whatever the nodes are doing at
that moment. Poisson arrivals then either wait in the queues (TTFT grows) or the drop is set high
enough that they rarely do, which sheds far more than the excess (benchmarks/RESULTS.md,
"Against the bare excess": 18-37 points over). Admitting by concurrency gives each arrival a
slot if one is free at its own moment. With ``c`` slots it sheds what an Erlang loss system
sheds, close to the bare excess from 130 % of capacity on. Admitted requests never queue past
the budget.

Envoy enforces it with its circuit breaker. The published Cluster carries ``max_requests`` =
each Envoy's share of the admission total; an arrival over it gets a local reply with flag UO,
mapped to 429 + Retry-After like the drop's. The total is:

- the routable nodes' slots (each the most requests seen running: exact once a request waited
  while the node was full, which is about when shedding starts, but a node not quite full at
  that moment reads low);
- plus, for ``explore_s`` (4 s) after the cap came or the slots last grew, one spare place per
  node, so a node read low can show one more running request and its slots grow (measured at
  110 %: 29 of 32 slots read when the cap came). Then no spare: a spare place is a request
  queued at a full node, and equal-length requests complete in bursts (TTFT p99 2.2-3.4x with
  it kept);
- plus a queue allowance: the requests the nodes finish within a wait budget,
  ``floor(budget x sum(slots_i / service_i))`` (``lrs.shed.admission.queue_budget_ratio`` of the
  queue-wait budget; 0 by default: on engines whose requests all run as long, completions come
  in bursts, and 4 queued requests over 32 slots took the admitted TTFT p99 to 4.6x).

:func:`admission_step` is called once per load report (``now_s`` monotonic s). Its transitions
are the table :data:`TRANSITIONS`, keyed (admitting now?, what the inputs say):

- ``unknown``: a routable node's slots or running count is unknown, or no node is routable.
- ``overload``: the drop controller judged the cluster overloaded (it sheds).
- ``busy``: running at or above ``release_below`` of the slots.
- ``quiet``: below that mark, for less than ``release_after``.
- ``quiet_long``: below it for ``release_after`` or more.

The mark is a ratio because a slot cap hides the queues that started it: while admitting, only
the nodes' occupancy says whether demand still fills them. While admitting, the limit changes
with the number of Envoys, the slots, or a queue allowance that moved by :data:`_KEEP_WITHIN` or
more.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["TRANSITIONS", "Admission", "admission_step"]

Event = Literal["unknown", "overload", "busy", "quiet", "quiet_long"]

TRANSITIONS: dict[tuple[bool, Event], bool] = {
    (False, "unknown"): False,
    (False, "overload"): True,
    (False, "busy"): False,
    (False, "quiet"): False,
    (False, "quiet_long"): False,
    (True, "unknown"): False,     # a node's slots unknown: back to the drop, which needs none
    (True, "overload"): True,
    (True, "busy"): True,
    (True, "quiet"): True,        # hysteresis: one quiet report is not the end of an overload
    (True, "quiet_long"): False,  # demand no longer fills the slots: the cap is lifted
}
"""(admitting now, event) -> admitting next."""

_KEEP_WITHIN = 0.1
"""While admitting with the same slots, a queue allowance within this share of the published
total keeps the published limit (ours): Envoy replaces a Cluster whose circuit breakers change,
with fresh counts, so each change lets in up to a full set of slots again (docs/xds_protocol.md
section 6); the service-time estimate moves the allowance a little at every report. A change of
the slots always republishes."""


@dataclass(frozen=True, slots=True)
class Admission:
    """``limit``: ``max_requests`` for each Envoy (None: not admitting by slots); ``total``: the
    admission total over all Envoys, of which ``slots`` are the routable nodes' slots and
    ``queue`` the requests their budget drains; ``envoys``: the Envoys it is shared by;
    ``low_since_s``: since when occupancy is under the release mark (s); ``reason``: why, for
    the views; ``grown_s``: when the slots last grew or the cap came (s), and ``spare`` the
    places over the slots admitted until ``explore_s`` after it."""

    limit: int | None = None
    total: int = 0
    slots: int = 0
    queue: int = 0
    envoys: int = 1
    low_since_s: float | None = None
    reason: str = ""
    grown_s: float | None = None  # when the slots last grew (or the cap came), s
    spare: int = 0  # places over the slots while they may still grow (one a node)


def admission_step(state: Admission, *, overloaded: bool, slots: Sequence[float | None],
                   running: Sequence[float | None], service_s: Sequence[float | None],
                   budget_s: float | None, envoys: int, release_below: float, release_after_s: float,
                   now_s: float, explore_s: float = 4.0) -> Admission:
    """The admission after one report: ``overloaded``, the drop controller sheds now;
    per routable node its ``slots``, ``running`` requests and ``service_s``, the time a request
    runs (s; None: unknown); ``budget_s``: the wait the queue allowance may cost (s; None or 0:
    no queue allowed);
    ``envoys``: Envoys reporting load (at least 1 counted); ``release_below`` (0..1) and
    ``release_after_s``: the occupancy mark and how long under it lifts the cap; ``explore_s``:
    how long after the cap came or the slots last grew one place a node is admitted over them."""
    on = state.limit is not None
    known = bool(slots) and all(s is not None and s > 0 for s in slots) and all(r is not None for r in running)
    if not known:
        event: Event = "unknown"
        low_since = None
    else:
        total_slots = sum(s for s in slots if s is not None)
        occupancy = sum(r for r in running if r is not None) / total_slots
        low_since = None if occupancy >= release_below else (state.low_since_s if state.low_since_s is not None
                                                              else now_s)
        if overloaded and not on:
            event = "overload"
        elif low_since is None:
            event = "busy"
        else:
            event = "quiet_long" if now_s - low_since >= release_after_s else "quiet"
    if not TRANSITIONS[(on, event)]:
        why = {"unknown": "a routable node's slots are unknown", "quiet_long":
               f"occupancy under {release_below:.0%} of the slots for {release_after_s:g} s"}.get(event, "")
        return Admission(reason=f"not admitting by slots: {why}" if on and why else "")
    n_slots = math.ceil(sum(s for s in slots if s is not None))
    rates = [s / t for s, t in zip(slots, service_s, strict=True) if s is not None and t is not None and t > 0]
    drains = budget_s is not None and len(rates) == len(slots)
    queue = math.floor(budget_s * sum(rates)) if drains and budget_s is not None else 0
    grown = now_s if not on or state.grown_s is None or n_slots > state.slots else state.grown_s
    spare = len(slots) if now_s - grown < explore_s else 0  # slots read low can show more meanwhile
    total = n_slots + spare + queue
    n = max(1, envoys)
    if on and n == state.envoys and n_slots == state.slots and spare == state.spare and abs(
            total - state.total) < max(1.0, _KEEP_WITHIN * state.total):
        return Admission(state.limit, state.total, state.slots, state.queue, n, low_since, state.reason,
                         grown, spare)
    limit = max(1, math.ceil(total / n))
    reason = (f"admitting by slots: {n_slots} slots + {spare} spare + {queue} queued within the budget "
              f"= {total}, {limit} per Envoy ({n})")
    return Admission(limit, total, n_slots, queue, n, low_since, reason, grown, spare)
