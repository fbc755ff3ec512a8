"""The code's own checks, with zero findings: ruff (lint and import order) over everything we
write, mypy over the three packages (strict for health/, control/, xds/ and the relay's pure
core). Both read their settings from pyproject.toml; a finding is fixed, or silenced on its own
line with the reason beside it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    r = _run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_finds_nothing():
    r = _run(str(BIN / "mypy"), "--no-incremental")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr
    assert "Success: no issues found" in r.stdout


def test_every_silenced_finding_says_why():
    """A ``# type: ignore[...]`` or ``# noqa: ...`` names its code and carries a reason after it."""
    bare = []
    markers = ("# type" + ": ignore", "# no" + "qa")  # split, so this file does not match itself
    for pkg in ("xds_server", "node_probe", "sentinel_relay", "tests", "benchmarks", "scripts"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for no, line in enumerate(path.read_text().splitlines(), 1):
                for marker in markers:
                    if marker not in line:
                        continue
                    rest = line.split(marker, 1)[1]
                    coded = rest.startswith("[") if marker == markers[0] else rest.startswith(":")
                    reason = rest.split("]", 1)[1] if marker == markers[0] and "]" in rest else (
                        rest.split(None, 2)[2] if marker == markers[1] and len(rest.split(None, 2)) > 2 else "")
                    if not coded or not reason.strip(" #"):
                        bare.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert bare == []
