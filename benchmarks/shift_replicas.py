"""Issue 23: how far apart two control-plane replicas act on one gated shift, as figures for
benchmarks/RESULTS.md.

Two ``xds-server serve`` processes with the same config (4 nodes, priorities 0 and 1; no agents, so
no traffic and every window holds: the decision instants are what is measured, a step's weights
follow from (layout, step) alone). ``xds-server shift llm --to 1 --every E --admin A --admin B``
sends one ``start_at`` to both. Reported: the gap between the replicas' ``shift_started`` events
(the CLI's two POSTs, one after the other) and, per decision, between their ``shift_held`` events
(each replica sleeps until ``start_at + k x E`` on its own clock); and whether both published the
same assignment bytes (``/clusters`` xds_version) after each.

    .venv/bin/python benchmarks/shift_replicas.py [--every 1.0] [--decisions 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from xds_server.testing import free_port

TOKEN = "bench-token"


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=float, default=1.0, help="window per step, s (default 1.0)")
    ap.add_argument("--decisions", type=int, default=10, help="decisions to wait for (default 10)")
    a = ap.parse_args()
    py = [sys.executable, "-m", "xds_server.cli"]
    procs, admins = [], []
    nodes: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        try:
            for i in range(2):
                admin = free_port()
                cfg = {"xds": {"listen": f"127.0.0.1:{free_port()}", "replica_id": f"cp-{i + 1}",
                               "warmup_timeout_ms": 0},
                       "admin": {"listen": f"127.0.0.1:{admin}", "token": TOKEN},
                       "clusters": [{"name": "llm", "nodes": nodes or [
                           {"id": f"n{j}", "address": f"127.0.0.1:{free_port()}",
                            "probe_address": f"127.0.0.1:{free_port()}", "priority": j // 2} for j in range(4)]}]}
                nodes = cfg["clusters"][0]["nodes"]  # the same nodes on both replicas
                path = Path(d) / f"cp{i}.yaml"
                path.write_text(yaml.safe_dump(cfg))
                procs.append(subprocess.Popen([*py, "serve", str(path), "--log-level", "WARNING"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                admins.append(admin)
            for port in admins:
                for _ in range(100):
                    try:
                        _get(port, "/healthz")
                        break
                    except OSError:
                        time.sleep(0.1)
            out = subprocess.run([*py, "shift", "llm", "--to", "1", "--step", "10", "--every", f"{a.every}s",
                                  *[x for p in admins for x in ("--admin", f"127.0.0.1:{p}")]],
                                 capture_output=True, text=True, env={**os.environ, "XDS_SENTINEL_ADMIN_TOKEN": TOKEN})
            assert out.returncode == 0, out.stderr
            versions_equal = 0
            for _ in range(a.decisions):
                time.sleep(a.every)
                v = [_get(p, "/clusters")["clusters"][0]["xds_version"] for p in admins]
                versions_equal += v[0] == v[1]
            ev = [[e for e in _get(p, "/events?limit=1000")["events"] if e["kind"].startswith("shift_")]
                  for p in admins]
            anchor = _get(admins[0], "/clusters/llm/shift")["anchor_wall_s"]
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)
    key = "time"
    start_gap = abs(ev[0][0][key] - ev[1][0][key])
    held = [[e[key] for e in x if e["kind"] == "shift_held"] for x in ev]
    n = min(len(held[0]), len(held[1]))
    gaps = [abs(held[0][i] - held[1][i]) * 1000 for i in range(n)]
    late = [((held[0][i] - anchor + a.every / 2) % a.every - a.every / 2) * 1000 for i in range(n)]
    print(f"start gap (CLI's two POSTs): {start_gap * 1000:.1f} ms")
    print(f"decisions: {n}; gap between replicas per decision: median {statistics.median(gaps):.1f} ms, "
          f"max {max(gaps):.1f} ms; replica 1 after its due instant: median {statistics.median(late):.1f} ms")
    print(f"same assignment version on both at {versions_equal} of {a.decisions} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
