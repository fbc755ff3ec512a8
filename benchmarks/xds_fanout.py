"""xDS server benchmarks: encode cost per change, push fan-out latency, memory per stream.

    .venv/bin/python benchmarks/xds_fanout.py encode
    .venv/bin/python benchmarks/xds_fanout.py fanout --streams 1000 --endpoints 1000 --variant sotw
    .venv/bin/python benchmarks/xds_fanout.py fanout --streams 100 --endpoints 1000 --variant delta

``encode``: per change of one node's weight in a cluster of N endpoints, the time to build the
ClusterLoadAssignment (resources.build_cla) and to validate + serialize + hash it into the cache
(SnapshotCache.set_resource), i.e. the work done once per change whatever the number of streams.

``fanout``: a server process (SnapshotCache + AdsServicer on grpc.aio, the production code) and a
client process holding S ADS streams (SotW or delta, each subscribed to the cluster, ACKing every
response). Each change marks the cluster dirty and is published as ControlPlane does (at most one
publish per xds.publish.coalesce_window; changes here are 0.5 s apart, so each goes out at once): build,
validate + encode into the cache; every stream wakes, gets its response and ACKs it.
Latency per stream = its receive time - the time of the change (CLOCK_MONOTONIC is shared by both
processes). Per change we take the latency of the last stream to receive it; the report gives
p50/p99 of that over all changes, and p50/p99 over every (stream, change) pair. Memory per stream
= (server RSS with S streams subscribed - RSS before any stream) / S.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xds_server.config import XdsConfig, parse_config
from xds_server.health.model import Routing
from xds_server.testing import process_cpu_s
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.resources import (
    CLA_TYPE_URL,
    CLUSTER_TYPE_URL,
    RESOURCE_TYPES,
    build_cla,
    build_cluster,
)

CDS, EDS = CLUSTER_TYPE_URL, CLA_TYPE_URL


def cluster_of(n: int):
    """A cluster of ``n`` endpoints over 4 zones (priority 0), as a ClusterConfig."""
    nodes = [{"id": f"n{i:05d}", "address": f"10.{i // 62500}.{(i // 250) % 250}.{i % 250 + 1}:8000",
              "probe_address": "127.0.0.1:1", "locality": {"region": "r1", "zone": f"z{i % 4}"}}
             for i in range(n)]
    return parse_config({"clusters": [{"name": "llm", "nodes": nodes}]}).clusters[0]


def routing_of(c, changed: int = -1, weight: int = 100) -> dict[str, Routing]:
    return {n.id: Routing(weight if i == changed else 100, "HEALTHY") for i, n in enumerate(c.nodes)}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100.0 * (len(xs) - 1))))
    return xs[k]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- encode ----------------------------------------------------------------------------------


def bench_encode(sizes: list[int], changes: int) -> None:
    print("| endpoints | CLA bytes | build_cla p50 / p99 (ms) | validate+encode p50 / p99 (ms) | total p50 (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for n in sizes:
        c = cluster_of(n)
        cache = SnapshotCache(validators={tu: t.validate for tu, t in RESOURCE_TYPES.items()})
        cache.set_resource(EDS, "llm", build_cla(c, routing_of(c)))
        builds, encodes = [], []
        reps = changes if n <= 1000 else max(5, changes // 4)
        for k in range(reps):
            t0 = time.perf_counter()
            cla = build_cla(c, routing_of(c, changed=k % n, weight=30 + k % 50))
            t1 = time.perf_counter()
            cache.set_resource(EDS, "llm", cla)
            t2 = time.perf_counter()
            builds.append((t1 - t0) * 1e3)
            encodes.append((t2 - t1) * 1e3)
        size = cache.resources(EDS)["llm"].any.ByteSize()
        totals = [a + b for a, b in zip(builds, encodes, strict=True)]
        print(f"| {n:,} | {size:,} | {pct(builds, 50):.2f} / {pct(builds, 99):.2f} | "
              f"{pct(encodes, 50):.2f} / {pct(encodes, 99):.2f} | {pct(totals, 50):.2f} |")


# ---- fan-out: server process -------------------------------------------------------------------


async def run_server(endpoints: int, window_ms: float) -> None:
    import grpc

    from xds_server.xds.ads import AdsServicer

    c = cluster_of(endpoints)
    cache = SnapshotCache(validators={tu: t.validate for tu, t in RESOURCE_TYPES.items()})
    cache.set_resources(CDS, {"llm": build_cluster(c)})
    cache.set_resource(EDS, "llm", build_cla(c, routing_of(c)))
    servicer = AdsServicer(cache)
    limit = XdsConfig().limits.max_receive_message_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
    servicer.add_to_server(server)  # as ControlPlane.start() does
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.get_running_loop()
    # The health model's output for each change, computed ahead: what is timed is the xDS path
    # (coalescing window, build_cla, validate + encode, fan-out), not the benchmark's own dicts.
    routings = [routing_of(c, changed=kk % endpoints, weight=1 + kk % 97) for kk in range(97)]
    print(json.dumps({"port": port, "rss": rss_bytes()}), flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    k = 0
    last_publish = [float("-inf")]
    while True:
        line = (await reader.readline()).decode().strip()
        if not line or line == "quit":
            break
        if line == "status":
            acked = sum(1 for s in servicer.streams.values()
                        if EDS in s.types and s.types[EDS].acked_nonce
                        and s.types[EDS].acked_nonce == s.types[EDS].last_nonce)
            print(json.dumps({"streams": len(servicer.streams), "acked": acked, "rss": rss_bytes()}), flush=True)
        elif line == "change":
            # The control plane's publishing path: a health change marks the cluster dirty, the
            # assignment is built and stored at most once per coalescing window (server.py).
            k += 1
            t0 = time.monotonic_ns()
            done = loop.create_future()

            def publish(kk=k, fut=done) -> None:
                last_publish[0] = loop.time()
                cache.set_resource(EDS, "llm", build_cla(c, routings[kk % 97]))
                fut.set_result(time.monotonic_ns())

            delay_s = last_publish[0] + window_ms / 1000.0 - loop.time()  # as ControlPlane._mark_dirty
            if delay_s > 0:
                loop.call_later(delay_s, publish)
            else:
                loop.call_soon(publish)
            t_pub = await done
            ver = cache.resources(EDS)["llm"].version
            print(json.dumps({"t0": t0, "t_pub": t_pub, "version": ver, "type_version": cache.type_version(EDS)}),
                  flush=True)
    await server.stop(0)


# ---- fan-out: client process -------------------------------------------------------------------


async def run_clients(port: int, streams: int, variant: str, channels: int) -> None:
    import grpc
    from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(channels)]
    received: list[tuple[str, int]] = []  # (version, monotonic ns)
    ready = 0

    async def one(i: int) -> None:
        nonlocal ready
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(chans[i % channels])
        if variant == "sotw":
            call = stub.StreamAggregatedResources()
            req = discovery_pb2.DiscoveryRequest(type_url=CDS)
            req.node.id = f"bench-{i}"
            await call.write(req)
            cds = await call.read()
            await call.write(discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=["llm"]))
            await call.write(discovery_pb2.DiscoveryRequest(type_url=CDS, version_info=cds.version_info,
                                                            response_nonce=cds.nonce))
            first = True
            while True:
                r = await call.read()
                if r is grpc.aio.EOF:
                    return
                t = time.monotonic_ns()
                if not first:
                    received.append((r.version_info, t))
                else:
                    ready += 1
                first = False
                await call.write(discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=["llm"],
                                                                version_info=r.version_info, response_nonce=r.nonce))
        else:
            call = stub.DeltaAggregatedResources()
            req = discovery_pb2.DeltaDiscoveryRequest(type_url=CDS)
            req.node.id = f"bench-{i}"
            await call.write(req)
            cds = await call.read()
            await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=["llm"]))
            await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=CDS, response_nonce=cds.nonce))
            first = True
            while True:
                r = await call.read()
                if r is grpc.aio.EOF:
                    return
                t = time.monotonic_ns()
                if not first:
                    received.append((r.system_version_info, t))
                else:
                    ready += 1
                first = False
                await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=EDS, response_nonce=r.nonce))

    tasks = []
    for i in range(streams):
        tasks.append(asyncio.create_task(one(i)))
        if i % 50 == 49:
            await asyncio.sleep(0.05)  # do not stampede the server's accept path
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"opened": streams}), flush=True)
    while True:
        line = (await reader.readline()).decode().strip()
        if not line or line == "quit":
            break
        if line == "status":
            print(json.dumps({"ready": ready, "received": len(received)}), flush=True)
        elif line == "dump":
            print(json.dumps({"received": received}), flush=True)
    for t in tasks:
        t.cancel()
    for ch in chans:
        await ch.close()


# ---- fan-out: driver ---------------------------------------------------------------------------


def bench_fanout(streams: int, endpoints: int, variant: str, changes: int, window_ms: float, gap_s: float,
                 channels: int) -> dict:
    py = sys.executable
    me = str(Path(__file__).resolve())
    srv = subprocess.Popen([py, me, "_server", "--endpoints", str(endpoints), "--window-ms", str(window_ms)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    cli = None
    try:
        hello = json.loads(srv.stdout.readline())
        rss0 = hello["rss"]

        def srv_cmd(cmd: str) -> dict:
            srv.stdin.write(cmd + "\n")
            srv.stdin.flush()
            return json.loads(srv.stdout.readline())

        cli = subprocess.Popen([py, me, "_clients", "--port", str(hello["port"]), "--streams", str(streams),
                                "--variant", variant, "--channels", str(channels)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        json.loads(cli.stdout.readline())
        deadline = time.monotonic() + 120
        while True:
            st = srv_cmd("status")
            if st["acked"] >= streams:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {st['acked']} of {streams} streams subscribed")
            time.sleep(0.2)
        time.sleep(1.0)
        rss1 = srv_cmd("status")["rss"]
        cpu0 = {"server": process_cpu_s(srv.pid), "clients": process_cpu_s(cli.pid)}
        events = []
        for _ in range(changes):
            events.append(srv_cmd("change"))
            time.sleep(gap_s)
        time.sleep(1.0)
        cpu1 = {"server": process_cpu_s(srv.pid), "clients": process_cpu_s(cli.pid)}
        cli.stdin.write("dump\n")
        cli.stdin.flush()
        received = json.loads(cli.stdout.readline())["received"]
    finally:
        for p in (cli, srv):
            if p is not None:
                try:
                    p.stdin.write("quit\n")
                    p.stdin.flush()
                    p.wait(10)
                except Exception:
                    p.kill()
    by_version: dict[str, list[int]] = {}
    for ver, t in received:
        by_version.setdefault(ver, []).append(t)
    last_ms, all_ms, publish_ms, missing = [], [], [], 0
    for ev in events:
        times = by_version.get(ev["type_version"], [])
        if len(times) < streams:
            missing += streams - len(times)
        if not times:
            continue
        lat = [(t - ev["t0"]) / 1e6 for t in times]
        last_ms.append(max(lat))
        all_ms.extend(lat)
        publish_ms.append((ev["t_pub"] - ev["t0"]) / 1e6)
    return {
        "variant": variant, "streams": streams, "endpoints": endpoints, "changes": changes,
        "window_ms": window_ms,
        "last_stream_p50_ms": pct(last_ms, 50), "last_stream_p99_ms": pct(last_ms, 99),
        "per_stream_p50_ms": pct(all_ms, 50), "per_stream_p99_ms": pct(all_ms, 99),
        "change_to_cache_p50_ms": pct(publish_ms, 50),
        "missing_deliveries": missing,
        "rss_per_stream_kib": (rss1 - rss0) / streams / 1024,
        "server_cpu_ms_per_change": (cpu1["server"] - cpu0["server"]) * 1e3 / changes,
        "clients_cpu_ms_per_change": (cpu1["clients"] - cpu0["clients"]) * 1e3 / changes,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("encode")
    e.add_argument("--sizes", default="10,100,1000,10000")
    e.add_argument("--changes", type=int, default=40)
    f = sub.add_parser("fanout")
    f.add_argument("--streams", type=int, default=1000)
    f.add_argument("--endpoints", type=int, default=1000)
    f.add_argument("--variant", choices=["sotw", "delta"], default="sotw")
    f.add_argument("--changes", type=int, default=30)
    f.add_argument("--window-ms", type=float, default=XdsConfig().publish.coalesce_window.ms)
    f.add_argument("--gap-s", type=float, default=0.5, help="pause between changes")
    f.add_argument("--channels", type=int, default=8, help="client HTTP/2 connections")
    s = sub.add_parser("_server")
    s.add_argument("--endpoints", type=int, required=True)
    s.add_argument("--window-ms", type=float, required=True)
    c = sub.add_parser("_clients")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--streams", type=int, required=True)
    c.add_argument("--variant", required=True)
    c.add_argument("--channels", type=int, required=True)
    a = p.parse_args(argv)
    if a.cmd == "encode":
        bench_encode([int(x) for x in a.sizes.split(",")], a.changes)
    elif a.cmd == "fanout":
        r = bench_fanout(a.streams, a.endpoints, a.variant, a.changes, a.window_ms, a.gap_s, a.channels)
        print(json.dumps(r, indent=1))
    elif a.cmd == "_server":
        if os.environ.get("XDS_BENCH_PROFILE"):  # profile the server: stats written at exit
            import cProfile

            cProfile.runctx("asyncio.run(run_server(a.endpoints, a.window_ms))", globals(), locals(),
                            os.environ["XDS_BENCH_PROFILE"])
        else:
            asyncio.run(run_server(a.endpoints, a.window_ms))
    elif a.cmd == "_clients":
        asyncio.run(run_clients(a.port, a.streams, a.variant, a.channels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
