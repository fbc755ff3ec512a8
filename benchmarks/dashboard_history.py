"""Cost of the dashboard's recent history (admin ``GET /history``, issue 26 item 5).

Usage: python benchmarks/dashboard_history.py [--nodes N] [--samples S]

Fills a :class:`~xds_server.admin.history.History` of S samples (default 450: 15 min at 2 s)
for N nodes (default 1000), then prints: the time to add one sample, the memory the ring holds
(tracemalloc, a separate pass), the time to build and encode one ``/history`` answer and its
size; and the time of ``ControlPlaneView.history_rows()`` (what each sample reads) over an
in-memory control plane of N nodes. One core, no I/O.
"""
from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

from xds_server.admin.app import json_dumps
from xds_server.admin.history import History, HistoryRow


def fill(n: int, samples: int) -> History:
    h = History(samples, 2.0)
    rows = [HistoryRow(f"n{i}", "llm", "HEALTHY", 100, 100, 1.23, 45.6) for i in range(n)]
    for k in range(samples):
        h.add(1e9 + 2 * k, rows)
    return h


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=450)
    a = ap.parse_args()
    t = time.perf_counter()
    h = fill(a.nodes, a.samples)
    add_ms = (time.perf_counter() - t) / a.samples * 1000
    tracemalloc.start()
    held = fill(a.nodes, a.samples)
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del held
    t = time.perf_counter()
    body = json_dumps(h.to_json())
    answer_ms = (time.perf_counter() - t) * 1000
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
    from test_control_core import config, in_memory

    cp, _, _ = in_memory(config(n=a.nodes))
    t = time.perf_counter()
    for _ in range(10):
        cp.view.history_rows()
    rows_ms = (time.perf_counter() - t) / 10 * 1000
    print(f"{a.nodes} nodes x {a.samples} samples: add {add_ms:.2f} ms per sample, history_rows {rows_ms:.1f} ms "
          f"per sample, ring {mem / 1e6:.1f} MB, one /history answer {answer_ms:.0f} ms, {len(body) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
