"""How fast a grpc.aio server takes new streams while its event loop is busy, with gRPC's own
wake-up reader (one byte, one completion per loop turn once its socket is full) and with
``xds_server.process.grpc_wakeups`` (every waiting byte read each turn), side by side.

Usage: python benchmarks/grpc_wakeups.py [--streams N] [--busy-ms B] [--seconds S]
           [--keepalive-ms P] [--ping-timeout-ms T] [--modes grpc drained]

Per mode, in a fresh spawned process: a grpc.aio server on 127.0.0.1 serving
``node_probe.v1.ProbeHub/Connect`` with a handler that reads every message (the control plane's
dial-in keepalive options: PINGs every P ms, answered within T ms); a task that keeps the loop busy
in B ms steps (CPU, then ``asyncio.sleep(0)``: the loop never waits in its poll, as at 2,000 agents);
then N simulated agents (``h2_agents``, one process, each its own TCP connection, a heartbeat a
second) dial within 1 s. Reported: agents whose stream was taken (the handler entered; an agent
counted once, by the node id of its first message) after S s at most, the time the last one was
taken (or none), streams taken again after a re-dial (``redials``), and the wake-up bytes
waiting on gRPC's socket (sampled every 50 ms from a thread: p50, max). B = 0 is the idle loop.

    .venv/bin/python benchmarks/grpc_wakeups.py --streams 500 --busy-ms 5 --seconds 40

Every process started is stopped at the end (the agents die with their parent).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import threading
import time
from typing import Any

import grpc
from h2_agents import run_agents

from node_probe.proto import probe_pb2
from xds_server.config.probe import ProbeConfig
from xds_server.process import grpc_wakeups


def _agents(port: int, streams: int, parent: int) -> None:
    def beat(nid: str, seq: int = 1) -> bytes:
        return probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=seq, node_id=nid)).SerializeToString()

    async def main() -> None:
        await run_agents(port, [(f"n{i}", "127.0.0.1:1") for i in range(streams)],
                         lambda nid, _a: [beat(nid)], beat, 1.0, lambda: None, lambda: os.getppid() == parent)
    asyncio.run(main())


async def _measure(mode: str, streams: int, busy_ms: float, seconds: float, keepalive_ms: int,
                   ping_timeout_ms: int) -> dict[str, Any]:
    taken: dict[str, float] = {}  # agent -> when its first stream was taken (the handler entered)
    entered = [0]  # streams taken, re-dials included

    async def connect(requests: Any, _context: grpc.aio.ServicerContext) -> None:
        at = time.monotonic()
        entered[0] += 1
        async for raw in requests:
            taken.setdefault(probe_pb2.AgentMessage.FromString(raw).heartbeat.node_id, at)

    # the agents' port's options, with gRPC's own 30 s for a stream not taken yet (as measured)
    server = grpc.aio.server(options=ProbeConfig(dial_in={
        "keepalive": f"{keepalive_ms}ms", "ping_timeout": f"{ping_timeout_ms}ms",
        "accept_wait": "30s"}).dial_in_options())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "node_probe.v1.ProbeHub", {"Connect": grpc.stream_stream_rpc_method_handler(connect)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    if mode == "drained":
        await grpc_wakeups.start_server(server)
    else:
        await server.start()
    sock = grpc_wakeups.wakeup_socket(asyncio.get_running_loop())
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while sock is not None and not stop.wait(0.05):
            samples.append(grpc_wakeups.waiting_bytes(sock.fileno()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    async def busy() -> None:
        while not stop.is_set():
            end = time.perf_counter() + busy_ms / 1000.0
            while time.perf_counter() < end:
                pass
            await asyncio.sleep(0)

    spinner = asyncio.create_task(busy()) if busy_ms > 0 else None
    agents = multiprocessing.get_context("spawn").Process(target=_agents, args=(port, streams, os.getpid()),
                                                          daemon=True)
    t0 = time.monotonic()
    agents.start()
    try:
        while len(taken) < streams and time.monotonic() < t0 + seconds:
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        agents.kill()
        agents.join(5)
        if spinner is not None:
            await spinner
        sampler.join(1)
        await server.stop(0)
    first = sorted(taken.values())
    return {"mode": mode, "streams": streams, "busy_ms": busy_ms, "taken": len(first),
            "redials": entered[0] - len(first),
            "all_taken_s": round(first[-1] - t0, 2) if len(first) == streams else None,
            "half_taken_s": round(first[streams // 2] - t0, 2) if len(first) > streams // 2 else None,
            "waiting_bytes": {"p50": statistics.median(samples), "max": max(samples)} if samples else None}


def _run(args: list[Any], q: Any) -> None:
    q.put(asyncio.run(_measure(*args)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=500)
    ap.add_argument("--busy-ms", type=float, default=5.0, help="the loop's busy steps, ms (0: idle)")
    ap.add_argument("--seconds", type=float, default=40.0, help="the longest wait for every stream")
    ap.add_argument("--keepalive-ms", type=int, default=90)
    ap.add_argument("--ping-timeout-ms", type=int, default=60)
    ap.add_argument("--modes", nargs="+", default=["grpc", "drained"], choices=("grpc", "drained"))
    a = ap.parse_args()
    ctx = multiprocessing.get_context("spawn")
    for mode in a.modes:
        q = ctx.Queue()
        p = ctx.Process(target=_run, args=([mode, a.streams, a.busy_ms, a.seconds, a.keepalive_ms,
                                             a.ping_timeout_ms], q))
        p.start()
        try:
            print(json.dumps(q.get(timeout=a.seconds + 120)), flush=True)
        finally:
            p.kill()
            p.join(5)


if __name__ == "__main__":
    main()
