"""New agents' streams that wait for our loop to take them (a control plane (re)started under a
fleet dialling in at once takes a few dozen a second): gRPC holds them for
``probe.dial_in.accept_wait``, then cancels them. A real grpc.aio server with the agents' port's
options (``ProbeConfig.dial_in_options``), its loop held while streams arrive."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from xds_server.config.probe import ProbeConfig

STREAMS = 20
HOLD_S = 2.5
_METHOD = "/accept.Test/Stream"
_PINGS = {"keepalive": "60s", "ping_timeout": "20s"}
"""Out of the way: the dial-in PINGs (90 ms, answered within 60 ms) could cut a connection on a
loaded machine, which is not what these tests are about."""


async def _after_a_held_loop(options: list[tuple[str, int]]) -> tuple[int, list[grpc.StatusCode | None]]:
    """Open STREAMS streams while the server's loop is held HOLD_S, then let it run: how many our
    handler took, and how each client stream ended (None: still open when the client ended it)."""
    taken = [0]

    async def stream(requests: Any, _context: grpc.aio.ServicerContext) -> None:
        taken[0] += 1
        async for _ in requests:
            pass

    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "accept.Test", {"Stream": grpc.stream_stream_rpc_method_handler(stream)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    opened, end = threading.Event(), threading.Event()
    codes: list[grpc.StatusCode | None] = [None] * STREAMS

    def requests() -> Iterator[bytes]:
        yield b"register"
        end.wait(30)

    def read(k: int, call: Any) -> None:
        try:
            for _ in call:
                pass
            codes[k] = call.code()
        except grpc.RpcError as e:
            codes[k] = e.code() if not end.is_set() else None

    def dial() -> None:
        calls = [channel.stream_stream(_METHOD)(requests()) for _ in range(STREAMS)]
        opened.set()
        for k, call in enumerate(calls):
            threading.Thread(target=read, args=(k, call), daemon=True).start()

    try:
        threading.Thread(target=dial, daemon=True).start()
        assert opened.wait(10)
        time.sleep(HOLD_S)  # the loop is held: the streams wait in gRPC, untaken
        deadline = time.monotonic() + 10.0
        while taken[0] + sum(c is not None for c in codes) < STREAMS and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # a stream cancelled late would show now
        return taken[0], list(codes)
    finally:
        end.set()
        channel.close()
        await server.stop(None)


async def test_streams_that_arrive_while_our_loop_is_held_wait_and_are_all_taken_after() -> None:
    # (the default's 5 min, past gRPC's 30 s, is tests/unit/test_liveness_modes.py's)
    taken, codes = await _after_a_held_loop(ProbeConfig(dial_in=_PINGS).dial_in_options())
    assert taken == STREAMS
    assert codes == [None] * STREAMS


async def test_a_stream_not_taken_within_the_accept_wait_is_cancelled_and_the_agent_told() -> None:
    taken, codes = await _after_a_held_loop(ProbeConfig(dial_in={**_PINGS, "accept_wait": "1s"}).dial_in_options())
    # gRPC hands one stream to the request it had already asked for; the rest waited past 1 s
    assert taken <= 2
    cancelled = [c for c in codes if c is not None]
    assert len(cancelled) >= STREAMS - 2
    assert set(cancelled) == {grpc.StatusCode.CANCELLED}, cancelled
