"""The suite's ``python -m`` processes are forked from a zygote that imported them once
(``xds_server.testing._zygote``); what such a child sees of its start, its output and its exit is
what an exec'd ``python -m`` sees, side by side (``ManagedProcess`` with an environment of its own
is exec'd)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from xds_server.testing import ManagedProcess, free_port
from xds_server.testing._zygote import ForkedChild

FACTS = "xds_server.testing._child_facts"


def run(tmp_path, name: str, args: list[str], forked: bool) -> tuple[int, list[str], ManagedProcess]:
    p = ManagedProcess(name, [sys.executable, "-m", FACTS, *args], tmp_path / f"{name}.log",
                       env=None if forked else {})
    p.start()
    try:
        assert isinstance(p.proc, ForkedChild) is forked
        code = p.proc.wait(20)
        deadline = time.monotonic() + 5
        while "atexit ran" not in p.output_tail() and time.monotonic() < deadline:
            time.sleep(0.02)
        return code, p.output_tail().splitlines(), p
    finally:
        p.stop()


@pytest.mark.parametrize("code", [0, 3])
def test_a_forked_child_sees_its_start_output_and_exit_as_an_execd_one(tmp_path, monkeypatch, code):
    monkeypatch.setenv("FACTS_MARK", f"set after the zygote started {code}")
    forked = run(tmp_path, "forked", [str(code)], forked=True)
    execd = run(tmp_path, "execd", [str(code)], forked=False)
    for got, lines, _ in (forked, execd):
        assert got == code, lines
        facts = json.loads(lines[0])
        assert facts["argv"][0].endswith("_child_facts.py") and facts["argv"][1:] == [str(code)], facts
        assert facts["name"] == "__main__" and facts["session_leader"] and facts["stdin"] == "", facts
        assert facts["mark"] == f"set after the zygote started {code}", facts
        assert lines[1:] == ["on stderr", "thread joined", "atexit ran"], lines
    assert forked[1] == execd[1]
    assert (tmp_path / "forked.log").read_bytes() == (tmp_path / "execd.log").read_bytes()


def test_an_uncaught_exception_exits_1_with_its_traceback_either_way(tmp_path):
    for forked in (True, False):
        code, lines, _ = run(tmp_path, f"raise-{forked}", ["0", "raise"], forked=forked)
        assert code == 1 and "RuntimeError: asked to raise" in lines, lines


def test_a_forked_engine_is_stopped_by_its_group_as_an_execd_one(tmp_path):
    codes = []
    for forked in (True, False):
        p = ManagedProcess(f"engine-{forked}", [sys.executable, "-m", "node_probe.cli", "sim-engine", "--port",
                                               str(free_port())], tmp_path / f"engine-{forked}.log",
                           ready_pattern="listening", env=None if forked else {})
        p.start()
        try:
            assert isinstance(p.proc, ForkedChild) is forked
            p.freeze()
            p.thaw()
            assert p.alive()
        finally:
            codes.append(p.stop())
        assert not p.alive()
    assert codes[0] == codes[1], codes


def test_the_switch_off_execs_every_process(tmp_path, monkeypatch):
    monkeypatch.setenv("XDS_SENTINEL_TEST_FORK", "0")
    p = ManagedProcess("execd", [sys.executable, "-m", FACTS, "0"], tmp_path / "execd.log")
    p.start()
    try:
        assert isinstance(p.proc, subprocess.Popen) and p.proc.wait(20) == 0
    finally:
        p.stop()


def test_a_zygote_that_cannot_start_is_said_once_and_processes_are_execd(tmp_path, monkeypatch, caplog):
    from xds_server.testing import _zygote

    monkeypatch.setattr(_zygote.Zygote, "_one", None)
    monkeypatch.setattr(_zygote.Zygote, "_failed", False)
    monkeypatch.setattr(_zygote, "SERVER", "xds_server.testing._no_such_module")
    started = []
    real_init = _zygote.Zygote.__init__

    def counting_init(self: _zygote.Zygote) -> None:
        started.append(1)
        real_init(self)

    monkeypatch.setattr(_zygote.Zygote, "__init__", counting_init)
    for i in range(2):  # forkable, but the zygote is not there: exec'd, and tried only once
        p = ManagedProcess(f"execd-{i}", [sys.executable, "-m", FACTS, "0"], tmp_path / f"execd-{i}.log")
        p.start()
        try:
            assert isinstance(p.proc, subprocess.Popen) and p.proc.wait(20) == 0
        finally:
            p.stop()
    assert started == [1]
    assert [r.getMessage() for r in caplog.records if "zygote could not start" in r.getMessage()], caplog.text
