"""What gRPC (grpcio as installed) really does with keepalive PINGs as liveness (issue 24).

Usage: python benchmarks/transport_liveness.py [--repeat R] [--keepalive-ms K ...] [--timeout-ms T]

Each case uses real processes on 127.0.0.1 (spawned interpreters, one Watch-shaped stream):

- ``freeze``: a server streaming one message per second is SIGSTOPped; how long until the client's
  stream fails, with which code and details (client: grpc.keepalive_time_ms K,
  grpc.keepalive_timeout_ms and grpc.http2.ping_timeout_ms T, permit_without_calls);
- ``no-ping-timeout``: the same without grpc.http2.ping_timeout_ms (10 s limit);
- ``kill``: the server SIGKILLed: the code and details of the failure, and how soon;
- ``old-server``: a server with an older agent's ping policy (min_ping_interval_without_data
  1000 ms) sending a message every 100 ms, then every 1 s: does a 100 ms keepalive client get
  GOAWAY too_many_pings (the stream failing) within 5 s;
- ``own-stall``: the *client* process SIGSTOPped for 1 s (our own stall) while its server runs:
  does its stream fail when it wakes, and how long after.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import signal
import statistics
import threading
import time

import grpc

from xds_server.testing import free_port

_METHOD = "/node_probe.v1.NodeProbe/Watch"


def _server_main(port: int, period_s: float, min_ping_ms: int, slow_after_s: float) -> None:
    async def handler(request_iterator, context):
        t0 = time.monotonic()
        while True:
            yield b"x"
            slow = slow_after_s and time.monotonic() - t0 > slow_after_s
            await asyncio.sleep(1.0 if slow else period_s)

    class H(grpc.GenericRpcHandler):
        def service(self, details):
            return grpc.stream_stream_rpc_method_handler(handler) if details.method == _METHOD else None

    async def run() -> None:
        srv = grpc.aio.server(handlers=[H()], options=[
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", min_ping_ms)])
        srv.add_insecure_port(f"127.0.0.1:{port}")
        await srv.start()
        await asyncio.Event().wait()

    asyncio.run(run())


def _options(keepalive_ms: int, timeout_ms: int, ping_timeout: bool) -> list[tuple[str, int]]:
    opts = [("grpc.keepalive_time_ms", keepalive_ms), ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
    return opts + [("grpc.http2.ping_timeout_ms", timeout_ms)] if ping_timeout else opts


async def _stream_until_failure(port: int, opts: list, limit_s: float, on_open=None) -> tuple[float | None, str]:
    """Open the stream, call ``on_open()`` after its first message, return (s from on_open to
    the failure or None within ``limit_s``, 'CODE: details')."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
        call = ch.stream_stream(_METHOD)(iter(()))
        it = call.__aiter__()
        await it.__anext__()
        t0 = time.monotonic()
        if on_open is not None:
            on_open()
        try:
            async with asyncio.timeout(limit_s):
                async for _ in it:
                    pass
            return time.monotonic() - t0, "EOF"
        except TimeoutError:
            return None, "open"
        except grpc.aio.AioRpcError as e:
            return time.monotonic() - t0, f"{e.code().name}: {e.details()}"


def _spawn(target, *args) -> multiprocessing.Process:
    p = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    p.start()
    return p


async def _with_server(period_s: float, min_ping_ms: int, fn, slow_after_s: float = 0.0):
    port = free_port()
    proc = _spawn(_server_main, port, period_s, min_ping_ms, slow_after_s)
    try:
        await asyncio.sleep(1.5)  # the spawned interpreter imports grpc and binds
        return await fn(port, proc)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.join(5)


def _client_main(port: int, opts: list, q) -> None:
    async def run() -> None:
        q.put(("open", time.time()))
        _, what = await _stream_until_failure(port, opts, 8.0, lambda: q.put(("ready", time.time())))
        q.put(("end", time.time(), what))
    asyncio.run(run())


async def case_own_stall(keepalive_ms: int, timeout_ms: int, stall_s: float = 1.0) -> str:
    async def fn(port: int, _srv) -> str:
        q = multiprocessing.get_context("spawn").Queue()
        cli = _spawn(_client_main, port, _options(keepalive_ms, timeout_ms, True), q)
        try:
            while q.get(timeout=30)[0] != "ready":
                pass
            await asyncio.sleep(1.0)
            os.kill(cli.pid, signal.SIGSTOP)
            await asyncio.sleep(stall_s)
            woke = time.time()
            os.kill(cli.pid, signal.SIGCONT)
            msg = await asyncio.to_thread(q.get, True, 15)
            return f"failed {1000 * (msg[1] - woke):.0f} ms after waking: {msg[2]}" if msg[0] == "end" else str(msg)
        finally:
            os.kill(cli.pid, signal.SIGCONT)
            cli.kill()
            cli.join(5)
    return await _with_server(1.0, 50, fn)


async def case_freeze(keepalive_ms: int, timeout_ms: int, ping_timeout: bool = True,
                      period_s: float = 1.0) -> tuple[float | None, str]:
    """The server SIGSTOPped at a random point 0.5-2 s after the stream's first message (a
    random phase against the client's ping timers); the time is from the SIGSTOP."""
    delay = random.uniform(0.5, 2.0)

    async def fn(port: int, srv) -> tuple[float | None, str]:
        timer = threading.Timer(delay, os.kill, (srv.pid, signal.SIGSTOP))
        took, what = await _stream_until_failure(port, _options(keepalive_ms, timeout_ms, ping_timeout), 10.0 + delay,
                                                 timer.start)
        return (None if took is None else took - delay), what
    return await _with_server(period_s, 50, fn)


async def case_kill(keepalive_ms: int, timeout_ms: int) -> tuple[float | None, str]:
    async def fn(port: int, srv) -> tuple[float | None, str]:
        return await _stream_until_failure(port, _options(keepalive_ms, timeout_ms, True), 10.0, srv.kill)
    return await _with_server(1.0, 50, fn)


async def case_old_server(keepalive_ms: int, timeout_ms: int, period_s: float) -> tuple[float | None, str]:
    async def fn(port: int, _srv) -> tuple[float | None, str]:
        return await _stream_until_failure(port, _options(keepalive_ms, timeout_ms, True), 5.0)
    return await _with_server(period_s, 1000, fn)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--keepalive-ms", type=int, nargs="+", default=[100, 50])
    ap.add_argument("--timeout-ms", type=int, default=100)
    a = ap.parse_args()
    print(f"grpcio {grpc.__version__}, load average {os.getloadavg()[0]:.2f}")
    for k, period in [(k, p) for k in a.keepalive_ms for p in (1.0, 0.1)]:
        runs = [await case_freeze(k, a.timeout_ms, period_s=period) for _ in range(a.repeat)]
        ms = sorted(1000 * t for t, _ in runs if t is not None)
        print(f"freeze, keepalive {k} ms, ping timeout {a.timeout_ms} ms, data every {period:g} s: failed after "
              f"{', '.join(f'{x:.0f}' for x in ms)} ms (median {statistics.median(ms) if ms else 0:.0f}); "
              f"{runs[0][1]!r}")
    t, what = await case_freeze(100, a.timeout_ms, ping_timeout=False)
    took = "open after 10 s" if t is None else f"{1000 * t:.0f} ms"
    print(f"freeze without grpc.http2.ping_timeout_ms: {took} {what!r}")
    t, what = await case_kill(100, a.timeout_ms)
    print(f"kill: failed after {1000 * (t or 0):.0f} ms: {what!r}")
    for period in (0.1, 1.0):
        t, what = await case_old_server(100, a.timeout_ms, period)
        print(f"old server (min ping interval 1000 ms), data every {period:g} s, keepalive 100 ms: "
              f"{'stream open after 5 s' if t is None else f'failed after {1000 * t:.0f} ms: {what!r}'}")
    for _ in range(2):
        print(f"own stall 1 s (client SIGSTOPped), keepalive 100 ms: {await case_own_stall(100, a.timeout_ms)}")


if __name__ == "__main__":
    asyncio.run(main())
