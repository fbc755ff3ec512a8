"""What starting our programs costs: a test fleet forked from the zygote against one exec'd, and
the CLI's commands.

Usage: python benchmarks/process_start.py [--rounds 3] [--nodes 3]

Fleet: ``xds_server.testing.Fleet`` (dial-in, ``--nodes`` simulated engines and agents, one
xds-server, one Envoy) started ``--rounds`` times each way, alternating: forked from the zygote
(the default) and exec'd (``XDS_SENTINEL_TEST_FORK=0``). Prints the wall time from start to
every process ready and each kind's CPU at that moment (/proc/PID/stat, user + system; Envoy
left out: it has no ready line). The first forked start includes the zygote's own (its imports).

CLI: ``xds-server --version`` and ``xds-server check-config`` on a one-node config, exec'd as a
user runs them, ``--rounds`` times each; prints the mean CPU of the process (its rusage). To
compare another tree, run this script with ``PYTHONPATH=TREE`` (bytecode compiled in both).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xds_server.testing import Fleet


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fleet_once(nodes: int, forked: bool) -> tuple[float, dict[str, float]]:
    """(seconds from start to every process ready, {kind: CPU s of one such process at ready})."""
    os.environ["XDS_SENTINEL_TEST_FORK"] = "1" if forked else "0"
    t0 = time.monotonic()
    fleet = Fleet(n_nodes=nodes, agents="dial-in").start()
    try:
        wall = time.monotonic() - t0
        by_kind: dict[str, list[float]] = {}
        for p in fleet.procs:
            if p.name != "envoy":  # no ready line: it is only launched by then
                kind = p.name.split("-")[0] if p.name.startswith(("engine-", "agent-")) else p.name
                by_kind.setdefault(kind, []).append(_cpu_s(p.pid))
        return wall, {k: statistics.mean(v) for k, v in by_kind.items()}
    finally:
        fleet.stop()


def cli_cpu_s(argv: list[str], cwd: str) -> float:
    """CPU seconds (user + system) of one exec'd run of ``argv`` in ``cwd`` (not the repository:
    ``python -m`` puts the working directory first on sys.path, before PYTHONPATH)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, capture_output=True, check=True, cwd=cwd)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=3)
    args = ap.parse_args()

    runs: dict[bool, list[tuple[float, dict[str, float]]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for forked in (True, False):
            runs[forked].append(fleet_once(args.nodes, forked))
    print(f"fleet of {args.nodes} nodes, {args.rounds} starts each way (alternating)")
    for forked, rs in runs.items():
        walls = ", ".join(f"{w:.2f}" for w, _ in rs)
        kinds = {k: statistics.mean(r[k] for _, r in rs) for k in rs[0][1]}
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in kinds.items())
        print(f"  {'forked' if forked else 'exec-d':7} start {walls} s; CPU at ready per process (s): {cpu}")

    xds = [sys.executable, "-m", "xds_server.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "xds.yaml"
        cfg.write_text("xds: {listen: 127.0.0.1:18000}\nclusters:\n  - name: llm\n"
                       "    nodes:\n      - {id: gpu-a, address: 127.0.0.1:8000}\n")
        for name, argv in (("--version", [*xds, "--version"]), ("check-config", [*xds, "check-config", str(cfg)])):
            mean = statistics.mean(cli_cpu_s(argv, tmp) for _ in range(args.rounds))
            print(f"xds-server {name}: {mean:.2f} s of CPU (mean of {args.rounds})")


if __name__ == "__main__":
    main()
