"""How many nodes can one control-plane process watch at 100 ms heartbeats?

Usage: python benchmarks/heartbeat_capacity.py [--nodes N ...] [--seconds S] [--gpus G]
           [--freeze K] [--cp-cpu C] [--fleet-cpu F] [--floor] [--hot-path] [--loop L]

A separate process (:class:`FakeFleet`, pinned to CPU ``--fleet-cpu`` with sched_setaffinity,
as ``taskset`` does) runs one fake node_probe agent (grpc.aio, pre-serialized messages) that
serves every Watch stream with a heartbeat every 100 ms (no probes, no pings answered) carrying
``--gpus`` GPU readings (0: engine state only, the original fake). This process, pinned to CPU
``--cp-cpu``, runs the real ControlPlane with N nodes dialing that agent. After a settle it
measures, over S seconds: the control plane's process CPU (user+sys) per heartbeat received,
the part of it spent in our code (``ProbeSession.on_message`` and the detection timers, their
thread CPU time around each call: the rest is gRPC's receive path and the event loop),
heartbeats received vs sent, and false ejections (transitions to UNHEALTHY of nodes not frozen).

``--freeze K``: K nodes dial a second port of the agent whose streams stop sending (stay open,
silent: a frozen host) in the middle of the window; their detection time (freeze -> UNHEALTHY,
wall clock shared by both processes) is reported as p50/p99/max. ``--floor``: our handler is
replaced by a counter, so the process CPU is gRPC's and the event loop's alone (the floor).
``--hot-path``: our share without gRPC (:func:`hot_path`).

For other benchmarks (e.g. probe workers): ``FakeFleet`` drives a fleet, :func:`fleet_config`
writes the matching config, :func:`measure` runs one measurement with a control-plane factory.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import grpc

from node_probe.proto import probe_pb2
from xds_server.config import SentinelConfig, parse_config
from xds_server.process import event_loop
from xds_server.testing import free_port

_WATCH = "/node_probe.v1.NodeProbe/Watch"


def telemetry(seq: int, gpus: int) -> probe_pb2.Telemetry:
    """A READY engine's telemetry as a real agent sends it: engine load that moves every
    heartbeat (the token and finished-request counters), ``gpus`` GPU readings that move once per second (NVML is
    polled every ``gpu_interval_s``, 1 s; ``poll_seq`` numbers each poll); ``gpus=0``: only the
    engine state (the original fake)."""
    tel = probe_pb2.Telemetry(engine_state=probe_pb2.ENGINE_STATE_READY)
    if not gpus:
        return tel
    tel.engine_load.metrics_ok = True
    tel.engine_load.requests_waiting = 0.0
    tel.engine_load.requests_running = 4.0
    tel.engine_load.kv_cache_usage_ratio = 0.25
    tel.engine_load.prefix_cache_hit_ratio = 0.5
    tel.engine_load.generation_tokens_total = 1000.0 + 40.0 * seq
    tel.engine_load.requests_finished_total = 100.0 + seq // 2  # vllm:request_success_total: moves too
    tel.engine_load.kv_cache_metric = "vllm:gpu_cache_usage_perc"
    tel.gpu.state = probe_pb2.NVML_STATE_OK
    second = seq // 10
    tel.gpu.poll_seq = 1 + second  # numbered as the agent numbers each NVML poll
    for i in range(gpus):
        tel.gpu.gpus.add(index=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", name="NVIDIA H200",
                         memory_total_bytes=150_000_000_000, memory_used_bytes=120_000_000_000 + second % 7,
                         utilization_ratio=0.9, temperature_c=60.0 + second % 5, power_w=500.0 + second % 3)
    return tel


def _fleet_main(port: int, frozen_port: int, gpus: int, freeze_at, ready, cpu: int | None) -> None:
    """The fake agent process: every Watch stream gets a pre-serialized heartbeat each 100 ms
    (fixed rate), one good probe result first; streams on ``frozen_port`` stop sending (stay
    open) once ``freeze_at.value`` (unix s) > 0 and has passed."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    beats = [probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(
        seq=k, interval_ms=100, telemetry=telemetry(k, gpus))).SerializeToString() for k in range(100)]
    ok = probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(seq=1, ok=True, ttft_ms=10.0))
    ok_bytes = ok.SerializeToString()

    def watch(frozen: bool):
        async def handler(request_iterator, context):
            loop = asyncio.get_running_loop()
            # a random phase per stream, as a real fleet's agents have: heartbeats spread over the
            # interval, and frozen nodes stop at different points of their interval
            await asyncio.sleep(random.random() * 0.1)
            nxt = loop.time()
            yield beats[0]
            # one good probe result so the node is routed (PROBATION) and can be (falsely) ejected
            yield ok_bytes
            k = 0
            while True:
                k += 1
                nxt += 0.1
                await asyncio.sleep(max(0.0, nxt - loop.time()))
                if frozen and 0 < freeze_at.value <= time.time():
                    await asyncio.Event().wait()  # a frozen host: the stream stays open, silent
                yield beats[k % 100]
        return grpc.stream_stream_rpc_method_handler(handler)  # bytes in, bytes out

    class _Handler(grpc.GenericRpcHandler):
        def __init__(self, frozen: bool) -> None:
            self.h = watch(frozen)

        def service(self, details):
            return self.h if details.method == _WATCH else None

    async def run() -> None:
        servers = []
        for p, frozen in ((port, False), (frozen_port, True)):
            srv = grpc.aio.server(handlers=[_Handler(frozen)], options=[  # as the real agent's
                ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
                ("grpc.http2.max_pings_without_data", 0), ("grpc.so_reuseport", 0)])
            srv.add_insecure_port(f"127.0.0.1:{p}")
            await srv.start()
            servers.append(srv)
        ready.set()
        parent = os.getppid()
        while os.getppid() == parent:  # the benchmark process died without stopping us: exit too
            await asyncio.sleep(1.0)

    asyncio.run(run())


class FakeFleet:
    """The fake agent fleet in its own process (spawned; pinned to ``cpu`` when given).

    ``port``: where every normal node's agent is, ``frozen_port``: where the nodes to freeze
    dial; ``freeze()`` freezes those now and returns the freeze time (unix s). ``stop()`` kills
    the process. Use as a context manager.
    """

    def __init__(self, gpus: int = 0, cpu: int | None = None) -> None:
        self.port = free_port()
        self.frozen_port = free_port()
        ctx = multiprocessing.get_context("spawn")  # a forked child of a process that ran gRPC hangs
        self._freeze_at = ctx.Value("d", 0.0)
        self._ready = ctx.Event()
        self._proc = ctx.Process(target=_fleet_main, daemon=True,
                                 args=(self.port, self.frozen_port, gpus, self._freeze_at, self._ready, cpu))

    def start(self) -> FakeFleet:
        self._proc.start()
        deadline = time.monotonic() + 60.0  # the spawned interpreter imports grpc and binds both ports
        while not self._ready.wait(0.2):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("fake fleet did not start (see its output)")
        return self

    def freeze(self) -> float:
        at = time.time()
        self._freeze_at.value = at
        return at

    def stop(self) -> None:
        self._proc.kill()
        self._proc.join(5)

    def __enter__(self) -> FakeFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def fleet_config(n: int, fleet: FakeFleet, frozen: int = 0, extra: dict | None = None) -> SentinelConfig:
    """A config of ``n`` nodes in one cluster dialing ``fleet`` (the first ``frozen`` on its
    frozen port); pings off (60 s); ``extra``'s sections are merged into the config's (e.g.
    ``{"probing": {"workers": 2}}``)."""
    raw = {
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"ping_interval_ms": 60_000},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.{1 + i // 60000}:{1 + i % 60000}",
             "probe_address": f"127.0.0.1:{fleet.frozen_port if i < frozen else fleet.port}"}
            for i in range(n)]}],
    }
    for k, v in (extra or {}).items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) and isinstance(raw.get(k), dict) else v
    return parse_config(raw)


class _OurTime:
    """CPU seconds (this thread's, ``time.thread_time``: robust when other processes share the
    core) spent in our per-message handler and detection timers (patched in at class level
    before the control plane starts; restored by ``undo()``). The two clock reads per call cost
    ~1 us of CPU each call, counted in the total, not in ours."""

    def __init__(self, floor: bool) -> None:
        from xds_server.probing.session import ProbeSession

        self.s = 0.0
        self.messages = 0
        self.calls = 0  # timed calls (messages and timer firings)
        self.timer_s = 0.0  # of ``s``: the detection timers' firings (TickTimer._fire)
        self.timer_calls = 0
        self._undo: list[tuple[Any, str, Any]] = []
        self.available = hasattr(ProbeSession, "on_message")
        if not self.available:  # an older tree (--before via PYTHONPATH): process CPU only
            return
        from xds_server.probing.timers import TickTimer
        me = self
        clock = time.thread_time

        def wrap(cls: Any, name: str, noop: bool = False) -> None:
            orig = getattr(cls, name)

            def timed(self: Any, *a: Any) -> None:
                me.calls += 1
                me.timer_calls += 1
                t0 = clock()
                try:
                    if not noop:
                        orig(self, *a)
                finally:
                    dt = clock() - t0
                    me.s += dt
                    me.timer_s += dt

            self._undo.append((cls, name, orig))
            setattr(cls, name, timed)

        orig_msg = ProbeSession.on_message

        def on_message(self: Any, msg: Any, now: float) -> None:
            me.messages += 1
            me.calls += 1
            t0 = clock()
            try:
                if not floor:
                    orig_msg(self, msg, now)
                else:  # the floor: received, nothing else (a stream with no heartbeat is redialled)
                    st = self._stream
                    if st is not None:
                        st.last_hb = now
            finally:
                me.s += clock() - t0

        self._undo.append((ProbeSession, "on_message", orig_msg))
        ProbeSession.on_message = on_message  # type: ignore[method-assign] - timing wrapper, undone
        wrap(TickTimer, "_fire")

    def undo(self) -> None:
        for cls, name, orig in reversed(self._undo):
            setattr(cls, name, orig)


def _clock_cost_s(n: int = 20_000) -> float:
    """CPU seconds one ``time.thread_time()`` read costs now (a system call: ~0.3 us on an idle
    machine, several us when the machine's CPUs are oversubscribed)."""
    t0 = time.process_time()
    for _ in range(n):
        time.thread_time()
    return (time.process_time() - t0) / n


def _speed_us(n: int = 200_000) -> float:
    """CPU us of a fixed pure-Python loop, printed beside each result: the same code costs more
    CPU time on a machine shared with other work, so numbers taken at different loads can be
    compared by this ratio."""
    t0 = time.process_time()
    x = 0
    for i in range(n):
        x += i & 7
    return (time.process_time() - t0) * 1e6


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def measure(n: int, seconds: float, *, gpus: int = 0, freeze: int = 0, cp_cpu: int | None = None,
                  fleet_cpu: int | None = None, floor: bool = False, settle_s: float = 5.0,
                  control_plane: Callable[[SentinelConfig], Any] | None = None,
                  extra: dict | None = None) -> dict:
    """One measurement (see the module docstring). ``control_plane(config)`` builds the control
    plane (default: ``xds_server.server.ControlPlane``); it must have ``start()``, ``stop()``,
    ``core`` (events and counters of every node). Returns a dict of the numbers."""
    from xds_server.server import ControlPlane

    if cp_cpu is not None:
        os.sched_setaffinity(0, {cp_cpu})
    fleet = FakeFleet(gpus, fleet_cpu).start()
    ours = _OurTime(floor)
    ejected: list[tuple[float, str]] = []  # (wall s, node id) of every move to UNHEALTHY
    try:
        cfg = fleet_config(n, fleet, freeze, extra)
        cp = (control_plane or ControlPlane)(cfg)
        rec = cp.core.events.record

        def record(wall_s: float, cluster: str, node_id: str, kind: str, reason: str, *a: Any, **k: Any):
            to_state = a[1] if len(a) > 1 else k.get("to_state")
            if to_state == "UNHEALTHY":
                ejected.append((wall_s, node_id))
            return rec(wall_s, cluster, node_id, kind, reason, *a, **k)

        cp.core.events.record = record
        probe_s, speed_us = _clock_cost_s(), _speed_us()  # before any stream: they block the loop
        await cp.start()
        try:
            await asyncio.sleep(settle_s)  # connect and settle
            frozen_ids = {f"n{i}" for i in range(freeze)}
            false0 = sum(1 for _, i in ejected if i not in frozen_ids)
            e0 = len(ejected)
            m0, s0, c0, ts0, tc0 = ours.messages, ours.s, ours.calls, ours.timer_s, ours.timer_calls
            hb0 = sum(cp.heartbeats.values())
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.monotonic()
            freeze_at = None
            if freeze:
                await asyncio.sleep(seconds / 2)
                freeze_at = fleet.freeze()
                await asyncio.sleep(seconds / 2)
            else:
                await asyncio.sleep(seconds)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            dt = time.monotonic() - t0
            msgs, our_s, calls = ours.messages - m0, ours.s - s0, ours.calls - c0
            timer_s, timer_calls = ours.timer_s - ts0, ours.timer_calls - tc0
            timer_s = max(0.0, timer_s - timer_calls * probe_s)
            if not ours.available:
                msgs = sum(cp.heartbeats.values()) - hb0
            cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
            # each timed call adds two clock reads: about one lands inside "ours", both in the total
            our_s = max(0.0, our_s - calls * probe_s)
            cpu = max(0.0, cpu - 2 * calls * probe_s)
            window = ejected[e0:]
            false = sum(1 for _, i in window if i not in frozen_ids)
            first: dict[str, float] = {}
            for at, i in window:
                if i in frozen_ids and freeze_at is not None and at >= freeze_at:
                    first.setdefault(i, at)
            detect = [] if freeze_at is None else [(at - freeze_at) * 1000.0 for at in first.values()]
            hb = max(msgs, 1)
            out = {"nodes": n, "gpus": gpus, "floor": floor, "heartbeats_per_s": msgs / dt,
                   "expected_per_s": n * 10, "cpu_cores": cpu / dt, "cpu_us_per_heartbeat": cpu / hb * 1e6,
                   "our_us_per_heartbeat": our_s / hb * 1e6, "rest_us_per_heartbeat": (cpu - our_s) / hb * 1e6,
                   "timer_us_per_heartbeat": timer_s / hb * 1e6, "timer_fires_per_heartbeat": timer_calls / hb,
                   "nodes_per_core": (msgs / dt / 10.0) / max(cpu / dt, 1e-9),
                   "false_ejections": false, "false_before_window": false0,
                   "connected": sum(1 for s in cp.sessions.values() if s.connected),
                   "frozen": freeze, "detected": len(detect),
                   "load_avg": os.getloadavg()[0], "clock_read_us": probe_s * 1e6, "speed_us": speed_us}
            if detect:
                out.update(detect_p50_ms=statistics.median(detect), detect_p99_ms=_q(detect, 0.99),
                           detect_max_ms=max(detect))
            return out
        finally:
            await cp.stop()
    finally:
        ours.undo()
        fleet.stop()


async def hot_path(nodes: int = 1000, beats: int = 20, gpus: int = 8, profile: bool = False,
                   steady: bool = False, silent: float = 0.0, floor: bool = False, warm: int = 2) -> dict:
    """Our share of a heartbeat without gRPC: the serialized heartbeats a real stream would bring
    are parsed (as grpc.aio's deserializer does) and handed to each node's real
    ``ProbeSession.on_message`` (edge check, health step, routing key, timer re-arm) with a real
    ``ControlCore`` on a running event loop, ``beats`` rounds over ``nodes`` nodes, 100 ms of
    loop time apart (the timers fire as they would). Returns CPU us per heartbeat (process CPU).
    ``silent``: the share of nodes (0..1) that send no heartbeat after round 5 (streams gone
    silent); their Ticks (health steps on no heartbeat) are counted from then on, and the CPU of
    the whole loop (Ticks, heartbeats) over those rounds per second of loop time. ``floor``: the
    same loop with each message parsed and only counted (no ``on_message``): what the parse
    (grpc.aio's deserializer in the server) and this loop cost, subtracted from a full run for
    our share as the end-to-end measurement takes it (time inside ``on_message``). ``warm``: rounds
    not measured (2: COLD -> WARMING -> PROBATION; with ``steady`` the ramp's end to HEALTHY comes
    at ~1 s, round 10-12: ``warm`` 15 measures HEALTHY nodes' heartbeats alone)."""
    import cProfile
    import pstats

    from xds_server.control.core import ControlCore
    from xds_server.probing.liveness import StreamState
    from xds_server.probing.session import ProbeSession
    from xds_server.process.clock import LoopClock

    cfg = _hot_config(nodes, steady)
    core = ControlCore(cfg, LoopClock())
    core.begin()
    loop = asyncio.get_running_loop()
    ticks = [0]
    observe = core.observe

    from xds_server.health.model import Tick

    def sink(node_id: str, obs: Any, now_s: float) -> Any:
        if type(obs) is Tick:
            ticks[0] += 1
        return observe(node_id, obs, now_s)

    sessions = [ProbeSession(n, cfg.health, sink, probe=cfg.probe, counters=core.counters)
                for _, n in cfg.nodes()]
    quiet_from, n_silent = 5, round(silent * nodes)
    tick0 = cpu0 = t0_silent = 0.0
    for s in sessions:
        s._loop = loop
        s._stream = s._latest = StreamState(loop.time())
    wire = [[probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=k, interval_ms=100, node_id=s.node.id,
                                                                  telemetry=telemetry(k, gpus))).SerializeToString()
             for k in range(beats)] for s in sessions]
    ok = probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(seq=1, ok=True, ttft_ms=10.0))
    parse = probe_pb2.AgentMessage.FromString
    prof = cProfile.Profile() if profile else None
    cpu = 0.0
    handled = 0
    batch = 50
    t_round = loop.time()
    for k in range(beats):
        if n_silent and k == quiet_from:
            tick0, cpu0, t0_silent = ticks[0], time.process_time(), loop.time()
        for b in range(0, nodes, batch):
            # pace each round over 100 ms, as the fleet's heartbeats arrive spread over the interval
            wait = t_round + 0.1 * b / nodes - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            t0 = time.process_time()
            if prof:
                prof.enable()
            for i, (s, w) in enumerate(zip(sessions[b:b + batch], wire[b:b + batch], strict=True), b):
                if k >= quiet_from and i < n_silent:
                    continue  # this node's stream has gone silent
                if floor:
                    parse(w[k])
                    loop.time()
                else:
                    s.on_message(parse(w[k]), loop.time())
            if prof:
                prof.disable()
            if k >= warm:  # warm-up rounds are not measured
                cpu += time.process_time() - t0
                handled += len(sessions[b:b + batch]) - (max(0, min(n_silent, b + batch) - b) if k >= quiet_from else 0)
        if k == 0:
            for s in sessions:
                s.on_message(ok, loop.time())
        t_round += 0.1
    silent_out = {}
    if n_silent:
        await asyncio.sleep(max(0.0, t_round - loop.time()))
        span = loop.time() - t0_silent
        silent_out = {"silent": n_silent, "ticks_per_s": (ticks[0] - tick0) / span,
                      "cpu_cores_silent": (time.process_time() - cpu0) / span,
                      "silent_routed": sum(1 for i, (_, nh) in enumerate(core.health.items())
                                           if i < n_silent and nh.state.value in ("PROBATION", "HEALTHY"))}
    for s in sessions:
        if s._timer:
            s._timer.cancel()
    core.end()
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    ejections = core.counters.events["to_UNHEALTHY"]
    routed = sum(1 for nh in core.health.values() if nh.state.value in ("PROBATION", "HEALTHY"))
    return {"nodes": nodes, "gpus": gpus, "heartbeats": handled, "our_us_per_heartbeat": cpu / max(handled, 1) * 1e6,
            "routed": routed, "false_ejections": ejections, "handler_errors": sum(s.handler_errors for s in sessions),
            "load_avg": os.getloadavg()[0], **silent_out}


def _hot_config(n: int, steady: bool) -> SentinelConfig:
    return parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0"},
        "health": {"ping_interval_ms": 60_000, **({"ramp_start_percent": 100.0} if steady else {})},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.{1 + i // 60000}:{1 + i % 60000}",
             "probe_address": "127.0.0.1:1"} for i in range(n)]}],
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[100, 250, 500, 1000])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--gpus", type=int, default=0, help="GPU readings per heartbeat (0: engine state only)")
    ap.add_argument("--freeze", type=int, default=0, help="nodes frozen mid-window (detection time)")
    ap.add_argument("--cp-cpu", type=int, default=None, help="pin the control plane to this CPU")
    ap.add_argument("--fleet-cpu", type=int, default=None, help="pin the fake fleet to this CPU")
    ap.add_argument("--floor", action="store_true", help="our handler replaced by a counter (gRPC's floor)")
    ap.add_argument("--hot-path", action="store_true", help="our share without gRPC, no fleet")
    ap.add_argument("--loop", choices=event_loop.LOOPS, default="asyncio",
                    help="the control plane's event loop (xds-server serve --loop; not with --hot-path)")
    ap.add_argument("--rounds", type=int, default=20, help="--hot-path: heartbeat rounds (100 ms apart)")
    ap.add_argument("--warm", type=int, default=2, help="--hot-path: rounds not measured (warm-up)")
    ap.add_argument("--silent", type=float, default=0.0,
                    help="--hot-path: share of nodes silent after round 5 (their Ticks counted)")
    ap.add_argument("--steady", action="store_true",
                    help="nodes HEALTHY 1 s after their first probe (ramp_start_percent 100) instead of "
                         "ramping 1 %%/s for 100 s (each ramp step re-publishes the cluster)")
    a = ap.parse_args()
    if a.hot_path and a.loop != "asyncio":
        ap.error("--loop: the hot path runs no gRPC and no event loop of its own to choose (drop --loop)")
    for n in a.nodes:
        if a.hot_path:
            base = asyncio.run(hot_path(n, beats=a.rounds, gpus=a.gpus, steady=a.steady, floor=True, warm=a.warm))
            r = asyncio.run(hot_path(n, beats=a.rounds, gpus=a.gpus, steady=a.steady, silent=a.silent, warm=a.warm))
            quiet = (f"; {r['silent']} silent: {r['ticks_per_s']:.0f} Ticks/s, loop CPU {r['cpu_cores_silent']:.2f} "
                     f"cores, silent still routed {r['silent_routed']}" if r.get("silent") else "")
            floor_us = base["our_us_per_heartbeat"]
            print(f"{n:>5} nodes, {a.gpus} GPUs: our hot path {r['our_us_per_heartbeat'] - floor_us:.1f} us CPU per "
                  f"heartbeat inside on_message (whole loop {r['our_us_per_heartbeat']:.1f}, of it parse and loop "
                  f"{floor_us:.1f}) "
                  f"(speed index {_speed_us() / 1000:.1f} ms) "
                  f"({r['heartbeats']} heartbeats), routed {r['routed']}, ejections {r['false_ejections']}{quiet}, "
                  f"load avg {r['load_avg']:.2f}", flush=True)
            continue
        r = event_loop.run(measure(n, a.seconds, gpus=a.gpus, freeze=a.freeze, cp_cpu=a.cp_cpu,
                                   fleet_cpu=a.fleet_cpu, floor=a.floor,
                                   extra={"health": {"ramp_start_percent": 100.0}} if a.steady else None),
                           a.loop)
        det = (f", detection of {r['detected']}/{r['frozen']} frozen p50 {r['detect_p50_ms']:.0f} / p99 "
               f"{r['detect_p99_ms']:.0f} / max {r['detect_max_ms']:.0f} ms" if r.get("detected") else
               (f", detected 0/{r['frozen']} frozen" if r["frozen"] else ""))
        print(f"{r['nodes']:>5} nodes{' (floor)' if r['floor'] else ''}: {r['heartbeats_per_s']:>7.0f} heartbeats/s "
              f"received of {r['expected_per_s']} sent, control plane CPU {r['cpu_cores']:.2f} cores "
              f"({r['cpu_us_per_heartbeat']:.0f} us per heartbeat: ours {r['our_us_per_heartbeat']:.1f} of it "
              f"timers {r['timer_us_per_heartbeat']:.1f} ({r['timer_fires_per_heartbeat']:.2f} fires), "
              f"gRPC+loop {r['rest_us_per_heartbeat']:.0f}), {r['nodes_per_core']:.0f} nodes per core, "
              f"connected {r['connected']}, false ejections {r['false_ejections']}{det}, "
              f"load avg {r['load_avg']:.2f}, speed index {r['speed_us'] / 1000:.1f} ms, "
              f"clock read {r['clock_read_us']:.1f} us (subtracted)", flush=True)


if __name__ == "__main__":
    main()
