"""Helpers of the opt-in real-vLLM suites (test_real_vllm*.py): install, start and stop a CPU vLLM
serving the tiny model, find its EngineCore process, record measurements.

Environment: ``SENTINEL_REAL_VLLM_DIR`` (default ``/tmp/sentinel-real-vllm``: ``venv/`` and
``model/`` live there, built on first use by ``scripts/real_vllm``), ``SENTINEL_REAL_VLLM_RESULTS``
(append measurements to this file as JSON lines).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from xds_server.testing import free_port

REAL_VLLM = Path(__file__).resolve().parents[2] / "scripts" / "real_vllm"
WORK = Path(os.environ.get("SENTINEL_REAL_VLLM_DIR", "/tmp/sentinel-real-vllm"))
RESULTS = os.environ.get("SENTINEL_REAL_VLLM_RESULTS")


def record(name: str, **values: Any) -> None:
    """Print a measurement (``-s``) and append it to ``SENTINEL_REAL_VLLM_RESULTS`` if set."""
    line = json.dumps({"measure": name, **values})
    print(f"\n[real-vllm] {line}", flush=True)
    if RESULTS:
        with open(RESULTS, "a") as fh:
            fh.write(line + "\n")


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, comm) of the direct children of ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == pid:
            out.append((int(entry.name), comm))
    return out


def find_engine_core(api_pid: int) -> int:
    for pid, comm in children(api_pid):
        if "EngineCor" in comm:
            return pid
    raise AssertionError(f"no EngineCore child of {api_pid}: {children(api_pid)}")


class Server:
    """A running ``vllm serve`` (its API server process) at ``url``."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path, port: int = 0) -> None:
        self.proc = proc
        self.url = url
        self.log = log
        self.port = port

    @property
    def engine_core(self) -> int:
        return find_engine_core(self.proc.pid)


def ensure_install() -> tuple[Path, Path]:
    """The vLLM venv and the tiny model, built on first use (~3 min, 3.4 GB)."""
    venv, model = WORK / "venv", WORK / "model"
    WORK.mkdir(parents=True, exist_ok=True)
    if not (venv / "bin" / "vllm").exists():
        subprocess.run(["bash", str(REAL_VLLM / "setup.sh"), str(venv)], check=True, timeout=1500)
    if not (model / "config.json").exists():
        subprocess.run([str(venv / "bin" / "python"), str(REAL_VLLM / "mkmodel.py"), str(model)],
                       check=True, timeout=300, capture_output=True)
    return venv, model


def launch(venv: Path, model: Path, *extra: str) -> Server:
    """Start ``start.sh`` on a free port (its own process group); does not wait."""
    port = free_port()
    log = WORK / f"serve-{port}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(["bash", str(REAL_VLLM / "start.sh"), str(venv), str(model),
                                 str(port), *extra],
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(proc, f"http://127.0.0.1:{port}", log, port)


def wait_ready(server: Server, timeout_s: float = 300.0) -> None:
    """Wait until ``/health`` answers 200. AssertionError (with the log tail) otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.proc.poll() is not None:
            raise AssertionError(f"vllm exited with {server.proc.returncode}: "
                                 f"{server.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"vllm not ready in {timeout_s} s: {server.log.read_text()[-3000:]}")
        time.sleep(0.5)


def stop(server: Server) -> None:
    """SIGCONT + SIGTERM the server's process group, SIGKILL after 30 s; always safe."""
    proc = server.proc
    try:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
