"""``xds-server`` command line: serve | check-config | status | demo.

Exit codes: 0 success; 1 runtime failure (port in use, Envoy binary missing, demo failed);
2 bad usage or invalid configuration.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import urllib.error
import urllib.request

from xds_server.config import ConfigError, load_config

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"xds-server: {e}", file=sys.stderr)
        return 2
    from xds_server.server import ControlPlane

    async def run() -> int:
        cp = ControlPlane(cfg)
        try:
            await cp.start()
        except OSError as e:
            print(f"xds-server: {e}", file=sys.stderr)
            await cp.stop()
            return 1
        print(f"xds-server ADS listening on {cfg.xds.listen.rpartition(':')[0]}:{cp.xds_port}", flush=True)
        print(f"xds-server admin listening on http://{cfg.admin.listen.rpartition(':')[0]}:{cp.admin_port}",
              flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await cp.stop()
        return 0

    return asyncio.run(run())


def _check_config(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"xds-server: {e}", file=sys.stderr)
        return 2
    n = sum(len(c.nodes) for c in cfg.clusters)
    print(f"{args.config}: OK ({len(cfg.clusters)} cluster(s), {n} node(s))")
    return 0


def _status(args: argparse.Namespace) -> int:
    url = args.admin.rstrip("/") + "/nodes"
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            data = json.load(r)
    except (urllib.error.URLError, OSError) as e:
        print(f"xds-server: cannot reach admin at {url}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from xds_server.admin.status_text import format_status

    for line in format_status(data):
        print(line)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from xds_server.demo import run_demo

    return run_demo(keep_running=args.keep_running, envoy_binary=args.envoy_binary)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``xds-server`` console script."""
    p = argparse.ArgumentParser(prog="xds-server", description="Health-aware Envoy control plane for LLM fleets")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the control plane")
    s.add_argument("--config", required=True, help="YAML config file")
    s.set_defaults(fn=_serve)
    c = sub.add_parser("check-config", help="validate a config file and exit")
    c.add_argument("config")
    c.set_defaults(fn=_check_config)
    st = sub.add_parser("status", help="print node states from a running server's admin endpoint")
    st.add_argument("--admin", default="http://127.0.0.1:19000", help="admin base URL")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=_status)
    d = sub.add_parser("demo", help="local demo: real Envoy, simulated engines, injected faults")
    d.add_argument("--keep-running", action="store_true", help="stay up until Ctrl-C (no faults)")
    d.add_argument("--envoy-binary", default=None, help="path to envoy (default: `envoy` on PATH)")
    d.set_defaults(fn=_demo)
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
