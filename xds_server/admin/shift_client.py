"""``xds-server shift``: start, show, pause, resume or cancel a gated shift on running servers.

::

    xds-server shift CLUSTER --to REGION|PRIORITY [--step 10] [--every 5m] [--hard] [--admin A ...]
    xds-server shift status|pause|resume|cancel CLUSTER [--admin A ...]

``--admin`` may be repeated, one per replica: a new shift is sent to each with the same
``start_at`` (wall-clock s), so the replicas decide at the same instants and publish the same
weights for the same step while their gates agree (:mod:`xds_server.load.gated_shifts`).
urllib only, as :mod:`xds_server.admin.client`; exit codes as the other admin commands (2 bad
arguments, 3 refused by the server, 1 unreachable).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from xds_server.admin.client import AdminError, admin_base_url, get_json
from xds_server.admin.client import _request as request_json
from xds_server.process.untrusted import for_log

__all__ = ["COMMANDS", "add_shift_parser", "shift_line", "shift_main"]

COMMANDS = ("status", "pause", "resume", "cancel")


def add_shift_parser(cmd: Callable[..., argparse.ArgumentParser], admin_help: str, token_env: str) -> None:
    """Register the ``shift`` command through the CLI's ``cmd(name, help, fn)`` factory."""
    sh = cmd("shift", "move a share of a cluster's traffic to a region or priority, step by step while "
                      "the gates hold (or all at once: --hard); or show/pause/resume/cancel it", shift_main)
    sh.add_argument("what", metavar="CLUSTER | status|pause|resume|cancel", help="the cluster, or a command")
    sh.add_argument("cluster", nargs="?", metavar="CLUSTER", help="the cluster (after a command)")
    sh.add_argument("--to", default=None, help="target: a region name or a priority number (region:NAME forces "
                                               "a region); required to start a shift")
    sh.add_argument("--step", type=float, default=None,
                    help="percent per step (default: shift.default_step_percent, 10)")
    sh.add_argument("--every", default=None, help="window per step: 300, 5m, 30s (default: shift.default_every, 5m)")
    sh.add_argument("--hard", action="store_true", help="everything at once, no gates (default: gated steps)")
    sh.add_argument("--admin", action="append", default=None,
                    help=admin_help + "; repeat once per replica (the same start time is sent to each)")
    sh.add_argument("--token", default=None, help=f"admin token (default: ${token_env})")
    sh.add_argument("--json", action="store_true", help="print the shift's JSON (default: one line)")
    sh.set_defaults(token_env=token_env)


def shift_line(v: dict[str, Any]) -> str:
    """One line for a shift view: phase, share, schedule, the gates of the last decision, the
    window arithmetic; a cluster without a shift says so."""
    name = for_log(str(v.get("cluster")), 64)
    if v.get("phase") == "none":
        return f"shift {name}: none (the configured layout)"
    to = v.get("to") or {}
    target = f"{to.get('kind')} {for_log(str(to.get('value')), 64)}"
    if v.get("phase") == "cancelled":  # its share is 0 now; the reason says where it was
        parts = [f"shift {name}: cancelled (to {target})"]
    else:
        parts = [f"shift {name}: {v.get('phase')} at {v.get('share_percent'):g} % to {target}"]
    if not v.get("hard") and v.get("phase") not in ("done", "cancelled"):
        parts.append(f"(+{v.get('step_percent'):g} % every {v.get('every_s'):g} s)")
    if v.get("next_decision_in_s") is not None:
        parts.append(f"next decision in {v['next_decision_in_s']:.1f} s")
    g = v.get("last_gate")
    if g:
        lat = g.get("latency_increase")
        parts.append(f"last window: {g['verdict']} (errors {g['errored']}/{g['completed']}"
                     + (f", latency {lat:+.1%}" if lat is not None else "") + ")")
    need = v.get("window_needs")
    if need and need.get("requests") is not None and not need.get("enough"):
        parts.append(f"[a window needs {need['requests']} requests; ~{need['expected_per_window']:g} expected at "
                     f"{need['cluster_rps']:g} rps x {need['share'] * 100:g} %: it will hold]")
    if v.get("reason"):
        parts.append(f"- {for_log(str(v['reason']), 200)}")
    return " ".join(parts)


def _send(base: str, path: str, token: str, body: dict[str, Any] | None) -> Any:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(base + path, data=data, method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    return request_json(base, path, req, 10.0)[0]


def shift_main(args: argparse.Namespace) -> int:
    """Run ``xds-server shift``; returns the exit code."""
    if args.what in COMMANDS and args.cluster:
        what, cluster = args.what, args.cluster
    elif args.cluster is None:
        what, cluster = "start", args.what
    else:
        print(f"xds-server: shift: {args.what!r} is not one of {', '.join(COMMANDS)} (or give CLUSTER alone)",
              file=sys.stderr)
        return 2
    try:
        bases = [admin_base_url(a) for a in (args.admin or ["http://127.0.0.1:19000"])]
    except ValueError as e:
        print(f"xds-server: {e}", file=sys.stderr)
        return 2
    path = f"/clusters/{urllib.parse.quote(cluster, safe='')}/shift"
    body: dict[str, Any] | None = None
    if what == "start":
        if args.to is None:
            print("xds-server: shift: --to REGION|PRIORITY is required to start a shift", file=sys.stderr)
            return 2
        body = {"to": args.to, "hard": args.hard, "start_at": time.time()}
        if args.step is not None:
            body["step_percent"] = args.step
        if args.every is not None:
            body["every"] = args.every
    token = args.token or os.environ.get(args.token_env)
    if what != "status" and not token:
        print(f"xds-server: an admin token is required (--token or ${args.token_env})", file=sys.stderr)
        return 2
    rc = 0
    for base in bases:
        try:
            if what == "status":
                v = get_json(base, path)
            else:
                v = _send(base, path if what == "start" else f"{path}/{what}", token or "", body)
        except AdminError as e:
            print(f"xds-server: {e}", file=sys.stderr)
            rc = max(rc, e.code)
            continue
        prefix = f"{urllib.parse.urlsplit(base).netloc}: " if len(bases) > 1 else ""
        print(json.dumps(v, indent=2) if args.json else prefix + shift_line(v))
    return rc
