"""Capacity of the simulated engine: at most ``max_num_seqs`` requests decode at once (vLLM's
``--max-num-seqs``), the rest wait in arrival order. Pure: no I/O, no event loop.

:class:`Admission` holds the batch's bookkeeping by ticket (an int per request, given by the
caller): :meth:`~Admission.arrive` says whether a new request runs at once or waits;
:meth:`~Admission.finish` frees one running slot and returns the tickets admitted by it, oldest
first; :meth:`~Admission.withdraw` takes a waiting request out (its client went away). The engine
(:mod:`node_probe.sim.engine`) maps tickets to the futures its handlers wait on.

A limit of 0 means unlimited (every request runs at once, nothing waits): the simulator as it
was before the capacity model, and its default.

Invariants (tests/unit/test_sim_capacity.py, hypothesis): ``running <= limit`` when limited;
nothing waits while a slot is free (work conserving); tickets run in arrival order.
"""
from __future__ import annotations

from collections import deque

__all__ = ["Admission"]


class Admission:
    """FIFO admission of requests into a batch of at most ``limit`` (0: unlimited).

    Attributes:
        limit: most requests decoding at once (int >= 0; 0 = unlimited).
        running: requests holding a slot now.

    Raises:
        ValueError: ``limit`` is not an integer >= 0.
    """

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError("max_num_seqs must be an integer >= 0")
        self.limit = limit
        self.running = 0
        self._queue: deque[int] = deque()
        self._queued: set[int] = set()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queue)

    def queued(self) -> list[int]:
        """Waiting tickets, oldest first."""
        return list(self._queue)

    def _free(self) -> bool:
        return self.limit == 0 or self.running < self.limit

    def arrive(self, ticket: int) -> bool:
        """A request arrives: True when it runs at once (a slot is taken), False when it waits.

        Raises:
            ValueError: ``ticket`` is already waiting.
        """
        if ticket in self._queued:
            raise ValueError(f"ticket {ticket} is already waiting")
        if self._free() and not self._queue:
            self.running += 1
            return True
        self._queue.append(ticket)
        self._queued.add(ticket)
        return False

    def finish(self) -> list[int]:
        """One running request ended (its slot is freed): the tickets admitted now, oldest first.

        Raises:
            ValueError: nothing is running.
        """
        if self.running <= 0:
            raise ValueError("finish with nothing running")
        self.running -= 1
        admitted: list[int] = []
        while self._queue and self._free():
            t = self._queue.popleft()
            self._queued.discard(t)
            self.running += 1
            admitted.append(t)
        return admitted

    def withdraw(self, ticket: int) -> bool:
        """Take a waiting request out of the queue; False when it is not waiting (it was
        admitted already, or never queued)."""
        if ticket not in self._queued:
            return False
        self._queued.discard(ticket)
        self._queue.remove(ticket)
        return True
