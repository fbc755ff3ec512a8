"""An agent that cannot be reached is logged once per
``probe.logs.unreachable_interval``, not once per redial (real gRPC probe session, nothing listening)."""
from __future__ import annotations

import asyncio
import logging

from xds_server.config import parse_config
from xds_server.server import ControlPlane
from xds_server.testing import free_port


async def test_unreachable_agent_logs_one_line_not_one_per_retry(caplog):
    port = free_port()
    cfg = parse_config({
        "xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0"},
        "health": {"reconnect_backoff_initial_ms": 20, "reconnect_backoff_max_ms": 40},
        "probe": {"channel_initial_backoff_ms": 20},
        "clusters": [{"name": "llm", "nodes": [
            {"id": "gone", "address": "127.0.0.1:8001", "probe_address": f"127.0.0.1:{port}"}]}],
    })
    cp = ControlPlane(cfg)
    with caplog.at_level(logging.INFO, logger="xds_server.probing"):
        await cp.start()
        try:
            await asyncio.sleep(2.0)
        finally:
            await cp.stop()
    lines = [r for r in caplog.records if r.name == "xds_server.probing"
             and ("probe stream to" in r.getMessage() or "unreachable" in r.getMessage())]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == logging.WARNING and lines[0].node == "gone" and "UNAVAILABLE" in lines[0].reason
