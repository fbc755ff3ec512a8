"""The zygote's own side (run as ``python -m xds_server.testing._zygote_serve SOCKET``; see
:mod:`xds_server.testing._zygote` for what it is for and its protocol): import what the suite's
processes import, then fork a child per request until stdin closes."""
from __future__ import annotations

import gc
import json
import os
import runpy
import select
import signal
import socket
import sys
from typing import Any

# What the suite's processes import: the control plane, the agent, the simulated engine, the relay.
PRELOAD = ("xds_server.cli", "xds_server.server", "xds_server.config", "node_probe.cli", "node_probe.agent",
           "node_probe.sim", "node_probe.replay", "sentinel_relay.cli", "sentinel_relay.server",
           "sentinel_relay.feed", "grpc.aio", "prometheus_client")


def _serve(path: str) -> None:
    """Import :data:`PRELOAD`, then answer requests until stdin closes. A forked child returns
    from here into :func:`_run_child` (only in the child)."""
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # the imports' objects: never scanned again by a child's collections, nor copied
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    codes: dict[int, int] = {}
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([srv, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return  # the test process is gone
        if srv not in ready:
            continue
        conn, _ = srv.accept()
        with conn:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
            while not data.endswith(b"\n"):
                data += conn.recv(1 << 20)
            msg = json.loads(data)
            while True:  # reap every child that has ended
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                codes[pid] = os.waitstatus_to_exitcode(status)
            if "status" in msg:
                conn.sendall(json.dumps({"code": codes.get(int(msg["status"]))}).encode() + b"\n")
                continue
            sync_r, sync_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child keeps none of the zygote's sockets
                srv.close()
                conn.close()
                os.close(sync_r)
                _run_child(msg["start"], fds[0], sync_w)
                raise AssertionError("unreachable: _run_child exits")
            for fd in (*fds, sync_w):
                os.close(fd)
            os.read(sync_r, 1)  # EOF once the child has its own session: a signal to its group reaches it
            os.close(sync_r)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _run_child(start: dict[str, Any], out_fd: int, sync_fd: int) -> None:
    """In the forked child: become what ``python -m module args`` in its own session would be,
    run the module, and exit as the interpreter does (raises SystemExit)."""
    os.setsid()
    os.close(sync_fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    for fd in (devnull, out_fd):
        os.close(fd)
    os.chdir(start["cwd"])
    os.environ.clear()
    os.environ.update(start["env"])
    sys.argv = ["-m", *start["args"]]
    # As under ``python -m``, the module runs only as __main__: the zygote's imported copy goes
    # (runpy would warn that it is there, into the child's output).
    sys.modules.pop(start["module"], None)
    runpy.run_module(start["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the test process's to handle
    _serve(sys.argv[1])
