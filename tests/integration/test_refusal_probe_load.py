"""A node refusing everything with 429 takes no new share, and neither does it get
extra probes. Every failed probe result made the control plane ask the agent for a confirming
probe at once (``ProbeNow``), so an engine answering 429, the engine saying it is full, was probed
~3 times a second instead of at the agent's busy cadence. A refusal is an answer: no ProbeNow.
Real gRPC: the control plane's probe session against a scripted agent (tests/integration)."""
from __future__ import annotations

import asyncio

from scripted_agent import ScriptedAgent, result

from node_probe.proto import probe_pb2
from xds_server.config import parse_config
from xds_server.health.model import NodeState
from xds_server.server import ControlPlane
from xds_server.testing import wait_for


def confirms(agent: ScriptedAgent) -> list[str]:
    """The ProbeNow requests that confirm a failed result (not the one sent on connect)."""
    return [r for r in agent.probe_now_reasons() if r.startswith("confirm probe failure")]


async def test_429_results_ask_no_confirming_probe_while_a_timeout_does():
    agent = await ScriptedAgent.start()
    cp = ControlPlane(parse_config({
        "xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0"},
        "clusters": [{"name": "llm", "nodes": [
            {"id": "a", "address": "127.0.0.1:8001", "probe_address": f"127.0.0.1:{agent.port}"}]}],
    }))
    await cp.start()
    try:
        await wait_for(lambda: cp.health["a"].state is NodeState.WARMING, timeout_s=10)
        for _ in range(5):
            agent.send(result(ok=False, ttft_ms=0.0, failure=probe_pb2.FAILURE_KIND_HTTP_STATUS, http_status=429,
                              detail="HTTP 429 (engine overloaded: load, not death)"))
        await wait_for(lambda: cp.health["a"].probe.seen >= 5, timeout_s=10)
        await asyncio.sleep(0.3)
        assert confirms(agent) == []
        agent.send(result(ok=False, ttft_ms=0.0, failure=probe_pb2.FAILURE_KIND_TIMEOUT,
                          detail="no response headers within 800 ms"))
        await wait_for(lambda: confirms(agent), timeout_s=10)
        assert confirms(agent) == ["confirm probe failure: TIMEOUT"]
    finally:
        await cp.stop()
        await agent.stop()
