"""Regenerate the gRPC modules from protos/ with grpcio-tools.

Usage: python scripts/gen_protos.py

- protos/node_probe/v1/probe.proto -> node_probe/proto/ (imports as ``node_probe.proto.probe_pb2``)
- protos/sentinel/routing/v1/routing.proto -> xds_server/proto/ (``xds_server.proto.routing_pb2``)
"""
from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]


# (source directory under protos/, proto file name, Python package the modules import from)
PROTOS = (
    ("node_probe/v1", "probe.proto", "node_probe.proto"),
    ("sentinel/routing/v1", "routing.proto", "xds_server.proto"),
)


def generate(out_root: Path) -> None:
    """Write NAME_pb2.py, NAME_pb2.pyi and NAME_pb2_grpc.py for every proto under ``out_root``.

    Raises RuntimeError if protoc fails.
    """
    for src, name, package in PROTOS:
        generate_one(src, name, package, out_root / Path(*package.split(".")))


def generate_one(src: str, name: str, package: str, out_dir: Path) -> None:
    """Generate one proto's modules into ``out_dir``. Raises RuntimeError if protoc fails."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # Virtual path "<package path>/NAME.proto" -> imports "from <package> import ...".
    # protoc writes relative to --*_out, so generate into a staging root and move.
    staging = out_dir / "_staging"
    staging.mkdir(exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"--proto_path={package.replace('.', '/')}={ROOT / 'protos' / src}",
        f"--python_out={staging}",
        f"--pyi_out={staging}",
        f"--grpc_python_out={staging}",
        f"{package.replace('.', '/')}/{name}",
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    parts = package.split(".")
    gen = staging.joinpath(*parts)
    for f in gen.iterdir():
        f.replace(out_dir / f.name)
    for i in range(len(parts), -1, -1):
        staging.joinpath(*parts[:i]).rmdir()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
