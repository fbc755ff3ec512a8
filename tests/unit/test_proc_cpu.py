"""CPU time read from /proc for the benchmarks and fault rigs: a process's, this process's
threads', and 0 / None for a process that is gone."""
from __future__ import annotations

import os
import threading
import time

from xds_server.testing import ProcCpu, process_cpu_s, threads_cpu_s


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_process_cpu_grows_by_what_it_burned_and_a_gone_one_reads_zero():
    before = process_cpu_s(os.getpid())
    _burn(0.15)
    grown = process_cpu_s("self") - before
    assert 0.1 <= grown < 5.0  # clock ticks: 10 ms steps
    assert process_cpu_s(2**22 + 12345) == 0.0 and process_cpu_s(None) == 0.0
    me = ProcCpu.of(os.getpid())
    assert me is not None and me.name and me.total_s == me.user_s + me.system_s


def test_threads_are_named_and_each_counts_its_own_cpu():
    done = threading.Event()
    got: dict[str, float] = {}

    def worker() -> None:
        _burn(0.15)
        tid = threading.get_native_id()
        got["cpu"] = threads_cpu_s()[tid][1]
        done.set()

    t = threading.Thread(target=worker, name="burner")
    t.start()
    assert done.wait(10)
    t.join()
    assert got["cpu"] >= 0.1
    main = threads_cpu_s()[threading.get_native_id()]
    assert main[0] and main[1] >= 0.0
