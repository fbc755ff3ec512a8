"""Child processes for tests: free ports and :class:`ManagedProcess`.

Every process started here is registered and killed at interpreter exit as a last resort, so a
failed test never leaves an Envoy behind.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from ._zygote import ForkedChild, Zygote

__all__ = ["ManagedProcess", "free_port"]

_LIVE: set[ManagedProcess] = set()


def _kill_all_at_exit() -> None:
    for p in list(_LIVE):
        with contextlib.suppress(Exception):
            p.stop(timeout_s=1.0)


atexit.register(_kill_all_at_exit)


def _slice(low: int, high: int, env: Mapping[str, str]) -> tuple[int, int]:
    """This process's part of ``[low, high)``: under pytest-xdist (``PYTEST_XDIST_WORKER`` gwN of
    ``PYTEST_XDIST_WORKER_COUNT``) the N-th of equal slices, so two workers never hand out the same
    port (each checks only that a port is free now: two could pick it before either binds); else
    the whole range."""
    worker, count = env.get("PYTEST_XDIST_WORKER", ""), env.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 0):
        return low, high
    n, k = int(worker[2:]), int(count)
    size = (high - low) // k
    return (low + n * size, low + (n + 1) * size) if n < k else (low, high)


_PORT_LOW, _PORT_HIGH = _slice(21000, 32000, os.environ)
_GIVEN: set[int] = set()
_PORT_RNG = random.Random(os.getpid() ^ time.monotonic_ns())


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago and that this process has not handed out.

    Ports come from 21000-32000 (one slice of it per pytest-xdist worker), below Linux's ephemeral
    range (32768-60999 by default): a port the kernel hands out for port 0 is also what it picks
    for the next outgoing connection, so one chosen there can be taken by any client between this
    call and the server's bind (a README run once lost its control plane's port that way and
    answered 503 for 30 s). Raises RuntimeError if no port in the range binds.
    """
    for _ in range(2000):
        port = _PORT_RNG.randrange(_PORT_LOW, _PORT_HIGH)
        if port in _GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {_PORT_LOW}-{_PORT_HIGH} on 127.0.0.1")


class ManagedProcess:
    """A child process in its own process group (so signals reach all of it).

    Output (stdout+stderr) goes to ``log_path`` and is scanned for ``ready_pattern``.
    """

    def __init__(self, name: str, argv: list[str], log_path: Path, ready_pattern: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.ready_re = re.compile(ready_pattern) if ready_pattern else None
        self.env = env
        self.proc: subprocess.Popen[bytes] | ForkedChild | None = None
        self._ready = threading.Event()
        self._lines: collections.deque[str] = collections.deque(maxlen=200)
        self.frozen = False

    @property
    def pid(self) -> int:
        """PID of the child (raises RuntimeError before start)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} not started")
        return self.proc.pid

    def start(self, timeout_s: float = 20.0) -> ManagedProcess:
        """Start and wait for the ready line. Raises RuntimeError (with the output tail) on failure."""
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> ManagedProcess:
        """Start the child without waiting for its ready line (:meth:`wait_ready` waits), so
        several children start at once."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        zygote = Zygote.shared() if self._forkable() else None
        if zygote is not None:
            self.proc = zygote.start(self.argv[2], self.argv[3:], env)
        else:
            self.proc = subprocess.Popen(
                self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=env,
            )
        _LIVE.add(self)
        threading.Thread(target=self._pump, daemon=True, name=f"pump-{self.name}").start()
        return self

    def _forkable(self) -> bool:
        """``python -m MODULE`` of this interpreter with no environment of its own: the zygote
        starts it (:mod:`._zygote`); anything else is exec'd."""
        return self.env is None and len(self.argv) >= 3 and self.argv[0] == sys.executable and self.argv[1] == "-m"

    def wait_ready(self, timeout_s: float = 20.0) -> ManagedProcess:
        """Wait up to ``timeout_s`` for the ready line (at once without a ``ready_pattern``).
        Raises RuntimeError (with the output tail) if the child exits or stays silent; it is
        stopped then."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} not started")
        if self.ready_re is None:
            return self
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._ready.wait(0.05):
                return self
            if self.proc.poll() is not None:
                break
        tail = "\n".join(list(self._lines)[-30:])
        rc = self.proc.poll()
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready (exit code {rc}); output:\n{tail}")

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log_path, "ab") as log:
            for raw in self.proc.stdout:
                log.write(raw)
                log.flush()
                line = raw.decode("utf-8", "replace").rstrip()
                self._lines.append(line)
                if self.ready_re is not None and not self._ready.is_set() and self.ready_re.search(line):
                    self._ready.set()

    def output_tail(self, n: int = 30) -> str:
        """Last ``n`` lines of output."""
        return "\n".join(list(self._lines)[-n:])

    def freeze(self) -> None:
        """SIGSTOP the whole process group (a host freeze, as a hung kernel or VM pause)."""
        os.killpg(self.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        """SIGCONT the process group."""
        os.killpg(self.pid, signal.SIGCONT)
        self.frozen = False

    def alive(self) -> bool:
        """True while the child runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM the group (SIGCONT first if frozen), SIGKILL after ``timeout_s``; returns exit code."""
        if self.proc is None:
            return None
        try:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGCONT)
                    os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(5)
            # Reap anything left in the group (e.g. grandchildren).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.returncode
        finally:
            _LIVE.discard(self)
