"""Start the suite's Python processes by fork from one process that has imported them once.

A test fleet is a control plane, an engine and an agent per node: each ``python -m`` start spends
0.5-1.5 s of CPU importing grpc, aiohttp, pydantic, the xDS protos and our own packages before its
``main`` runs (about a third of the suite's CPU, measured with the processes' own clocks). The
zygote is one process per test process that imports all of that once, then forks a child per start
and runs the module as ``python -m`` would (``runpy``, ``__main__``, ``sys.argv``), so a child
costs only what its ``main`` does.

What the child gets, as an exec'd ``python -m MODULE ARGS`` would have: a session of its own (its
process group, so freezing or killing it reaches it all), the working directory and environment of
the test process at the time of the start, stdin from ``/dev/null``, stdout and stderr on the pipe
the test process reads, and the interpreter's own exit (atexit, thread joins, the exit status from
``SystemExit`` or a traceback and 1). The zygote creates no thread, event loop or gRPC object
before it forks (it only imports), so the child starts as clean as an exec'd one.

What differs from an exec: the children share the zygote's string-hash seed; ``sys.path[0]`` is
the directory the zygote started in; the imports' objects are frozen out of the garbage
collector's scans (``gc.freeze``, as a forking server does); settings a library reads once at
import (gRPC's ``GRPC_*`` variables) are those of the test process when the zygote started; the
child's parent is the zygote, which reaps it and keeps its exit code for ``status``.

Used by :class:`~xds_server.testing.ManagedProcess` for ``[sys.executable, "-m", MODULE, ...]``
without an environment of its own; anything else, or ``XDS_SENTINEL_TEST_FORK=0`` in the
environment, is exec'd as before. Protocol (one request per Unix-socket connection, a JSON line):
``{"start": {"module", "args", "cwd", "env"}}`` with the pipe's write end passed as SCM_RIGHTS ->
``{"pid": N}``; ``{"status": N}`` -> ``{"code": int | null}`` (null while it runs; the exit code,
or minus the signal, as :attr:`subprocess.Popen.returncode`).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

log = logging.getLogger(__name__)

SWITCH = "XDS_SENTINEL_TEST_FORK"
SERVER = "xds_server.testing._zygote_serve"  # the zygote's own side, run with -m


def _request(path: str, msg: dict[str, Any], fds: tuple[int, ...] = ()) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        data = json.dumps(msg).encode() + b"\n"
        if fds:
            socket.send_fds(s, [data], list(fds))
        else:
            s.sendall(data)
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError(f"zygote closed the connection answering {msg}")
            buf += chunk
    out: dict[str, Any] = json.loads(buf)
    return out


class ForkedChild:
    """A child forked by the zygote, with the part of :class:`subprocess.Popen`'s interface that
    :class:`ManagedProcess` and the tests use: ``pid``, ``stdout``, ``returncode``, ``poll()``,
    ``wait(timeout)``, ``send_signal(sig)``."""

    def __init__(self, zygote: Zygote, pid: int, stdout: IO[bytes]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.status(self.pid)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the child while it runs (as Popen: nothing once it has ended)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
            time.sleep(0.01)
        return code


class Zygote:
    """The test process's zygote: started on first use, stopped when the test process exits (it
    watches its stdin, a pipe from here)."""

    _lock = threading.Lock()
    _one: Zygote | None = None
    _failed = False

    @classmethod
    def shared(cls) -> Zygote | None:
        """This process's zygote, started on first use (again if it died); None when
        ``XDS_SENTINEL_TEST_FORK=0`` or once it could not start (said once; the caller execs)."""
        if os.environ.get(SWITCH, "1") == "0" or cls._failed:
            return None
        with cls._lock:
            if cls._one is None or cls._one.proc.poll() is not None:
                try:
                    cls._one = cls()
                except (OSError, RuntimeError) as e:
                    cls._failed = True
                    log.warning("zygote could not start (%s): test processes are exec'd", e)
                    return None
            return cls._one

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="zygote-")
        self.path = os.path.join(self._dir.name, "sock")
        self.proc = subprocess.Popen([sys.executable, "-m", SERVER, self.path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            self.proc.kill()
            raise RuntimeError(f"zygote did not start: {line!r}")

    def start(self, module: str, args: list[str], env: dict[str, str]) -> ForkedChild:
        """Fork a child that runs ``python -m module *args`` with environment ``env``; its output
        on a new pipe."""
        r, w = os.pipe()
        try:
            reply = _request(self.path, {"start": {"module": module, "args": args, "cwd": os.getcwd(),
                                                   "env": env}}, (w,))
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        return ForkedChild(self, int(reply["pid"]), os.fdopen(r, "rb"))

    def status(self, pid: int) -> int | None:
        """``pid``'s exit code (minus the signal that ended it), None while it runs."""
        code = _request(self.path, {"status": pid})["code"]
        return None if code is None else int(code)
