"""Issue 13 item 4: README's "Running it for real" block runs as written, in an empty temp dir
(nothing beside it: no ../shared, no notes/). The block is read from README.md between the
``readme-run`` markers; only two things differ from a reader's run: its first line (create the
venv and install) is replaced by this test's venv on PATH, and its fixed ports are swapped for
free ones. Every process it starts is in one process group, killed at the end."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from xds_server.envoy.bootstrap import EnvoyNotFound, find_envoy
from xds_server.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
PORTS = (8000, 50051, 18000, 19000, 10000, 9901)


def readme_block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- readme-run:begin -->\s*```sh\n(.*?)```\s*<!-- readme-run:end -->", text, re.S)
    assert m, "README.md lost its readme-run block"
    return m.group(1)


def test_readme_run_block_runs_as_written(tmp_path):
    try:
        find_envoy()
    except EnvoyNotFound:
        pytest.skip("no envoy binary")
    block = readme_block()
    lines = block.splitlines()
    assert lines[0].startswith("python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]'")
    script = "\n".join(lines[1:])
    for port in PORTS:
        script = re.sub(rf"\b{port}\b", str(free_port()), script)
    script = script.replace('export PATH="$PWD/.venv/bin:$PATH"', f'export PATH="{Path(sys.executable).parent}:$PATH"')
    (tmp_path / "run.sh").write_text("set -e\n" + script + "\nwait\n")
    # Output goes to a file, not a pipe: background processes left by a failed step would hold a
    # pipe open, and a wait for its end would hide the step's own exit status and message.
    log = tmp_path / "run.log"
    with log.open("wb") as out_file:
        p = subprocess.Popen(["bash", "-x", "run.sh"], cwd=tmp_path, stdout=out_file, stderr=subprocess.STDOUT,
                             start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    out = log.read_bytes()
    text = out.decode("utf-8", "replace")
    assert p.returncode == 0, text[-4000:]
    assert "xds.yaml: OK (1 cluster(s), 1 node(s))" in text
    assert '"text"' in text and "sim-model" in text          # the completion through Envoy
    assert re.search(r"gpu-a\s+llm\s+(PROBATION|HEALTHY)", text), text[-4000:]  # status
    assert "drain gpu-a: now DRAINING, weight -" in text       # drain: one line, as status shows it
    assert (tmp_path / "envoy.yaml").exists() and (tmp_path / "xds-state.json").exists()
