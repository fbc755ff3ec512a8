"""The ``node-probe`` agent, unchanged, whose Python event loop a signal blocks: for the fault
matrix's hung-agent fault (:func:`~xds_server.testing._agent_faults.agent_loop_block`), in a real
agent process.

    python -m xds_server.testing._blockable_agent [--block-file PATH] NODE-PROBE-ARGS...

Installs a SIGUSR1 handler, then runs :func:`node_probe.cli.main` with the other arguments. The
agent's event loop runs in the main thread (``asyncio.run``), which is where Python runs signal
handlers, so the handler's ``time.sleep`` blocks that loop: no heartbeat, probe or telemetry is
sent while gRPC's C-core threads keep answering the control plane's HTTP/2 PINGs (the process and
its transport stay alive). The block lasts the seconds written in ``PATH`` (a decimal number, read
at each signal; :data:`DEFAULT_BLOCK_S` when the file is absent or unreadable). Each block is
written to stderr (fd 2, unbuffered) before and after (``loop blocked for S s`` / ``loop unblocked``).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

__all__ = ["BLOCK_FILE_FLAG", "DEFAULT_BLOCK_S", "block_seconds", "main"]

DEFAULT_BLOCK_S = 3.0
"""Seconds one SIGUSR1 blocks the loop when no block file says otherwise."""
BLOCK_FILE_FLAG = "--block-file"


def block_seconds(path: Path | None) -> float:
    """The seconds (>= 0) written in ``path``; :data:`DEFAULT_BLOCK_S` when ``path`` is None,
    absent, unreadable or not a number."""
    if path is None:
        return DEFAULT_BLOCK_S
    try:
        return max(0.0, float(path.read_text().strip()))
    except (OSError, ValueError):
        return DEFAULT_BLOCK_S


def _split(argv: Sequence[str]) -> tuple[Path | None, list[str]]:
    """``--block-file PATH`` (anywhere in ``argv``) apart from the agent's own arguments."""
    rest = list(argv)
    if BLOCK_FILE_FLAG not in rest:
        return None, rest
    i = rest.index(BLOCK_FILE_FLAG)
    if i + 1 >= len(rest):
        raise SystemExit(f"{BLOCK_FILE_FLAG} needs a PATH")
    path = Path(rest[i + 1])
    del rest[i:i + 2]
    return path, rest


def main(argv: Sequence[str] | None = None) -> int:
    """Install the blocking SIGUSR1 handler and run the agent; returns its exit code."""
    path, rest = _split(sys.argv[1:] if argv is None else argv)

    def block(_signum: int, _frame: FrameType | None) -> None:
        seconds = block_seconds(path)
        # os.write, not print: the signal may have interrupted a write to sys.stderr
        os.write(2, f"loop blocked for {seconds:g} s\n".encode())
        time.sleep(seconds)
        os.write(2, b"loop unblocked\n")

    signal.signal(signal.SIGUSR1, block)
    from node_probe.cli import main as agent_main

    return agent_main(rest)


if __name__ == "__main__":
    sys.exit(main())
