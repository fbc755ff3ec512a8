"""The committed generated code under node_probe/proto/ matches protos/ (regenerate to check)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_regenerating_probe_proto_gives_identical_files(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.generate(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["probe_pb2.py", "probe_pb2.pyi", "probe_pb2_grpc.py"]
    for name in names:
        committed = (ROOT / "node_probe" / "proto" / name).read_text()
        assert (tmp_path / name).read_text() == committed, f"{name} is stale: run python scripts/gen_protos.py"
