"""Regenerate node_probe/proto/ from protos/ with grpcio-tools.

Usage: python scripts/gen_protos.py [OUT_DIR]   (default: node_probe/proto)

The proto path is mapped so the generated modules import as ``node_probe.proto.probe_pb2``.
"""
from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]


def generate(out_dir: Path) -> None:
    """Write probe_pb2.py, probe_pb2.pyi and probe_pb2_grpc.py into ``out_dir``.

    Raises RuntimeError if protoc fails.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    # Virtual path "node_probe/proto/probe.proto" -> imports "from node_probe.proto import ...".
    # protoc writes relative to --*_out, so generate into a staging root and move.
    staging = out_dir / "_staging"
    staging.mkdir(exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"--proto_path=node_probe/proto={ROOT / 'protos' / 'node_probe' / 'v1'}",
        f"--python_out={staging}",
        f"--pyi_out={staging}",
        f"--grpc_python_out={staging}",
        "node_probe/proto/probe.proto",
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    gen = staging / "node_probe" / "proto"
    for f in gen.iterdir():
        f.replace(out_dir / f.name)
    for d in (gen, staging / "node_probe", staging):
        d.rmdir()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "node_probe" / "proto")
