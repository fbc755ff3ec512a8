"""xds_server.process.event_loop: which loop a choice gives, running on it, and a clear refusal when
uvloop is asked for and missing (``xds-server serve --loop``, ``sentinel-relay --loop``)."""
from __future__ import annotations

import asyncio
import sys

import pytest

from sentinel_relay import cli as relay_cli
from xds_server import cli
from xds_server.process import event_loop


async def _name_and(x: int) -> tuple[str, int]:
    await asyncio.sleep(0)
    return event_loop.running_loop_name(), x + 1


@pytest.fixture
def no_uvloop(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError


def test_each_choice_runs_on_its_loop():
    pytest.importorskip("uvloop", reason="uvloop is in the dev extra")
    assert event_loop.run(_name_and(1)) == ("asyncio", 2)
    assert event_loop.run(_name_and(2), "asyncio") == ("asyncio", 3)
    assert event_loop.run(_name_and(3), "uvloop") == ("uvloop", 4)
    assert event_loop.run(_name_and(4), "auto") == ("uvloop", 5)
    assert [event_loop.resolve(c) for c in event_loop.LOOPS] == ["asyncio", "uvloop", "uvloop"]


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(no_uvloop):
    assert event_loop.resolve("auto") == "asyncio"
    assert event_loop.run(_name_and(1), "auto") == ("asyncio", 2)
    coro = _name_and(1)
    with pytest.raises(event_loop.LoopUnavailable, match=r"--loop uvloop: uvloop is not installed"):
        event_loop.run(coro, "uvloop")
    assert coro.cr_frame is None  # closed, not left to warn "never awaited"


def test_an_unknown_choice_is_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"--loop: 'trio' is not one of asyncio, uvloop, auto"):
        event_loop.resolve("trio")


def test_running_loop_name_needs_a_running_loop():
    with pytest.raises(RuntimeError):
        event_loop.running_loop_name()


def test_serve_and_the_relay_refuse_a_missing_uvloop_with_exit_2(no_uvloop, tmp_path, capsys):
    cfg = tmp_path / "xds.yaml"
    cfg.write_text("clusters: []\n")
    assert cli.main(["serve", str(cfg), "--loop", "uvloop"]) == 2
    assert "xds-server: --loop uvloop: uvloop is not installed" in capsys.readouterr().err
    assert relay_cli.main(["--upstream", "http://127.0.0.1:1", "--loop", "uvloop"]) == 2
    assert "sentinel-relay: --loop uvloop: uvloop is not installed" in capsys.readouterr().err
