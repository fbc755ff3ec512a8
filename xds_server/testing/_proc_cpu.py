"""CPU time from Linux ``/proc``, for benchmarks and the fault rigs: a process's (all its threads)
and each thread's of this process, user + system seconds (clock ticks / ``SC_CLK_TCK``).

Shape::

    cpu = ProcCpu.of(pid)            # (name, user_s, system_s) of a process, or None when it is gone
    process_cpu_s(pid)               # user + system s; 0.0 when gone
    threads_cpu_s()                  # this process's threads: tid -> (name, user + system s)
"""
from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["ProcCpu", "process_cpu_s", "threads_cpu_s"]

_TICK = os.sysconf("SC_CLK_TCK")


class ProcCpu(NamedTuple):
    """A ``/proc/.../stat`` reading: the name (``comm``) and user and system CPU seconds so far."""

    name: str
    user_s: float
    system_s: float

    @property
    def total_s(self) -> float:
        return self.user_s + self.system_s

    @classmethod
    def read(cls, path: str) -> ProcCpu | None:
        """The reading of one ``stat`` file (a process's or a thread's); None when it is gone."""
        try:
            with open(path) as f:
                head, rest = f.read().rsplit(")", 1)
        except (OSError, ValueError):
            return None
        fields = rest.split()
        return cls(head.split("(", 1)[1], int(fields[11]) / _TICK, int(fields[12]) / _TICK)

    @classmethod
    def of(cls, pid: int | str) -> ProcCpu | None:
        """Process ``pid`` (or ``"self"``), all its threads; None when it is gone."""
        return cls.read(f"/proc/{pid}/stat")


def process_cpu_s(pid: int | str | None) -> float:
    """User + system CPU seconds of process ``pid`` so far; 0.0 when it is gone (or None)."""
    got = None if pid is None else ProcCpu.of(pid)
    return 0.0 if got is None else got.total_s


def threads_cpu_s() -> dict[int, tuple[str, float]]:
    """This process's threads: thread id -> (name, user + system CPU seconds so far)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        got = ProcCpu.read(f"/proc/self/task/{tid}/stat")
        if got is not None:  # None: the thread ended
            out[int(tid)] = (got.name, got.total_s)
    return out
