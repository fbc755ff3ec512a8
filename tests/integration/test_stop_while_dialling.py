"""Stopping what redials a gRPC peer that cannot be reached ends it, whenever the stop comes.

A cancel that lands while grpc.aio is starting a call that has already failed is swallowed
there, and the call ends with UNAVAILABLE instead (:mod:`xds_server.process.cancellation`). A
probe session dialling a dead agent again and again then dialled on after its stop, and the
control plane's stop waited for it for ever (seen twice in CI as a 300 s test timeout). Each
loop of ours that redials a gRPC peer (the control plane's agent sessions, its LRS peer links,
the relay's routing feed) is started here against a port where nothing listens, with no
back-off to speak of, and stopped at a random moment, again and again.

On the code before, the agent sessions' row failed in each of 7 runs (a session dialled on,
~1,000 failed dials in the 5 s after its stop). The other two rows passed there: their calls (a
unary-stream call; a stream-stream call written to first) did not swallow a cancel in 300 tries
each on grpcio 1.85.4. They keep the same check, so that a stop ends them whatever grpc.aio does.
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import pytest

from sentinel_relay.feed import FeedClient
from xds_server.config import parse_config
from xds_server.load.peers import PeerLink
from xds_server.probing.session import ProbeSession
from xds_server.process.cancellation import cancel_and_wait
from xds_server.testing import free_port

_LOOPS = 10
_STOPS = 40  # per loop

#: what is started and stopped: (start, stop, failed dials so far)
Loop = tuple[Callable[[], None], Callable[[], Awaitable[None]], Callable[[], int]]


def _sessions(dead: int) -> list[Loop]:
    cfg = parse_config({
        "health": {"reconnect_backoff_initial_ms": 1, "reconnect_backoff_max_ms": 1},
        "probe": {"channel_initial_backoff_ms": 1},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{k}", "address": "127.0.0.1:8001", "probe_address": f"127.0.0.1:{dead}"}
            for k in range(_LOOPS)]}],
    })
    out: list[Loop] = []
    for node in cfg.clusters[0].nodes:
        s = ProbeSession(node, cfg.health, lambda *_: None, probe=cfg.probe)
        out.append((s.start, s.stop, lambda s=s: s.failed_dials))
    return out


def _feeds(dead: int) -> list[Loop]:
    out: list[Loop] = []
    for _ in range(_LOOPS):
        dials = [0]  # the feed says "not connected" after each failed dial
        f = FeedClient(f"127.0.0.1:{dead}", lambda *_: None, reconnect_max_s=0.001,
                       on_connected=lambda up, d=dials: d.__setitem__(0, d[0] + (not up)))
        out.append((f.start, f.stop, lambda d=dials: d[0]))
    return out


def _peer_links(dead: int) -> list[Loop]:
    out: list[Loop] = []
    for _ in range(_LOOPS):
        link = PeerLink(f"127.0.0.1:{dead}", "replica-a", queue_max=8, backoff_max_s=0.001)
        task: list[asyncio.Task[None]] = []

        def start(link: PeerLink = link, task: list[asyncio.Task[None]] = task) -> None:
            task[:] = [asyncio.ensure_future(link.run())]

        async def stop(task: list[asyncio.Task[None]] = task) -> None:
            await cancel_and_wait(task[0])

        def failed(link: PeerLink = link) -> int:
            return int(bool(link.last_error))  # the link keeps only its last error: at least one seen

        out.append((start, stop, failed))
    return out


async def _end_redial_tasks() -> None:
    """Cancel the redial loops left running (each ignored a cancel) until they end, so that
    nothing runs on past a failed test."""
    for _ in range(50):
        left = [t for t in asyncio.all_tasks() if not t.done()
                and getattr(t.get_coro(), "__qualname__", "") in _REDIAL_LOOPS]
        if not left:
            return
        for t in left:
            t.cancel()
        await asyncio.wait(left, timeout=0.2)


_REDIAL_LOOPS = {"ProbeSession._run", "FeedClient._run", "PeerLink.run"}


@pytest.mark.parametrize("loops", [_sessions, _feeds, _peer_links], ids=["agent session", "routing feed", "LRS peer"])
async def test_a_loop_redialling_a_dead_peer_ends_at_every_stop(loops: Callable[[int], list[Loop]]):
    dead = free_port()  # nothing listens here
    hung: list[str] = []

    async def start_and_stop(k: int, loop: Loop, rng: random.Random) -> None:
        start, stop_, failed = loop
        for i in range(_STOPS):
            start()
            await asyncio.sleep(rng.uniform(0.0, 0.02))
            stop = asyncio.ensure_future(stop_())
            done, _ = await asyncio.wait({stop}, timeout=5.0)
            if not done:
                hung.append(f"loop {k}, stop {i}: still dialling 5 s later ({failed()} failed dials)")
                await _end_redial_tasks()
                stop.cancel()
                return

    all_loops = loops(dead)
    await asyncio.gather(*(start_and_stop(k, lp, random.Random(k)) for k, lp in enumerate(all_loops)))
    assert not hung, hung
    assert all(failed() >= 1 for _, _, failed in all_loops), "a loop never dialled"
