"""The text table of ``xds-server status``, from a ``/nodes`` answer (pure: JSON in, lines out).

Columns: node, cluster, the shown state (``display_state``: the health state, or DRAINING,
FAIL_STATIC, UNREACHABLE, HELD_BACK), the published weight (``-`` when Envoy does not route to
the node: it ignores the weight of such a host), EDS health status, EWMA RTT and last TTFT (ms),
and the shown reason. A fail-static episode adds a marker line above the table. Answers from an
older server without the shown fields fall back to ``state`` and ``reason``.
"""
from __future__ import annotations

from xds_server.admin.shift_client import shift_line
from xds_server.process.untrusted import for_log

__all__ = ["format_status"]


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_status(data: dict) -> list[str]:
    """Lines of the status table for a parsed ``/nodes`` answer (``{"fail_static", "cluster_failures",
    "nodes"}``): a line per fail-static and per scope failing alike, then one per node."""
    lines: list[str] = []
    fs = data.get("fail_static") or {}
    if fs.get("active"):
        held = ", ".join(fs.get("held_clusters") or []) or "none yet"
        lines.append(f"FAIL-STATIC for {fs.get('since_s_ago') or 0:.1f} s: keeping the last good assignment "
                     f"(clusters held: {for_log(held, 200)}): {for_log(str(fs.get('reason') or ''), 300)}")
    for cluster, cf in sorted((data.get("cluster_failures") or {}).items()):
        for scope in cf.get("scopes") or []:
            lines.append(f"CLUSTER FAILURE in {for_log(cluster, 64)}: {for_log(str(scope.get('reason') or ''), 300)}")
    for v in data.get("shifts") or []:
        done = " (the layout differs from the config)" if v.get("phase") == "done" else ""
        lines.append(f"SHIFT {shift_line(v).removeprefix('shift ')}{done}")
    lines.append(f"{'NODE':<20} {'CLUSTER':<16} {'STATE':<12} {'WEIGHT':>7} {'EDS':<10} {'RTT ms':>7} "
                 f"{'TTFT ms':>8}  REASON")
    for v in data.get("nodes", []):
        state = v.get("display_state") or v["state"]
        reason = v.get("display_reason") or v["reason"]
        routed = v.get("routed", v["eds_health_status"] == "HEALTHY")
        weight = str(v["weight"]) if routed else "-"
        lines.append(f"{for_log(v['id'], 20):<20} {for_log(v['cluster'], 16):<16} {state:<12} {weight:>7} "
                     f"{v['eds_health_status']:<10} {_ms(v.get('ewma_rtt_ms')):>7} {_ms(v.get('last_ttft_ms')):>8}  "
                     f"{for_log(str(reason), 200)}")
    return lines
