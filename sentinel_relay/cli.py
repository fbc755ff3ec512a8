"""``sentinel-relay``: run the relay (flags or ``--config relay.yaml``; flags win).

``--workers N`` forks N processes that share the listening port (SO_REUSEPORT; the kernel
spreads connections); worker *i* serves its metrics on the admin port + *i*. Prints
``sentinel-relay ready on HOST:PORT`` once every worker listens.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from xds_server.process import event_loop

from .config import RelayConfig, RelayConfigError, load_relay_config

__all__ = ["main", "run_worker"]

log = logging.getLogger("sentinel_relay")


async def _serve(cfg: RelayConfig, index: int, reuse_port: bool, ready_fd: int | None) -> None:
    from prometheus_client import generate_latest

    from .feed import FeedClient
    from .server import Relay

    relay = await Relay(cfg).start(reuse_port=reuse_port)
    runners = []
    if cfg.admin_listen:
        async def metrics(_req: web.Request) -> web.Response:
            return web.Response(body=generate_latest(relay.metrics.registry),
                                content_type="text/plain", charset="utf-8")

        async def healthz(_req: web.Request) -> web.Response:
            return web.Response(text="ok")
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        host, _, port = cfg.admin_listen.rpartition(":")
        await web.TCPSite(runner, host, int(port) + index if int(port) else 0).start()
        runners.append(runner)
    feed = None
    if cfg.routing_feed:
        feed = FeedClient(cfg.routing_feed, relay.on_node, subscriber_id=f"sentinel-relay-{os.getpid()}",
                          reconnect_max_s=cfg.feed_reconnect_max_s, keepalive_s=cfg.feed_keepalive_s,
                          on_connected=lambda up: relay.metrics.feed_connected.set(1 if up else 0),
                          tls=cfg.feed_tls())
        feed.start()
    if ready_fd is not None:
        os.write(ready_fd, b"r")
        os.close(ready_fd)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        if feed:
            await feed.stop()
        await relay.stop()
        for r in runners:
            await r.cleanup()


def run_worker(cfg: RelayConfig, index: int = 0, reuse_port: bool = False, ready_fd: int | None = None,
               loop: str = "auto") -> None:
    """Run one relay process until SIGTERM/SIGINT. ``loop``: "uvloop", "asyncio" or "auto"
    (uvloop when installed: the ``relay`` extra); :func:`xds_server.process.event_loop.run`."""
    event_loop.run(_serve(cfg, index, reuse_port, ready_fd), loop)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sentinel-relay", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML file with RelayConfig fields")
    p.add_argument("--listen")
    p.add_argument("--upstream", help="Envoy's listener URL")
    p.add_argument("--routing-feed", action="append",
                   help="control plane routing feed HOST:PORT; repeat it (or comma-separate) for "
                   "replicas: each reconnect dials the next")
    p.add_argument("--feed-tls-ca", dest="feed_tls_ca_file", metavar="PEM",
                   help="dial the routing feed over TLS, verifying the control plane with this CA")
    p.add_argument("--feed-tls-cert", dest="feed_tls_cert_file", metavar="PEM",
                   help="the relay's client certificate (mutual TLS)")
    p.add_argument("--feed-tls-key", dest="feed_tls_key_file", metavar="PEM", help="its private key")
    p.add_argument("--feed-tls-server-name", dest="feed_tls_server_name",
                   help="name the control plane's certificate must carry (default: the feed's host)")
    p.add_argument("--feed-plaintext", action="store_true", default=None,
                   help="dial a non-loopback routing feed in plaintext (refused unless said)")
    p.add_argument("--admin-listen")
    p.add_argument("--workers", type=int)
    p.add_argument("--max-rescues", type=int)
    p.add_argument("--max-resume-tokens", type=int)
    p.add_argument("--stall-gap-s", type=float)
    p.add_argument("--first-chunk-timeout-s", type=float)
    p.add_argument("--ping-interval-s", type=float)
    p.add_argument("--loop", choices=event_loop.LOOPS, default="auto",
                   help="event loop (auto: uvloop when installed)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    fields = {k: v for k, v in vars(args).items() if k not in ("config", "log_level", "loop")}
    try:
        cfg = load_relay_config(args.config, **fields)
    except RelayConfigError as e:
        print(f"sentinel-relay: {e}", file=sys.stderr)
        return 2
    try:
        loop_name = event_loop.resolve(args.loop)  # refused before any worker is forked
    except event_loop.LoopUnavailable as e:
        print(f"sentinel-relay: {e}", file=sys.stderr)
        return 2
    if cfg.workers == 1:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os.close(r)
            run_worker(cfg, 0, False, w, loop_name)
            os._exit(0)
        os.close(w)
        return _supervise([pid], r, cfg)
    pids: list[int] = []
    rfd, wfd = os.pipe()
    for i in range(cfg.workers):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os.close(rfd)
            run_worker(cfg, i, True, wfd, loop_name)
            os._exit(0)
        pids.append(pid)
    os.close(wfd)
    return _supervise(pids, rfd, cfg)


def _supervise(pids: list[int], ready_r: int, cfg: RelayConfig) -> int:
    got = 0
    while got < len(pids):
        b = os.read(ready_r, 64)
        if not b:
            print("sentinel-relay: a worker failed to start", file=sys.stderr)
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            return 1
        got += len(b)
    print(f"sentinel-relay ready on {cfg.listen} ({len(pids)} worker(s))", flush=True)

    def forward(sig: int, _frame: object) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        rc = rc or os.waitstatus_to_exitcode(status)
    return rc


if __name__ == "__main__":
    sys.exit(main())
