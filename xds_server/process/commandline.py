"""What the three programs (``xds-server``, ``node-probe`` with ``sim-engine``, ``sentinel-relay``)
share on their command line: ``--version`` (answered before any other flag is checked),
``--log-level``, ``--log-format text|json`` (one timestamp format: :mod:`xds_server.process.logs`),
and one-line answers to the errors an operator causes.

- :func:`add_common_options` adds the three options to a parser (``suppress``: for options
  accepted before and after a subcommand, a later parser must not reset them).
- :func:`bind_failure` names why an address cannot be bound (in use, not ours, not permitted)
  and the flag or field to change, in one line.
- :func:`run_main` runs a program's body: an unexpected exception is one line (its type and
  text) and exit code 1, the traceback only with ``--log-level DEBUG``.
"""
from __future__ import annotations

import argparse
import errno
import socket
import sys
from collections.abc import Callable
from importlib import metadata

from xds_server.process.logs import FORMATS, LEVELS

__all__ = ["add_common_options", "bind_failure", "level", "run_main", "version"]


def version() -> str:
    """The installed ``xds-sentinel`` version ("unknown" when run from a tree not installed)."""
    try:
        return metadata.version("xds-sentinel")
    except metadata.PackageNotFoundError:
        return "unknown"


def level(v: str) -> str:
    """argparse ``type=`` for ``--log-level``: any case of :data:`~xds_server.process.logs.LEVELS`."""
    if v.upper() not in LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LEVELS)}")
    return v.upper()


def add_common_options(p: argparse.ArgumentParser | argparse._ArgumentGroup, prog: str, *,
                       with_version: bool = True, suppress: bool = False) -> None:
    """``--version`` (prints ``PROG VERSION`` and exits 0, whatever else is missing),
    ``--log-level`` (default INFO) and ``--log-format`` (default text) on ``p``."""
    if with_version:
        p.add_argument("--version", action="version", version=f"{prog} {version()}",
                       help="print the program's version and exit")
    p.add_argument("--log-level", type=level, default=argparse.SUPPRESS if suppress else "INFO",
                   help=f"{', '.join(LEVELS)}; DEBUG also prints tracebacks (default INFO)")
    p.add_argument("--log-format", choices=FORMATS, default=argparse.SUPPRESS if suppress else "text",
                   help="text (TS LEVEL logger: message key=value) or json (one object per line); "
                   "timestamps are UTC ISO 8601 with ms (default text)")


_WHY = {
    errno.EADDRINUSE: "address already in use (another process listens there)",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
    errno.EADDRNOTAVAIL: "not an address of this host",
}


def _bind_errno(host: str, port: int) -> int | None:
    """The errno a plain TCP bind of ``host:port`` fails with now; None when it binds."""
    h = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(h, port, type=socket.SOCK_STREAM)
    except OSError:
        return errno.EADDRNOTAVAIL
    fam, _, _, _, addr = infos[0]
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        return None
    except OSError as e:
        return e.errno
    finally:
        s.close()


def bind_failure(address: str, flag: str, exc: BaseException | None = None) -> str:
    """One line: ``cannot listen on ADDRESS (FLAG): WHY; stop the other process or change FLAG``.

    ``exc``: the error of the failed bind when there is one (its errno names the reason; gRPC's
    bind errors carry none, so the address is tried again with a plain socket to find it)."""
    code = getattr(exc, "errno", None)
    if code not in _WHY:
        host, _, port = address.rpartition(":")
        try:
            code = _bind_errno(host, int(port))
        except ValueError:
            code = None
    why = _WHY.get(code) if code is not None else None
    if why is None:
        why = str(exc) if exc is not None and str(exc) else "in use or not permitted"
    fix = "stop the other process or change" if code == errno.EADDRINUSE else "change"
    return f"cannot listen on {address} ({flag}): {why}; {fix} {flag}"


def run_main(prog: str, body: Callable[[], int], debug: Callable[[], bool]) -> int:
    """``body()``'s exit code; an exception it lets out is one line on stderr and exit code 1
    (re-raised with its traceback when ``debug()``). Ctrl-C is exit code 130, silently."""
    try:
        return body()
    except KeyboardInterrupt:
        return 130
    except SystemExit:
        raise
    except Exception as e:  # the last line of defence: one line, not a traceback
        if debug():
            raise
        print(f"{prog}: {type(e).__name__}: {e} (--log-level DEBUG prints the traceback)",
              file=sys.stderr, flush=True)
        return 1
