"""Both liveness modes side by side (issue 24): heartbeats every 100 ms vs HTTP/2 PINGs with
telemetry on change.

Usage: python benchmarks/liveness_modes.py [--nodes N ...] [--seconds S] [--rounds R] [--freeze K]
           [--gpus G] [--cp-cpu C] [--fleet-cpu F] [--refresh-ms M] [--keepalive-ms P] [--ping-timeout-ms T]

Two fake agent fleets, each its own process (pinned to ``--fleet-cpu``): one serves N - K nodes,
the other the K nodes to freeze. Every node has its own loopback address (127.0.x.y), so its
probe channel is its own TCP connection with its own keepalive PINGs, as in a real fleet (nodes
dialing one address would share one connection). A fake agent does what a real one does with
the Hello: ``probe.liveness`` heartbeat -> a heartbeat every 100 ms; transport -> one heartbeat
at once and one every ``--refresh-ms`` (unchanged telemetry; the fleet is steady), each saying
``liveness`` TRANSPORT; the servers permit PINGs every 50 ms. This process, pinned to
``--cp-cpu``, runs the real ControlPlane with the mode's config (RTT pings off in both). After a
settle it measures over S seconds: the control plane's process CPU seconds (user + sys, gRPC's
threads included; robust when other work shares the machine) per node per second, nodes per
core (N / cores used), messages received, false ejections (moves to UNHEALTHY of nodes not
frozen); in the window's middle the K-node fleet is SIGSTOPped (a host freeze: no FIN, no PING
answered) and each frozen node's detection time (SIGSTOP -> UNHEALTHY) is reported. The modes
alternate within each round.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import resource
import signal
import statistics
import sys
import time
from typing import Any

import grpc

from node_probe.proto import probe_pb2
from xds_server.config import parse_config
from xds_server.testing import free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from heartbeat_capacity import _q, telemetry  # the sibling benchmark's fleet telemetry

_WATCH = "/node_probe.v1.NodeProbe/Watch"


def _ip(i: int) -> str:
    return f"127.0.{1 + i // 250}.{1 + i % 250}"


def _fleet_main(port: int, ips: list[str], gpus: int, ready, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    beats = {lv: [probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(
        seq=k, interval_ms=100, telemetry=telemetry(k, gpus), liveness=lv)).SerializeToString() for k in range(100)]
        for lv in (probe_pb2.LIVENESS_UNSPECIFIED, probe_pb2.LIVENESS_TRANSPORT)}
    ok = probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(seq=1, ok=True, ttft_ms=10.0))
    ok_bytes = ok.SerializeToString()

    async def handler(request_iterator, context):
        loop = asyncio.get_running_loop()
        said = asyncio.Event()
        md = dict(context.invocation_metadata() or ())
        mode = {"transport": md.get("x-sentinel-liveness") == "transport",
                "refresh_s": int(md.get("x-sentinel-telemetry-refresh-ms", 1000)) / 1000.0}
        if mode["transport"]:
            said.set()  # asked in the call's metadata, as a real agent takes it: no heartbeat phase

        async def read() -> None:
            async for raw in request_iterator:
                m = probe_pb2.ControlMessage.FromString(raw)
                if m.WhichOneof("msg") == "hello" and not said.is_set():
                    mode["transport"] = m.hello.liveness == probe_pb2.LIVENESS_TRANSPORT
                    mode["refresh_s"] = (m.hello.telemetry_refresh_ms or 1000) / 1000.0
                    said.set()

        reader = loop.create_task(read())
        try:
            await asyncio.sleep(random.random() * 0.1)  # a random phase per stream
            yield beats[probe_pb2.LIVENESS_TRANSPORT if mode["transport"] else probe_pb2.LIVENESS_UNSPECIFIED][0]
            yield ok_bytes
            k, nxt = 0, loop.time()
            while not said.is_set():  # as a real agent: heartbeats every interval until the Hello is read
                k += 1
                nxt += 0.1
                await asyncio.sleep(max(0.0, nxt - loop.time()))
                yield beats[probe_pb2.LIVENESS_UNSPECIFIED][k % 100]
            nxt = loop.time()
            if mode["transport"]:
                yield beats[probe_pb2.LIVENESS_TRANSPORT][0]  # the first in transport, at once
                period, lv = mode["refresh_s"], probe_pb2.LIVENESS_TRANSPORT
                nxt += random.random() * period
            else:
                period, lv = 0.1, probe_pb2.LIVENESS_UNSPECIFIED
            while True:
                k += 1
                nxt += period
                await asyncio.sleep(max(0.0, nxt - loop.time()))
                yield beats[lv][k % 100]
        finally:
            reader.cancel()

    h = grpc.stream_stream_rpc_method_handler(handler)

    class _Handler(grpc.GenericRpcHandler):
        def service(self, details):
            return h if details.method == _WATCH else None

    async def run() -> None:
        srv = grpc.aio.server(handlers=[_Handler()], options=[
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.min_ping_interval_without_data_ms", 50),
            ("grpc.http2.max_pings_without_data", 0), ("grpc.so_reuseport", 0)])
        for ip in ips:
            srv.add_insecure_port(f"{ip}:{port}")
        await srv.start()
        ready.set()
        parent = os.getppid()
        while os.getppid() == parent:
            await asyncio.sleep(1.0)

    asyncio.run(run())


class _Fleet:
    def __init__(self, port: int, ips: list[str], gpus: int, cpu: int | None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ready = ctx.Event()
        self.proc = ctx.Process(target=_fleet_main, args=(port, ips, gpus, self._ready, cpu), daemon=True)

    def start(self) -> _Fleet:
        self.proc.start()
        if not self._ready.wait(120):
            self.stop()
            raise RuntimeError("fake fleet did not start")
        return self

    def stop(self) -> None:
        if self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.join(5)


async def measure(mode: str, n: int, seconds: float, freeze: int, gpus: int, cp_cpu: int | None,
                  fleet_cpu: int | None, refresh_ms: int, keepalive_ms: int, ping_timeout_ms: int,
                  settle_s: float = 6.0) -> dict[str, Any]:
    from xds_server.probing.session import ProbeSession
    from xds_server.server import ControlPlane

    received = [0]  # agent messages read off the streams (re-asserted heartbeats are not messages)
    on_message = ProbeSession.on_message

    def counted(self: ProbeSession, msg: Any, now: float) -> None:
        received[0] += 1
        on_message(self, msg, now)

    ProbeSession.on_message = counted  # type: ignore[method-assign]  # this process measures one run
    if cp_cpu is not None:
        os.sched_setaffinity(0, {cp_cpu})
    port = free_port()
    ips = [_ip(i) for i in range(n)]
    fleets = [_Fleet(port, ips[freeze:], gpus, fleet_cpu).start(), _Fleet(port, ips[:freeze], gpus, fleet_cpu).start()]
    cfg = parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"ping_interval_ms": 60_000},
        "probe": {"liveness": mode, "telemetry_refresh_ms": refresh_ms, "transport_keepalive_time_ms": keepalive_ms,
                  "transport_ping_timeout_ms": ping_timeout_ms},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"10.0.{i // 250}.{1 + i % 250}:8000", "probe_address": f"{ips[i]}:{port}"}
            for i in range(n)]}]})
    cp = ControlPlane(cfg)
    ejected: list[tuple[float, str]] = []
    reasons: list[str] = []
    rec = cp.core.events.record

    def record(wall_s: float, cluster: str, node_id: str, kind: str, reason: str, *a: Any, **k: Any):
        if (a[1] if len(a) > 1 else k.get("to_state")) == "UNHEALTHY":
            ejected.append((wall_s, node_id))
            reasons.append(reason)
        return rec(wall_s, cluster, node_id, kind, reason, *a, **k)

    cp.core.events.record = record
    await cp.start()
    try:
        await asyncio.sleep(settle_s)
        frozen = {f"n{i}" for i in range(freeze)}
        states_at_freeze: dict[str, str] = {}
        e0, hb0, m0 = len(ejected), sum(cp.heartbeats.values()), received[0]
        connected = sum(1 for s in cp.sessions.values() if s.connected)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        await asyncio.sleep(seconds / 2)
        freeze_at = time.time()
        if freeze:
            states_at_freeze = {i: cp.core.health[i].state.name for i in sorted(frozen)}
            os.kill(fleets[1].proc.pid, signal.SIGSTOP)
        await asyncio.sleep(seconds / 2)
        r1, dt = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t0
        msgs, beats = received[0] - m0, sum(cp.heartbeats.values()) - hb0
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        window = ejected[e0:]
        first: dict[str, float] = {}
        for at, i in window:
            if i in frozen and at >= freeze_at:
                first.setdefault(i, at)
        detect = [(at - freeze_at) * 1000.0 for at in first.values()]
        live = n - freeze
        out: dict[str, Any] = {
            "mode": mode, "nodes": n, "connected": connected, "cpu_cores": cpu / dt,
            "cpu_us_per_node_s": cpu / dt / n * 1e6, "nodes_per_core": n / max(cpu / dt, 1e-9),
            "messages_per_s": msgs / dt, "messages_per_node_s": msgs / dt / max(live, 1),
            "model_heartbeats_per_node_s": beats / dt / max(live, 1),
            "false_ejections": sum(1 for _, i in window if i not in frozen),
            "ejections_in_settle": e0, "ejected_in_settle": sorted({i for _, i in ejected[:e0]})[:5],
            "settle_reasons": sorted({r[:90] for r in reasons[:e0]})[:4],
            "window_reasons": sorted({r[:120] for r, (_, i) in zip(reasons[e0:], window, strict=True)
                                      if i not in frozen})[:3],
            "frozen": freeze, "detected": len(detect), "load_avg": os.getloadavg()[0]}
        missed = {i: states_at_freeze.get(i) for i in frozen if i not in first}
        if missed:  # frozen nodes with no move to UNHEALTHY: their state when frozen
            out["undetected_states_at_freeze"] = missed
        if detect:
            out.update(detect_p50_ms=statistics.median(detect), detect_p99_ms=_q(detect, 0.99),
                       detect_max_ms=max(detect))
        return out
    finally:
        await cp.stop()
        for f in fleets:
            f.stop()


def _run_one(args: list[Any], q) -> None:
    q.put(asyncio.run(measure(*args)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--freeze", type=int, default=20)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--cp-cpu", type=int, default=None)
    ap.add_argument("--fleet-cpu", type=int, default=None)
    ap.add_argument("--refresh-ms", type=int, default=1000)
    ap.add_argument("--keepalive-ms", type=int, default=100)
    ap.add_argument("--ping-timeout-ms", type=int, default=100)
    ap.add_argument("--modes", nargs="+", default=["heartbeat", "transport"])
    a = ap.parse_args()
    ctx = multiprocessing.get_context("spawn")
    for n in a.nodes:
        for r in range(a.rounds):
            for mode in (a.modes if r % 2 == 0 else list(reversed(a.modes))):
                q = ctx.Queue()
                p = ctx.Process(target=_run_one, args=([mode, n, a.seconds, a.freeze, a.gpus, a.cp_cpu, a.fleet_cpu,
                                                        a.refresh_ms, a.keepalive_ms, a.ping_timeout_ms], q))
                p.start()  # a fresh process per measurement: no state carried between modes
                res = q.get(timeout=a.seconds + 300)
                p.join(30)
                print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()}), flush=True)


if __name__ == "__main__":
    main()
