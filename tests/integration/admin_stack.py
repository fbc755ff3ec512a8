"""One control plane with in-memory probes for the admin tests (test_admin_edge, test_dashboard_live)."""
from __future__ import annotations

import contextlib

from xds_server.config import parse_config
from xds_server.probing.memory import InMemoryProbes
from xds_server.server import ControlPlane


def three_node_admin_config(token: str, **admin) -> dict:
    """A control plane config for admin tests: cluster ``llm`` with nodes n0..n2 (never dialled:
    in-memory probes), admin ``token`` and any other ``admin`` fields, ramps at 100 %."""
    return {
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
        "admin": {"listen": "127.0.0.1:0", "token": token, **admin},
        "health": {"ramp_start_percent": 100},
        "clusters": [{"name": "llm", "nodes": [
            {"id": f"n{i}", "address": f"127.0.0.1:{8001 + i}", "probe_address": f"127.0.0.1:{9001 + i}"}
            for i in range(3)]}],
    }


@contextlib.asynccontextmanager
async def healthy_admin_stack(cfg: dict):
    """(control plane, in-memory probes, admin base URL) on ``cfg`` with every node HEALTHY
    (one heartbeat and one good probe each); the control plane is stopped on exit."""
    probes = InMemoryProbes()
    cp = ControlPlane(parse_config(cfg), probe_sources=probes)
    await cp.start()
    try:
        for _, node in cp.config.nodes():
            probes[node.id].heartbeat()
            probes[node.id].probe(ttft_ms=20.0)
        yield cp, probes, f"http://127.0.0.1:{cp.admin_port}"
    finally:
        await cp.stop()
