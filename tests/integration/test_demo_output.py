"""Issue 26 item 7: ``xds-server demo`` as a new user runs it (a real subprocess: Envoy, engines,
agents, relay): every fault names a node (the third named an IP), the quiet baseline phase shows
no retry (requests caught by the first fault counted there before), and the relay's lines are
whole lines of the demo's narrative, not log lines cut into it."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.envoy


def test_demo_names_nodes_shows_a_quiet_baseline_and_whole_relay_lines():
    from xds_server.envoy.bootstrap import EnvoyNotFound, find_envoy

    try:
        find_envoy(None)
    except EnvoyNotFound as e:
        pytest.skip(str(e))
    r = subprocess.run([sys.executable, "-m", "xds_server.cli", "demo"], capture_output=True, text=True,
                       timeout=240, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    faults = re.findall(r"^Fault(?: 3)?: .*? (?:on|of) (\S+)", out, re.M)
    assert len(faults) == 3 and faults[:2] == ["gpu-a", "gpu-b"] and faults[2].startswith("gpu-"), faults
    base = re.search(r"^  baseline\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", out, re.M)
    assert base, out
    failed, retried, _, max_ms = (int(x) for x in base.groups()[3:])
    assert failed == 0 and retried == 0 and max_ms < 1000, base.group(0)
    ejected = r"^  relay: node gpu-\S+ \(127\.0\.0\.1:\d+\) ejected: rescuing 1 requests \(.+\)$"
    assert re.search(ejected, out, re.M), out
    assert not re.search(r"^\d{4}-\d\d-\d\dT", out, re.M), "a log line cut into the demo's output"
    assert "a fault's phase from 0.3 s before it strikes" in out
