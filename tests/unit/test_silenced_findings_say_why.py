"""A finding of ruff or mypy is fixed, or silenced on its own line with its code and the reason
beside it (the checks themselves run in ``scripts/check``, not in the suite). Pure: reads files."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
