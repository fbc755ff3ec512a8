"""``xds-server`` command line.

Commands: serve | check-config | config-reference | status | drain | undrain | reload | shift |
envoy-bootstrap | demo. Global options (``--log-level``, ``--log-format``) are accepted before or
after the command. Exit codes (also in ``--help`` and docs/monitoring.md): 0 success; 1 runtime
failure (port in use, admin endpoint unreachable, Envoy binary missing, demo failed); 2 bad usage
or invalid configuration (the message names the option or the config field); 3 refused by the
server (missing or wrong admin token, unknown node, invalid new config).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import urllib.parse
from pathlib import Path

from xds_server.admin.client import AdminError, admin_base_url, drain_line, get_json, post_json
from xds_server.admin.shift_client import add_shift_parser
from xds_server.admin.status_text import format_status
from xds_server.envoy.bootstrap_command import add_bootstrap_parser
from xds_server.process import event_loop, gc_tuning
from xds_server.process.commandline import add_common_options, run_main, version
from xds_server.process.logs import configure_logging, quiet_grpc_core, set_replica

__all__ = ["EXIT_CODES", "TOKEN_ENV", "admin_base_url", "main"]  # admin_base_url: xds_server.admin.client

TOKEN_ENV = "XDS_SENTINEL_ADMIN_TOKEN"
EXIT_CODES = {
    0: "success",
    1: "runtime failure (port in use, admin endpoint unreachable, Envoy binary missing, demo failed)",
    2: "bad usage or invalid configuration (the message names the option or config field)",
    3: "refused by the server (missing or wrong admin token, unknown node, invalid new config)",
}


def _config_arg(args: argparse.Namespace) -> str | None:
    pos, opt = getattr(args, "config_pos", None), getattr(args, "config", None)
    if pos and opt and pos != opt:
        print(f"xds-server: config given twice ({pos!r} and --config {opt!r})", file=sys.stderr)
        return None
    path = pos or opt
    if not path:
        print("xds-server: a config file is required (CONFIG or --config CONFIG)", file=sys.stderr)
    return path


def _serve(args: argparse.Namespace) -> int:
    path = _config_arg(args)
    if path is None:
        return 2
    try:
        loop_name = event_loop.resolve(args.loop)  # refused before the config is read
    except event_loop.LoopUnavailable as e:
        print(f"xds-server: {e}", file=sys.stderr)
        return 2
    cfg = _load(path)
    if cfg is None:
        return 2
    from xds_server.server import ControlPlane

    set_replica(cfg.xds.replica_id)
    for note in cfg.notes():
        logging.getLogger("xds_server.server").warning("%s", note)

    async def run() -> int:
        gc_tuning.tune()  # long pauses of full collections at thousands of nodes (the module's docstring)
        cp = ControlPlane(cfg, config_path=path)
        stop, started = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        got: list[str] = []  # the signal that asked to stop
        reloads: set[asyncio.Task] = set()

        def on_stop(name: str) -> None:
            got.append(name)
            stop.set()

        async def reload_when_started() -> None:
            await started.wait()  # a SIGHUP during start reloads once the servers are up
            await cp.reload_file("SIGHUP")

        def on_hup() -> None:  # reload the config file; a bad file is logged and changes nothing
            t = loop.create_task(reload_when_started())
            reloads.add(t)
            t.add_done_callback(reloads.discard)

        # handlers before the ready lines: a SIGHUP sent on "listening" reloads (never exit 129)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_stop, sig.name)
        loop.add_signal_handler(signal.SIGHUP, on_hup)
        try:
            await cp.start()
        except OSError as e:
            print(f"xds-server: {e}", file=sys.stderr)
            await cp.stop()
            return 1
        started.set()
        print(f"xds-server ADS listening on {cfg.xds.listen.rpartition(':')[0]}:{cp.xds_port}", flush=True)
        print(f"xds-server admin listening on {'https' if cfg.admin.tls else 'http'}://{cfg.admin.listen.rpartition(':')[0]}:{cp.admin_port}",
              flush=True)
        logging.getLogger("xds_server.server").info("event loop: %s", event_loop.running_loop_name())
        await stop.wait()
        log = logging.getLogger("xds_server.server")
        log.info("%s: stopping", got[0])
        await cp.stop()
        log.info("stopped")
        return 0

    return event_loop.run(run(), loop_name)


def _load(path: str):
    """The config at ``path``; None after printing why it was refused (``xds_server.config`` is
    imported here, so commands that do not read a config start without pydantic's models)."""
    from xds_server.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        print(f"xds-server: {e}", file=sys.stderr)
        return None


def _config_reference(args: argparse.Namespace) -> int:
    """Print (or write to ``-o``) the configuration reference generated from the models."""
    from xds_server.config.reference import render_reference

    text = render_reference()
    _ = Path(args.output).write_text(text, encoding="utf-8") if args.output else sys.stdout.write(text)
    return 0


def _check_config(args: argparse.Namespace) -> int:
    path = _config_arg(args)
    if path is None:
        return 2
    cfg = _load(path)
    if cfg is None:
        return 2
    if args.rewrite:  # the file in today's names on stdout; what changed on stderr
        from xds_server.config import rewritten_yaml

        sys.stdout.write(rewritten_yaml(path))
        for note in cfg.notes():
            print(f"note: {note}", file=sys.stderr)
        return 0
    n = sum(len(c.nodes) for c in cfg.clusters)
    print(f"{path}: OK ({len(cfg.clusters)} cluster(s), {n} node(s))")
    for note in cfg.notes():
        print(f"note: {note}")
    return 0


def _status(args: argparse.Namespace) -> int:
    try:
        data = get_json(admin_base_url(args.admin), "/nodes")
    except ValueError as e:
        print(f"xds-server: {e}", file=sys.stderr)
        return 2
    except AdminError as e:
        print(f"xds-server: {e}", file=sys.stderr)
        return e.code
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for line in format_status(data):
        print(line)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from xds_server.demo import run_demo

    return run_demo(keep_running=args.keep_running, envoy_binary=args.envoy_binary)


def _post(args: argparse.Namespace, path: str) -> dict | None:
    """POST ``path`` on the admin endpoint with the bearer token: its JSON answer, or None after
    printing one line saying why not (``args.rc``: the exit code)."""
    args.rc = 2
    try:
        base = admin_base_url(args.admin)
    except ValueError as e:
        print(f"xds-server: {e}", file=sys.stderr)
        return None
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        print(f"xds-server: an admin token is required (--token or ${TOKEN_ENV})", file=sys.stderr)
        return None
    try:
        return post_json(base, path, token)
    except AdminError as e:
        print(f"xds-server: {e}", file=sys.stderr)
        args.rc = e.code
        return None


def _reload(args: argparse.Namespace) -> int:
    body = _post(args, "/reload")
    if body is None:
        return int(args.rc)
    print(json.dumps(body, indent=2))
    return 0


def _drain(args: argparse.Namespace) -> int:
    q = urllib.parse.urlencode({"reason": args.reason}) if args.reason else ""
    path = f"/nodes/{urllib.parse.quote(args.node, safe='')}/{args.cmd}" + (f"?{q}" if q else "")
    body = _post(args, path)
    if body is None:
        return int(args.rc)
    print(json.dumps(body, indent=2) if args.json else drain_line(args.cmd, body))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``xds-server`` argument parser (global options accepted before or after the command)."""
    glob = argparse.ArgumentParser(add_help=False)
    g = glob.add_argument_group("global options")
    # suppress: an option given after the command must not be reset by the subparser's default
    add_common_options(g, "xds-server", with_version=False, suppress=True)
    epilog = "exit codes:\n" + "\n".join(f"  {k}  {v}" for k, v in EXIT_CODES.items())
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="xds-server", parents=[glob], epilog=epilog, formatter_class=fmt,
                                description="Health-aware Envoy control plane for LLM fleets")
    p.add_argument("--version", action="version", version=f"xds-server {version()}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def cmd(name: str, help_: str, fn) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_, parents=[glob], epilog=epilog, formatter_class=fmt)
        sp.set_defaults(fn=fn)
        return sp

    for name, help_, fn in (("serve", "run the control plane", _serve),
                            ("check-config", "validate a config file and exit", _check_config)):
        sp = cmd(name, help_, fn)
        sp.add_argument("config_pos", nargs="?", metavar="CONFIG", help="YAML config file")
        sp.add_argument("--config", help="YAML config file (same as CONFIG; one of the two is required, no default)")
        if name == "check-config":
            sp.add_argument("--rewrite", action="store_true",
                            help="print the file with the names of earlier releases in their new places "
                                 "(comments are not kept; the notes go to stderr; default: off, check only)")
        if name == "serve":
            sp.add_argument("--loop", choices=event_loop.LOOPS, default="asyncio",
                            help="event loop of this process and its probe workers (default asyncio; "
                                 "uvloop: ~9 %% less CPU per heartbeat, pip install 'xds-sentinel[uvloop]'; "
                                 "auto: uvloop when installed)")
    ref = cmd("config-reference", "print every config key with its default, unit and source (docs/config.md)",
              _config_reference)
    ref.add_argument("-o", "--output", help="write to this file (default: stdout)")
    admin_help = "admin endpoint: HOST:PORT or http(s)://HOST:PORT (default 127.0.0.1:19000)"
    st = cmd("status", "print node states from a running server's admin endpoint", _status)
    st.add_argument("--admin", default="http://127.0.0.1:19000", help=admin_help)
    st.add_argument("--json", action="store_true", help="print the /nodes JSON (default: a table)")
    for name, help_ in (("drain", "drain a node (published DRAINING at once)"),
                        ("undrain", "end a node's drain")):
        dr = cmd(name, help_, _drain)
        dr.add_argument("node", metavar="NODE", help="node id")
        dr.add_argument("--admin", default="http://127.0.0.1:19000", help=admin_help)
        dr.add_argument("--token", default=None, help=f"admin token (default: ${TOKEN_ENV})")
        dr.add_argument("--reason", default=None, help="recorded in events (default: operator)")
        dr.add_argument("--json", action="store_true", help="print the node's full record (default: one line)")
    rl = cmd("reload", "re-read the running server's config file", _reload)
    rl.add_argument("--admin", default="http://127.0.0.1:19000", help=admin_help)
    rl.add_argument("--token", default=None, help=f"admin token (default: ${TOKEN_ENV})")
    add_shift_parser(cmd, admin_help, TOKEN_ENV)  # gated shifts: xds_server/admin/shift_client.py
    add_bootstrap_parser(cmd)  # xds_server/envoy/bootstrap_command.py
    d = cmd("demo", "local demo: real Envoy, simulated engines, injected faults", _demo)
    d.add_argument("--keep-running", action="store_true",
                   help="stay up until Ctrl-C (no faults; default: run the faults and exit)")
    d.add_argument("--envoy-binary", default=None, help="path to envoy (default: `envoy` on PATH)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``xds-server`` console script; returns the exit code."""
    quiet_grpc_core()
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "INFO")
    configure_logging(level, getattr(args, "log_format", "text"))
    return run_main("xds-server", lambda: int(args.fn(args)), lambda: level == "DEBUG")


if __name__ == "__main__":
    sys.exit(main())
