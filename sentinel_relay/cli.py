"""sentinel-relay: run the relay (flags or --config relay.yaml; flags win).

``--workers N`` forks N processes that share the listening port (SO_REUSEPORT; the kernel
spreads connections); worker *i* serves its metrics on the admin port + *i*. Prints
``sentinel-relay ready on HOST:PORT`` (the bound port, also for ``--listen HOST:0``) once
every worker listens. SIGTERM/SIGINT stop it (exit
0); SIGHUP is logged and changes nothing (the config is read at start).

Exit codes: 0 stopped by a signal; 1 runtime failure (a port that cannot be bound: one line
naming ``--listen`` or ``--admin-listen``); 2 bad flags or config (naming the field).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from aiohttp import web

from xds_server.process import event_loop
from xds_server.process.commandline import add_common_options, bind_failure, run_main
from xds_server.process.logs import configure_logging, set_process_field

from .config import RelayConfig, RelayConfigError, load_relay_config

__all__ = ["config_fields", "main", "run_worker"]

log = logging.getLogger("sentinel_relay")

#: ``--sample-prompts`` without a value: seed 002's 5 %.
DEFAULT_SAMPLE_RATIO = 0.05

SIGHUP_IGNORED = "SIGHUP: nothing to reload, still running (the config is read at start: restart to change it)"
_REAP_EVERY_S = 0.1
"""The supervisor looks for exited workers this often (s). A signal that lands between Python's
check for pending signals and a blocking ``waitpid`` leaves its handler waiting until a worker
exits: on a loaded machine a SIGHUP sent on the ready line was logged only at shutdown, 30 s later
(tests/integration/test_three_programs_cli.py). A short wait bounds that to this."""


class StartFailure(Exception):
    """A worker could not start; the message is the one line to print (names the flag)."""


async def _start(cfg: RelayConfig, reuse_port: bool):
    """The started relay; StartFailure naming ``--listen`` when its port cannot be bound."""
    from .server import Relay

    relay = Relay(cfg)
    try:
        return await relay.start(reuse_port=reuse_port)
    except OSError as e:
        await relay.stop()  # closes its client session: no "Unclosed client session" at exit
        raise StartFailure(bind_failure(cfg.listen, "--listen", e)) from e


async def _serve(cfg: RelayConfig, index: int, reuse_port: bool, ready_fd: int | None) -> None:
    from prometheus_client import generate_latest

    from .feed import FeedClient

    relay = await _start(cfg, reuse_port)
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
        where = f"{host}:{int(port) + index if int(port) else 0}"
        try:
            await web.TCPSite(runner, host, int(port) + index if int(port) else 0).start()
        except OSError as e:
            await runner.cleanup()
            await relay.stop()
            raise StartFailure(bind_failure(where, "--admin-listen", e)) from e
        runners.append(runner)
    feed = None
    if cfg.routing_feed:
        feed = FeedClient(cfg.routing_feed, relay.on_node, subscriber_id=f"sentinel-relay-{os.getpid()}",
                          reconnect_max_s=cfg.feed_reconnect_max_s, keepalive_s=cfg.feed_keepalive_s,
                          on_connected=lambda up: relay.metrics.feed_connected.set(1 if up else 0),
                          tls=cfg.feed_tls())
        feed.start()
        if relay.sampler is not None:  # --sample-prompts: sent over the feed's connection
            relay.sampler.start(lambda: feed.channel, feed.subscriber_id)
    if ready_fd is not None:
        os.write(ready_fd, f"r{relay.port}\n".encode())
        os.close(ready_fd)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: log.warning(SIGHUP_IGNORED))
    try:
        await stop.wait()
    finally:
        if relay.sampler is not None:
            await relay.sampler.stop()
        if feed:
            await feed.stop()
        await relay.stop()
        for r in runners:
            await r.cleanup()


def run_worker(cfg: RelayConfig, index: int = 0, reuse_port: bool = False, ready_fd: int | None = None,
               loop: str = "auto") -> None:
    """Run one relay process until SIGTERM/SIGINT. ``loop``: "uvloop", "asyncio" or "auto"
    (uvloop when installed: the ``relay`` extra); :func:`xds_server.process.event_loop.run`.
    A start that fails writes ``E<one line>\n`` on ``ready_fd`` (the supervisor prints it)
    and raises StartFailure."""
    try:
        event_loop.run(_serve(cfg, index, reuse_port, ready_fd), loop)
    except StartFailure as e:
        if ready_fd is None:
            raise
        os.write(ready_fd, b"E" + str(e).encode("utf-8", "replace") + b"\n")
        raise


def _default(name: str) -> str:
    v = RelayConfig.model_fields[name].default
    return "off" if v is None else str(v)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sentinel-relay", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", help="YAML file with RelayConfig fields; flags override it (default: none)")
    p.add_argument("--listen", help=f"HOST:PORT clients connect to (default {_default('listen')})")
    p.add_argument("--upstream", help=f"Envoy's listener URL (default {_default('upstream')})")
    p.add_argument("--routing-feed", action="append",
                   help="control plane routing feed HOST:PORT (its xds.listen); repeat it (or comma-separate) "
                   "for replicas: each reconnect dials the next (default: off, the relay rescues on its own "
                   "evidence)")
    p.add_argument("--feed-tls-ca", dest="feed_tls_ca_file", metavar="PEM",
                   help="dial the routing feed over TLS, verifying the control plane with this CA (default: "
                   "plaintext)")
    p.add_argument("--feed-tls-cert", dest="feed_tls_cert_file", metavar="PEM",
                   help="the relay's client certificate (mutual TLS; default: none)")
    p.add_argument("--feed-tls-key", dest="feed_tls_key_file", metavar="PEM",
                   help="its private key (default: none)")
    p.add_argument("--feed-tls-server-name", dest="feed_tls_server_name",
                   help="name the control plane's certificate must carry (default: the feed's host)")
    p.add_argument("--feed-plaintext", action="store_true", default=None,
                   help="dial a non-loopback routing feed in plaintext (refused unless said; default off)")
    p.add_argument("--admin-listen",
                   help="HOST:PORT of /metrics and /healthz; worker i listens on PORT + i "
                   f"(default {_default('admin_listen')})")
    p.add_argument("--workers", type=int,
                   help=f"processes sharing --listen (SO_REUSEPORT), one per core to scale (default "
                   f"{_default('workers')})")
    p.add_argument("--max-rescues", type=int,
                   help=f"continuation attempts after the first (default {_default('max_rescues')})")
    p.add_argument("--max-resume-tokens", type=int,
                   help=f"most generated tokens re-sent as context on a rescue (default "
                   f"{_default('max_resume_tokens')})")
    p.add_argument("--stall-gap-s", type=float,
                   help=f"silence within a stream that counts as a stall, s (default {_default('stall_gap_s')})")
    p.add_argument("--first-chunk-timeout-s", type=float,
                   help=f"silence before an attempt's first chunk, s (default {_default('first_chunk_timeout_s')})")
    p.add_argument("--ping-interval-s", type=float,
                   help=f"': ping' lines while a rescue prefills, s (default {_default('ping_interval_s')})")
    p.add_argument("--sample-prompts", type=float, nargs="?", const=DEFAULT_SAMPLE_RATIO, metavar="RATIO",
                   help="send this ratio (0..1) of forwarded requests' prompts to the control plane for "
                   f"switch-back validation, over --routing-feed; without RATIO {DEFAULT_SAMPLE_RATIO:g} (5 %%); "
                   "never logged (default 0: off)")
    p.add_argument("--loop", choices=event_loop.LOOPS, default="auto",
                   help="event loop (auto: uvloop when installed; default auto)")
    add_common_options(p, "sentinel-relay")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sentinel-relay`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    return run_main("sentinel-relay", lambda: _run(args), lambda: args.log_level == "DEBUG")


def config_fields(args: argparse.Namespace) -> dict:
    """The RelayConfig fields given as flags (None: not given)."""
    return {k: v for k, v in vars(args).items() if k not in ("config", "log_level", "log_format", "loop")}


def _run(args: argparse.Namespace) -> int:
    fields = config_fields(args)
    if args.config is not None and not os.path.isfile(args.config):
        print(f"sentinel-relay: --config {args.config}: no such file", file=sys.stderr)
        return 2
    try:
        cfg = load_relay_config(args.config, **fields)
    except RelayConfigError as e:
        print(f"sentinel-relay: {e}", file=sys.stderr)
        return 2
    for name, flag in (("feed_tls_ca_file", "--feed-tls-ca"), ("feed_tls_cert_file", "--feed-tls-cert"),
                       ("feed_tls_key_file", "--feed-tls-key")):
        path = getattr(cfg, name)
        if path is not None and not os.path.isfile(path):  # refused now, not at every reconnect
            print(f"sentinel-relay: {flag} ({name}) {path}: no such file", file=sys.stderr)
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
            _child(cfg, 0, False, w, loop_name)
        os.close(w)
        return _supervise([pid], r, cfg)
    pids: list[int] = []
    rfd, wfd = os.pipe()
    for i in range(cfg.workers):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os.close(rfd)
            _child(cfg, i, True, wfd, loop_name)
        pids.append(pid)
    os.close(wfd)
    return _supervise(pids, rfd, cfg)


def _child(cfg: RelayConfig, index: int, reuse_port: bool, ready_fd: int, loop_name: str) -> None:
    """A forked worker: run, then leave without the parent's atexit handlers (exit 1 when its
    start failed; the supervisor prints why)."""
    set_process_field("worker", str(index))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until its loop logs it: never a death
    try:
        run_worker(cfg, index, reuse_port, ready_fd, loop_name)
    except StartFailure:
        os._exit(1)
    os._exit(0)


def _supervise(pids: list[int], ready_r: int, cfg: RelayConfig) -> int:
    signal.signal(signal.SIGHUP, lambda _s, _f: log.warning(SIGHUP_IGNORED))
    ports: list[str] = []  # each worker writes "r<port>\n" once it listens, "E<why>\n" if it cannot
    buf = b""
    while len(ports) < len(pids):
        b = os.read(ready_r, 4096)
        buf += b
        lines = buf.split(b"\n")
        ports = [ln[1:].decode() for ln in lines[:-1] if ln.startswith(b"r")]
        err = next((ln[1:].decode("utf-8", "replace") for ln in lines[:-1] if ln.startswith(b"E")), None)
        if err is not None or not b:
            print(f"sentinel-relay: {err or 'a worker failed to start'}", file=sys.stderr)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for pid in pids:
                os.waitpid(pid, 0)
            return 1
    host = cfg.listen.rpartition(":")[0]
    print(f"sentinel-relay ready on {host}:{ports[0]} ({len(pids)} worker(s))", flush=True)

    def forward(sig: int, _frame: object) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc, left = 0, list(pids)
    while left:  # polled: a signal's Python handler runs within one wait, never only at a worker's exit
        for pid in list(left):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                left.remove(pid)
                rc = rc or os.waitstatus_to_exitcode(status)
        if left:
            time.sleep(_REAP_EVERY_S)
    return rc


if __name__ == "__main__":
    sys.exit(main())
