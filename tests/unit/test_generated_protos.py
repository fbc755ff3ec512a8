"""The committed generated gRPC modules match protos/ (regenerate into a temp dir and compare)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("package,stem", [("node_probe/proto", "probe"), ("xds_server/proto", "routing")])
def test_regenerating_each_proto_gives_identical_files(tmp_path: Path, package: str, stem: str):
    _gen_module().generate(tmp_path)
    out = tmp_path / package
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]
    for name in names:
        committed = (ROOT / package / name).read_text()
        assert (out / name).read_text() == committed, f"{name} is stale: run python scripts/gen_protos.py"
