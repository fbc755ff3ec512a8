"""Hostile xDS clients (issue 9): memory left by closed streams, and a good client's EDS delivery
while another stream floods. Each is measured on this tree ("after") and, with ``--before REV``,
on the xds_server of a git revision exported to a temporary directory ("before"), in one run.

    .venv/bin/python benchmarks/xds_hostile.py rss --streams 200 --names 20000 --before e1b7d95
    .venv/bin/python benchmarks/xds_hostile.py flood --quiet-s 10 --flood-s 20 --before e1b7d95

``rss``: a server process (SnapshotCache + AdsServicer on grpc.aio, as ControlPlane runs them);
the benchmark opens S streams one after another, each naming N EDS resources (SotW: one
DiscoveryRequest; delta: one DeltaDiscoveryRequest subscribing them), reads the answer and
closes the stream. Server RSS (VmRSS) is read after a warm-up of 5 such streams and again once
the server has no stream open. Goal (issue 9): within 20 MB of the start.

``flood``: a server that publishes a new assignment of cluster ``llm`` every ``--interval-ms``
(the change number is the endpoint weight), a good delta client (this process) that ACKs every
response, and, after ``--quiet-s``, a flooder process that writes SotW requests of 40,000 names
(1.7 MB, as in issue 9) on one stream as fast as the server takes them, for ``--flood-s``.
Delivery latency = the good client's receive time - the server's publish time (CLOCK_MONOTONIC is
shared by the processes). Goal (issue 9): p99 while flooding within 2x of quiet.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SERVICE = "/envoy.service.discovery.v3.AggregatedDiscoveryService/"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, round(p / 100.0 * (len(xs) - 1))))]


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- server process (imports xds_server from --root) -------------------------------------------


async def run_server(interval_ms: float) -> None:
    import grpc

    from xds_server.config import XdsConfig, parse_config
    from xds_server.health.model import Routing
    from xds_server.xds.ads import AdsServicer
    from xds_server.xds.cache import SnapshotCache
    from xds_server.xds.resources import CLA_TYPE_URL, CLUSTER_TYPE_URL, RESOURCE_TYPES, build_cla, build_cluster

    cfg = parse_config({"clusters": [{"name": "llm", "nodes": [
        {"id": f"n{i}", "address": f"10.0.0.{i + 1}:8000", "probe_address": "127.0.0.1:1"} for i in range(8)]}]})
    c = cfg.clusters[0]
    cache = SnapshotCache(validators={tu: t.validate for tu, t in RESOURCE_TYPES.items()})
    cache.set_resources(CLUSTER_TYPE_URL, {"llm": build_cluster(c)})
    cache.set_resource(CLA_TYPE_URL, "llm", build_cla(c, {n.id: Routing(1, "HEALTHY") for n in c.nodes}))
    servicer = AdsServicer(cache)
    limit = XdsConfig().limits.max_receive_message_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
    servicer.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    published: dict[int, float] = {}
    loop = asyncio.get_running_loop()

    async def publisher() -> None:
        k = 1
        while True:
            await asyncio.sleep(interval_ms / 1000.0)
            k += 1
            published[k] = time.monotonic()
            cache.set_resource(CLA_TYPE_URL, "llm", build_cla(c, {n.id: Routing(k, "HEALTHY") for n in c.nodes}))

    pub = asyncio.create_task(publisher()) if interval_ms > 0 else None
    import xds_server

    print(json.dumps({"port": port, "code": xds_server.__file__}), flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = (await reader.readline()).decode().strip()
        if not line or line == "quit":
            break
        if line == "status":
            print(json.dumps({"streams": len(servicer.streams), "rss": rss_of(os.getpid())}), flush=True)
        elif line == "published":
            print(json.dumps({str(k): t for k, t in published.items()}), flush=True)
    if pub:
        pub.cancel()
    await server.stop(0)


class Server:
    """A server subprocess running the xds_server found under ``root``."""

    def __init__(self, root: Path, interval_ms: float = 0.0) -> None:
        env = dict(os.environ, PYTHONPATH=str(root))
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "benchmarks" / "xds_hostile.py"), "_server", "--interval-ms", str(interval_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=str(root), text=True)
        hello = json.loads(self.proc.stdout.readline())
        self.port = hello["port"]
        assert hello["code"].startswith(str(root)), hello  # the tree asked for, not the installed one

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(10)
        except Exception:  # make sure it is gone
            self.proc.kill()
            self.proc.wait()


def export(rev: str) -> tuple[Path, tempfile.TemporaryDirectory]:
    """``xds_server/`` and ``node_probe/`` of git revision ``rev`` in a temporary directory."""
    tmp = tempfile.TemporaryDirectory(prefix="xds-before-")
    archive = subprocess.run(["git", "-C", str(HERE), "archive", rev, "xds_server", "node_probe"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp.name], input=archive, check=True)
    return Path(tmp.name), tmp


# ---- rss ---------------------------------------------------------------------------------------


async def bench_rss(root: Path, variant: str, streams: int, names: int) -> dict:
    import grpc
    from envoy.service.discovery.v3 import discovery_pb2

    eds = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
    srv = Server(root)
    try:
        async def one(i: int) -> None:
            ns = [f"stream-{i:04d}-cluster-name-{j:06d}" for j in range(names)] + ["llm"]
            if variant == "sotw":
                req = discovery_pb2.DiscoveryRequest(type_url=eds, resource_names=ns)
            else:
                req = discovery_pb2.DeltaDiscoveryRequest(type_url=eds, resource_names_subscribe=ns)
            req.node.id = f"big-{i}"
            async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
                method = "StreamAggregatedResources" if variant == "sotw" else "DeltaAggregatedResources"
                call = ch.stream_stream(SERVICE + method, request_serializer=None, response_deserializer=None)()
                await call.write(req.SerializeToString())
                await asyncio.wait_for(call.read(), 60)
                call.cancel()

        async def idle() -> dict:
            for _ in range(500):
                st = srv.ask("status")
                if st["streams"] == 0:
                    return st
                await asyncio.sleep(0.02)
            return st

        for i in range(5):
            await one(i)
        start = (await idle())["rss"]
        t0 = time.monotonic()
        for i in range(5, 5 + streams):
            await one(i)
        took = time.monotonic() - t0
        await asyncio.sleep(0.5)
        end = (await idle())["rss"]
        return {"variant": variant, "start_mb": start / 1e6, "end_mb": end / 1e6,
                "growth_mb": (end - start) / 1e6, "seconds": took}
    finally:
        srv.stop()


# ---- flood -------------------------------------------------------------------------------------


async def run_flooder(port: int, seconds: float) -> None:
    import grpc
    from envoy.service.discovery.v3 import discovery_pb2

    eds = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
    names = [f"flood-cluster-with-a-long-name-{j:06d}" for j in range(40_000)]
    reqs = [discovery_pb2.DiscoveryRequest(type_url=eds, resource_names=names[k:]).SerializeToString()
            for k in range(2)]
    sent = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                         options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        call = ch.stream_stream(SERVICE + "StreamAggregatedResources", request_serializer=None,
                                response_deserializer=None)()

        async def drain() -> None:
            while True:
                if await call.read() is grpc.aio.EOF:
                    return

        reader = asyncio.create_task(drain())
        started = time.monotonic()
        end = started + seconds
        try:
            while time.monotonic() < end:
                await asyncio.wait_for(call.write(reqs[sent % 2]), max(0.01, end - time.monotonic()))
                sent += 1
        except (TimeoutError, grpc.aio.AioRpcError):
            pass
        call.cancel()
        reader.cancel()
    print(json.dumps({"sent": sent, "bytes": sent * len(reqs[0]), "started": started}), flush=True)


async def bench_flood(root: Path, quiet_s: float, flood_s: float, interval_ms: float) -> dict:
    import grpc
    from envoy.config.endpoint.v3 import endpoint_pb2
    from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

    cds = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
    eds = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
    srv = Server(root, interval_ms)
    received: list[tuple[int, float]] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            q: asyncio.Queue = asyncio.Queue()

            async def requests():
                while True:
                    item = await q.get()
                    if item is None:
                        return
                    yield item

            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch).DeltaAggregatedResources(requests())
            first = discovery_pb2.DeltaDiscoveryRequest(type_url=cds)
            first.node.id = "good"
            await q.put(first)
            await q.put(discovery_pb2.DeltaDiscoveryRequest(type_url=eds, resource_names_subscribe=["llm"]))

            async def read() -> None:
                async for resp in call:
                    now = time.monotonic()
                    await q.put(discovery_pb2.DeltaDiscoveryRequest(type_url=resp.type_url, response_nonce=resp.nonce))
                    if resp.type_url == eds and resp.resources:
                        m = endpoint_pb2.ClusterLoadAssignment()
                        resp.resources[0].resource.Unpack(m)
                        received.append((m.endpoints[0].lb_endpoints[0].load_balancing_weight.value, now))

            reader = asyncio.create_task(read())
            await asyncio.sleep(quiet_s)
            t_flood = time.monotonic()
            env = dict(os.environ, PYTHONPATH=str(HERE))
            flooder = await asyncio.create_subprocess_exec(
                sys.executable, str(HERE / "benchmarks" / "xds_hostile.py"), "_flooder", "--port", str(srv.port),
                "--seconds", str(flood_s), stdout=subprocess.PIPE, env=env)
            out, _ = await flooder.communicate()
            flood_stats = json.loads(out.decode().strip().splitlines()[-1])
            t_end = time.monotonic()
            published = {int(k): t for k, t in srv.ask("published").items()}
            await q.put(None)
            reader.cancel()
            call.cancel()
    finally:
        srv.stop()
    lat_quiet, lat_flood = [], []
    for k, t in received:
        if k not in published:
            continue
        lat = (t - published[k]) * 1e3
        if published[k] < t_flood - 0.5 and published[k] > 1.0 + min(published.values()):
            lat_quiet.append(lat)
        elif flood_stats["started"] <= published[k] < t_end - 0.5:  # from the flooder's first request
            lat_flood.append(lat)
    return {"quiet_n": len(lat_quiet), "quiet_p50_ms": pct(lat_quiet, 50), "quiet_p99_ms": pct(lat_quiet, 99),
            "flood_n": len(lat_flood), "flood_p50_ms": pct(lat_flood, 50), "flood_p99_ms": pct(lat_flood, 99),
            "flood_sent": flood_stats["sent"], "flood_mb": flood_stats["bytes"] / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rss")
    r.add_argument("--streams", type=int, default=200)
    r.add_argument("--names", type=int, default=20_000)
    r.add_argument("--variants", default="sotw,delta")
    r.add_argument("--before", default=None, help="git revision to measure as 'before'")
    f = sub.add_parser("flood")
    f.add_argument("--quiet-s", type=float, default=10.0)
    f.add_argument("--flood-s", type=float, default=20.0)
    f.add_argument("--interval-ms", type=float, default=20.0)
    f.add_argument("--before", default=None)
    s = sub.add_parser("_server")
    s.add_argument("--interval-ms", type=float, default=0.0)
    fl = sub.add_parser("_flooder")
    fl.add_argument("--port", type=int, required=True)
    fl.add_argument("--seconds", type=float, required=True)
    a = ap.parse_args()
    if a.cmd == "_server":
        asyncio.run(run_server(a.interval_ms))
        return
    if a.cmd == "_flooder":
        asyncio.run(run_flooder(a.port, a.seconds))
        return
    trees = [("after", HERE, None)]
    if a.before:
        root, tmp = export(a.before)
        trees.insert(0, (f"before ({a.before})", root, tmp))
    if a.cmd == "rss":
        print("| code | variant | streams x names | RSS start (MB) | RSS after all closed (MB) | growth (MB) "
              "| time (s) |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for label, root, _ in trees:
            for variant in a.variants.split(","):
                res = asyncio.run(bench_rss(root, variant, a.streams, a.names))
                print(f"| {label} | {variant} | {a.streams} x {a.names:,} | {res['start_mb']:.0f} "
                      f"| {res['end_mb']:.0f} | "
                      f"{res['growth_mb']:+.1f} | {res['seconds']:.1f} |", flush=True)
    else:
        print("| code | quiet p50 / p99 (ms) | flooding p50 / p99 (ms) | p99 ratio | flood sent (requests, MB) "
              "| samples quiet / flood |")
        print("|---|---:|---:|---:|---:|---:|")
        for label, root, _ in trees:
            res = asyncio.run(bench_flood(root, a.quiet_s, a.flood_s, a.interval_ms))
            print(f"| {label} | {res['quiet_p50_ms']:.1f} / {res['quiet_p99_ms']:.1f} | "
                  f"{res['flood_p50_ms']:.1f} / {res['flood_p99_ms']:.1f} | "
                  f"{res['flood_p99_ms'] / res['quiet_p99_ms']:.1f}x | {res['flood_sent']}, {res['flood_mb']:.0f} | "
                  f"{res['quiet_n']} / {res['flood_n']} |", flush=True)


if __name__ == "__main__":
    main()
