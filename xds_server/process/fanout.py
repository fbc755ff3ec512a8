"""Bookkeeping of a push stream's subscribers, pure (no I/O; the caller passes the time, s).

The admin's ``/live`` feed (:mod:`xds_server.admin.live`) and the routing feed
(:mod:`xds_server.feed.service`) hand every subscriber the same items through a
:class:`FanOut`, which bounds what a subscriber may cost:

- at most ``max_subscribers`` open at once: :meth:`FanOut.join` past it returns None (the
  caller refuses the client: 503, RESOURCE_EXHAUSTED) and counts it;
- at most ``queue_max`` items queued per subscriber: one that falls further behind is closed
  (reason ``slow``; its queue is emptied at once);
- a write may be pending at most ``send_timeout_s``: :meth:`FanOut.overdue` lists the subscribers
  whose write began longer ago (the caller closes their socket or stream, reason ``deadline``).

A subscriber is *open* (in :attr:`FanOut.subs`) until :meth:`FanOut.close` (the feed gave up
on it: reason ``slow``, ``deadline``, ``shutdown``) or :meth:`FanOut.leave` (the client went or
the stream ended). A closed subscriber holds no items. One closed with ``pending=True`` (its
transport still holds the write it could not finish, as a gRPC stream does until its connection
ends) keeps its place under the cap (:attr:`FanOut.closing`) until :meth:`FanOut.release`.
Memory is therefore bounded by ``max_subscribers x (queue_max items + one write)``.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Generic, TypeVar

__all__ = ["CLOSE_REASONS", "FanOut", "Subscriber"]

T = TypeVar("T")

#: Why the feed closed a subscriber (``dropped`` counter label).
CLOSE_REASONS = ("slow", "deadline", "shutdown")


class Subscriber(Generic[T]):
    """One subscriber: its queued items, whether a write is pending (since when, s), and, once
    closed, why (``closed``: None while open)."""

    __slots__ = ("closed", "pending", "queue", "sending_since", "sid")

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.queue: deque[T] = deque()
        self.sending_since: float | None = None
        self.closed: str | None = None
        self.pending = False


class FanOut(Generic[T]):
    """Subscribers of one stream, bounded (see the module docstring). Counters:
    ``joined_total``, ``refused_total`` (over the cap), ``dropped`` (closed by the feed, by
    reason), ``left_total``."""

    def __init__(self, max_subscribers: int, queue_max: int, send_timeout_s: float) -> None:
        if max_subscribers < 1 or queue_max < 1 or not send_timeout_s > 0:
            raise ValueError("max_subscribers and queue_max must be >= 1 and send_timeout_s > 0")
        self.max_subscribers = max_subscribers
        self.queue_max = queue_max
        self.send_timeout_s = send_timeout_s
        self.subs: dict[int, Subscriber[T]] = {}
        self._next = 1
        self.joined_total = 0
        self.refused_total = 0
        self.left_total = 0
        self.closing = 0
        self.dropped: Counter[str] = Counter()

    def join(self) -> Subscriber[T] | None:
        """A new open subscriber, or None when ``max_subscribers`` are open (counted)."""
        if len(self.subs) + self.closing >= self.max_subscribers:
            self.refused_total += 1
            return None
        sub: Subscriber[T] = Subscriber(self._next)
        self._next += 1
        self.subs[sub.sid] = sub
        self.joined_total += 1
        return sub

    def publish(self, items: list[T], only: set[int] | None = None) -> list[Subscriber[T]]:
        """Queue ``items`` for every open subscriber (or those whose id is in ``only``); returns
        those closed because their queue would exceed ``queue_max`` (reason ``slow``)."""
        closed = []
        for sub in list(self.subs.values()):
            if only is not None and sub.sid not in only:
                continue
            if len(sub.queue) + len(items) > self.queue_max:
                self.close(sub, "slow")
                closed.append(sub)
            else:
                sub.queue.extend(items)
        return closed

    def take(self, sub: Subscriber[T], now: float) -> list[T]:
        """Everything queued for ``sub`` (emptied), the write of which begins at ``now``; empty
        (and no write begun) when nothing is queued or ``sub`` is closed."""
        if sub.closed is not None or not sub.queue:
            return []
        items = list(sub.queue)
        sub.queue.clear()
        sub.sending_since = now
        return items

    def begin(self, sub: Subscriber[T], now: float) -> None:
        """A write outside the queue (a first snapshot, a ping) begins at ``now``."""
        if sub.closed is None:
            sub.sending_since = now

    def sent(self, sub: Subscriber[T]) -> None:
        """``sub``'s pending write completed."""
        sub.sending_since = None

    def overdue(self, now: float) -> list[Subscriber[T]]:
        """Open subscribers whose write has been pending longer than ``send_timeout_s`` at
        ``now`` (the caller closes them: :meth:`close` with ``deadline``)."""
        limit = now - self.send_timeout_s
        return [s for s in self.subs.values() if s.sending_since is not None and s.sending_since < limit]

    def close(self, sub: Subscriber[T], reason: str, pending: bool = False) -> bool:
        """The feed gives up on ``sub`` (``reason``: one of :data:`CLOSE_REASONS`): it is no
        longer open and holds nothing; with ``pending`` it keeps its place under the cap until
        :meth:`release`. False when it was not open."""
        if self.subs.pop(sub.sid, None) is None:
            return False
        sub.closed = reason
        sub.queue.clear()
        sub.sending_since = None
        self.dropped[reason] += 1
        if pending:
            sub.pending = True
            self.closing += 1
        return True

    def release(self, sub: Subscriber[T]) -> None:
        """The transport of ``sub`` (closed with ``pending``) let its last write go."""
        if sub.pending:
            sub.pending = False
            self.closing -= 1

    def leave(self, sub: Subscriber[T]) -> None:
        """The client went (or its stream ended): ``sub`` is no longer open."""
        if self.subs.pop(sub.sid, None) is not None:
            self.left_total += 1
            sub.closed = sub.closed or "left"
            sub.queue.clear()
            sub.sending_since = None

    def queued(self) -> int:
        """Items queued over all open subscribers."""
        return sum(len(s.queue) for s in self.subs.values())
