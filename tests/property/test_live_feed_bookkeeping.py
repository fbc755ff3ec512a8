"""The subscriber bookkeeping shared by the admin's ``/live`` feed and the routing feed
(:class:`xds_server.process.fanout.FanOut`), under arbitrary sequences of clients connecting,
reading, stalling (a write begun and never finished), leaving, and of items published and time
passing, with the feeds' own sweep (``overdue`` -> closed ``deadline``) after every step.

At every step: open + closing subscribers never exceed the cap, no queue exceeds ``queue_max``,
a closed subscriber holds nothing, and what is queued is bounded by the caps. At the end (time
past every deadline, each open client drains its queue): every client is closed (slow, deadline
or left) or current (it got every item published since it joined, in order, none twice).
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.process.fanout import FanOut, Subscriber

OPS = st.lists(st.one_of(
    st.tuples(st.just("connect")),
    st.tuples(st.just("publish"), st.integers(1, 5)),
    st.tuples(st.just("read"), st.integers(0, 30)),
    st.tuples(st.just("stall"), st.integers(0, 30)),
    st.tuples(st.just("leave"), st.integers(0, 30)),
    st.tuples(st.just("release"), st.integers(0, 30)),
    st.tuples(st.just("wait"), st.floats(0.0, 3.0)),
), max_size=120)


class Client:
    """The model of one client: what it received, whether its write hangs."""

    def __init__(self, sub: Subscriber[int], joined_at: int) -> None:
        self.sub = sub
        self.joined_at = joined_at  # the first item it must get
        self.got: list[int] = []
        self.stalled = False


@settings(max_examples=400, deadline=None)
@given(ops=OPS, cap=st.integers(1, 6), qmax=st.integers(1, 8), timeout_s=st.floats(0.1, 2.0),
       pending=st.booleans())
def test_every_client_ends_closed_or_current_and_memory_stays_within_the_caps(ops, cap, qmax, timeout_s, pending):
    book: FanOut[int] = FanOut(cap, qmax, timeout_s)
    clients: list[Client] = []
    refused = 0
    now = 0.0
    seq = 0   # items published so far (item k is the integer k)

    def pick(i: int) -> Client | None:
        return clients[i % len(clients)] if clients else None

    def sweep() -> None:
        for sub in book.overdue(now):
            book.close(sub, "deadline", pending=pending)

    for op in ops:
        kind = op[0]
        if kind == "connect":
            sub = book.join()
            if sub is None:
                refused += 1
                assert len(book.subs) + book.closing >= cap
            else:
                clients.append(Client(sub, seq))
        elif kind == "publish":
            items = list(range(seq, seq + op[1]))
            seq += op[1]
            for sub in book.publish(items):
                assert sub.closed == "slow" and not sub.queue
        elif kind in ("read", "stall"):
            c = pick(op[1])
            if c is not None and not c.stalled and c.sub.closed is None:
                taken = book.take(c.sub, now)
                if kind == "read":
                    c.got += taken
                    book.sent(c.sub)
                elif taken:   # a write begun that never finishes
                    c.stalled = True
        elif kind == "leave":
            c = pick(op[1])
            if c is not None:
                book.leave(c.sub)
        elif kind == "release":
            c = pick(op[1])
            if c is not None:
                book.release(c.sub)
        else:
            now += op[1]
        sweep()
        # bounded at every step
        assert len(book.subs) + book.closing <= cap
        assert all(len(s.queue) <= qmax for s in book.subs.values())
        assert book.queued() <= cap * qmax
        assert all(not c.sub.queue for c in clients if c.sub.closed is not None)
        assert all(c.sub.sid not in book.subs for c in clients if c.sub.closed is not None)
        assert book.closing == sum(1 for c in clients if c.sub.pending)
        assert book.joined_total == len(clients) and book.refused_total == refused

    # the end: past every deadline, every open client that still reads drains its queue
    now += timeout_s * 2 + 1.0
    sweep()
    for c in clients:
        if c.sub.closed is None:
            c.got += book.take(c.sub, now)
            book.sent(c.sub)
    for c in clients:
        if c.sub.closed is None:   # current: every item since it joined, in order, none twice
            assert not c.stalled
            assert c.got == list(range(c.joined_at, seq))
        else:
            assert c.sub.closed in ("slow", "deadline", "left")
            assert c.got == list(range(c.joined_at, c.joined_at + len(c.got)))  # a prefix, in order
    assert sum(book.dropped.values()) + book.left_total == sum(1 for c in clients if c.sub.closed)
