"""Liveness from the server side of a gRPC stream: how soon a grpc.aio *server* learns that a
client process froze, with its own keepalive PINGs, and what holding many such streams costs.

This is the transport the control plane would use if agents dialled in (the agent a client, the
control plane the server): a grpcio client sends at most one PING a second on a connection with
streams, a server has no such floor. Everything here is real processes on 127.0.0.1: the server
in this process (as the control plane), each client a spawned interpreter with its streams.

- ``freeze``: one client, one bidi stream, a message every second; the client SIGSTOPped at a
  random moment 0.3-1.3 s after the stream opened. Measured: from the SIGSTOP to the server's
  handler seeing its stream end (the read ending or the call's done callback, whichever first).
  Server options: ``grpc.keepalive_time_ms`` K, ``grpc.http2.ping_timeout_ms`` T,
  ``grpc.http2.max_pings_without_data`` 0, ``grpc.keepalive_permit_without_calls`` 1.
- ``blocked``: the client's event loop blocked 3 s (``time.sleep`` in a callback), the process
  running: does the transport notice (no: gRPC's C core answers PINGs on its own threads)?
- ``cpu``: ``--streams`` connections (one stream each) from ``--clients`` processes, idle but for their messages,
  for ``--cpu-s``: the server's CPU (process total, and its Python thread alone) per 1,000
  connections. Cases: PINGs every K ms and a message a second; PINGs alone; no PINGs and a
  message every 100 ms (heartbeats as the agents send them today).

    .venv/bin/python benchmarks/server_keepalive.py [--trials 100] [--keepalive-ms 100 50]
        [--ping-timeout-ms 100] [--streams 500 --clients 4 --cpu-s 10]
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
from collections.abc import AsyncIterator

os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # the C core's GOAWAY notes, per frozen client

import grpc  # after the environment above

from xds_server.testing import free_port, threads_cpu_s

_METHOD = "/bench.Liveness/Beat"


def _client_main(port: int, streams: int, beat_s: float, block_after_s: float, block_s: float) -> None:
    """``streams`` bidi streams, each on a connection of its own (as one agent per node would
    hold), each sending a message every ``beat_s``; with ``block_after_s`` > 0 the event loop is
    blocked ``block_s`` that long after the start."""
    async def run() -> None:
        # a local subchannel pool per channel: separate TCP connections, not one shared
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(streams)]

        async def beats() -> AsyncIterator[bytes]:
            while True:
                yield b"b"
                await asyncio.sleep(beat_s)

        calls = [ch.stream_stream(_METHOD)(beats()) for ch in channels]
        if block_after_s > 0:
            asyncio.get_running_loop().call_later(block_after_s, time.sleep, block_s)
        await asyncio.gather(*(c.read() for c in calls), return_exceptions=True)
        await asyncio.Event().wait()
    asyncio.run(run())


def _spawn(*args: object) -> multiprocessing.process.BaseProcess:
    p = multiprocessing.get_context("spawn").Process(target=_client_main, args=args, daemon=True)
    p.start()
    return p


def _stop(p: multiprocessing.process.BaseProcess) -> None:
    if p.pid is not None:
        try:
            os.kill(p.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    p.kill()
    p.join(5)


class Server:
    """A grpc.aio server whose handler counts open streams and stamps each one's end (monotonic s)."""

    def __init__(self, keepalive_ms: int | None, ping_timeout_ms: int) -> None:
        self.keepalive_ms, self.ping_timeout_ms = keepalive_ms, ping_timeout_ms
        self.open = 0
        self.opened = asyncio.Event()
        self.ended: list[float] = []
        self.messages = 0
        self.port = free_port()
        self._srv: grpc.aio.Server | None = None

    async def _handler(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """Reads the stream to its end and answers nothing (grpc.aio's reader/writer handler form)."""
        self.open += 1
        self.opened.set()
        done: list[float] = []

        def end(*_: object) -> None:
            if not done:
                done.append(time.monotonic())
                self.ended.append(done[0])
                self.open -= 1
        context.add_done_callback(end)
        try:
            async for _ in requests:
                self.messages += 1
        finally:
            end()

    async def start(self) -> Server:
        handler = grpc.stream_stream_rpc_method_handler(self._handler)

        class H(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
                return handler if details.method == _METHOD else None

        opts: list[tuple[str, int]] = [("grpc.keepalive_permit_without_calls", 1),
                                       ("grpc.http2.max_pings_without_data", 0)]
        if self.keepalive_ms:
            opts += [("grpc.keepalive_time_ms", self.keepalive_ms),
                     ("grpc.http2.ping_timeout_ms", self.ping_timeout_ms),
                     ("grpc.keepalive_timeout_ms", self.ping_timeout_ms)]
        self._srv = grpc.aio.server(handlers=[H()], options=opts)
        self._srv.add_insecure_port(f"127.0.0.1:{self.port}")
        await self._srv.start()
        return self

    async def stop(self) -> None:
        if self._srv is not None:
            await self._srv.stop(0)


async def freeze_trial(keepalive_ms: int, ping_timeout_ms: int, limit_s: float = 5.0) -> float | None:
    """Seconds from the client's SIGSTOP to the server's stream end (None: not within ``limit_s``)."""
    srv = await Server(keepalive_ms, ping_timeout_ms).start()
    cli = _spawn(srv.port, 1, 1.0, 0.0, 0.0)
    try:
        await asyncio.wait_for(srv.opened.wait(), 30)
        await asyncio.sleep(random.uniform(0.3, 1.3))
        assert cli.pid is not None
        t0 = time.monotonic()
        os.kill(cli.pid, signal.SIGSTOP)
        end = time.monotonic() + limit_s
        while not srv.ended and time.monotonic() < end:
            await asyncio.sleep(0.001)
        return srv.ended[0] - t0 if srv.ended else None
    finally:
        _stop(cli)
        await srv.stop()


async def blocked_trial(keepalive_ms: int, ping_timeout_ms: int, block_s: float = 3.0) -> str:
    """The client's loop blocked ``block_s``: does the server's stream end meanwhile?"""
    srv = await Server(keepalive_ms, ping_timeout_ms).start()
    cli = _spawn(srv.port, 1, 1.0, 1.0, block_s)
    try:
        await asyncio.wait_for(srv.opened.wait(), 30)
        before = srv.messages
        await asyncio.sleep(1.0 + block_s + 0.5)
        return (f"stream ended {'yes' if srv.ended else 'no'}; messages during the block and after: "
                f"{srv.messages - before} (a message a second)")
    finally:
        _stop(cli)
        await srv.stop()


MAX_STREAMS_PER_CLIENT = 250
"""Streams one client process holds at most. At 500 per process (``--streams 1000 --clients 2``,
2026-12-07, two cores) the grpcio clients went wrong: one alone brought up 33 of its 500 streams
(686 MB), two at once grew 120-190 MB a second each (13.6 GB in 72 s) until the machine thrashed.
200 in one process held steady (75-85 MB, all up). Not chased: the load generator's, not ours."""


def client_processes(streams: int, asked: int) -> int:
    """Client processes for ``streams``: ``asked``, or more so that none holds more than
    :data:`MAX_STREAMS_PER_CLIENT`."""
    return max(asked, -(-streams // MAX_STREAMS_PER_CLIENT))


async def cpu_case(keepalive_ms: int | None, ping_timeout_ms: int, beat_s: float, streams: int, clients: int,
                   seconds: float) -> tuple[float, float]:
    """(process cores, Python-thread cores) per 1,000 streams over ``seconds``, once all are open;
    ``clients``: the client processes, as :func:`client_processes` gives them."""
    srv = await Server(keepalive_ms, ping_timeout_ms).start()
    per = [streams // clients + (1 if k < streams % clients else 0) for k in range(clients)]
    procs = [_spawn(srv.port, n, beat_s, 0.0, 0.0) for n in per]
    try:
        end = time.monotonic() + 60
        while srv.open < streams and time.monotonic() < end:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        tid = threading.get_native_id()
        t0, c0, p0 = time.monotonic(), time.process_time(), threads_cpu_s()[tid][1]
        await asyncio.sleep(seconds)
        dt = time.monotonic() - t0
        total, python = (time.process_time() - c0) / dt, (threads_cpu_s()[tid][1] - p0) / dt
        return 1000.0 * total / max(1, srv.open), 1000.0 * python / max(1, srv.open)
    finally:
        for p in procs:
            _stop(p)
        await srv.stop()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--keepalive-ms", type=int, nargs="+", default=[100, 50])
    ap.add_argument("--ping-timeout-ms", type=int, default=100)
    ap.add_argument("--streams", type=int, default=500)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--cpu-s", type=float, default=10.0)
    ap.add_argument("--skip", nargs="*", default=[], choices=["freeze", "blocked", "cpu"])
    a = ap.parse_args()
    print(f"grpcio {grpc.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    if "freeze" not in a.skip:
        for k in a.keepalive_ms:
            got = [await freeze_trial(k, a.ping_timeout_ms) for _ in range(a.trials)]
            ms = sorted(1000 * t for t in got if t is not None)
            p99 = ms[min(len(ms) - 1, max(0, round(0.99 * len(ms)) - 1))] if ms else float("nan")
            print(f"freeze, server keepalive {k} ms, ping timeout {a.ping_timeout_ms} ms, {a.trials} trials: "
                  f"median {statistics.median(ms) if ms else float('nan'):.0f} ms, p99 {p99:.0f}, "
                  f"max {max(ms, default=float('nan')):.0f}, not detected in 5 s: {len(got) - len(ms)}", flush=True)
    if "blocked" not in a.skip:
        print(f"client loop blocked 3 s, keepalive 100 ms: {await blocked_trial(100, a.ping_timeout_ms)}", flush=True)
    if "cpu" not in a.skip:
        procs = client_processes(a.streams, a.clients)
        for name, k, beat in [(f"PINGs every {a.keepalive_ms[0]} ms + a message a second", a.keepalive_ms[0], 1.0),
                              (f"PINGs every {a.keepalive_ms[0]} ms alone", a.keepalive_ms[0], 3600.0),
                              ("no PINGs, a message every 100 ms", None, 0.1)]:
            total, python = await cpu_case(k, a.ping_timeout_ms, beat, a.streams, procs, a.cpu_s)
            print(f"cpu, {a.streams} streams from {procs} processes, {name}: {total:.2f} cores per 1,000 "
                  f"streams (Python thread {python:.2f})", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
