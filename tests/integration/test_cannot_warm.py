"""A node that cannot warm says why (real agent, real xds-server, real HTTP).

An agent pointed at something that is not an inference engine (here an HTTP server that answers
404 to everything: the most common slip, a wrong ``--engine-url``) used to leave the node WARMING
"first heartbeat" forever, with failed probes counted in ``probe_failures`` but
``consecutive_probe_failures`` at 0 and ``last_probe_failure`` empty. Now /nodes, ``xds-server
status`` and /events say "cannot warm" with the last failure and the hint; the counter counts.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from xds_server.testing import ManagedProcess, free_port, wait_for


async def _not_an_engine(port: int) -> web.AppRunner:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=404, text="Not Found")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_agent_pointed_at_a_404_server_shows_cannot_warm_with_the_hint_in_nodes_status_and_events(
        tmp_path: Path):
    engine_port, agent_port, xds_port, admin_port = free_port(), free_port(), free_port(), free_port()
    runner = await _not_an_engine(engine_port)
    cfg = {"xds": {"listen": f"127.0.0.1:{xds_port}"}, "admin": {"listen": f"127.0.0.1:{admin_port}"},
           "clusters": [{"name": "llm", "nodes": [{"id": "wrong-url", "address": f"127.0.0.1:{engine_port}",
                                                   "probe_address": f"127.0.0.1:{agent_port}"}]}]}
    (tmp_path / "xds.yaml").write_text(yaml.safe_dump(cfg))
    procs = [
        ManagedProcess("agent", [sys.executable, "-m", "node_probe.cli", "--engine-url",
                                 f"http://127.0.0.1:{engine_port}", "--listen", f"127.0.0.1:{agent_port}",
                                 "--node-id", "wrong-url", "--probe-interval-s", "0.5"],
                       tmp_path / "agent.log", ready_pattern="listening"),
        ManagedProcess("xds-server", [sys.executable, "-m", "xds_server.cli", "serve", "--config",
                                      str(tmp_path / "xds.yaml")],
                       tmp_path / "xds.log", ready_pattern="admin listening"),
    ]
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        for p in procs:
            p.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async def node() -> dict:
                async with http.get(f"{admin}/nodes/wrong-url") as r:
                    return await r.json()

            async def cannot_warm() -> dict | None:
                n = await node()
                return n if n["reason"].startswith("cannot warm: ") else None

            n = await wait_for(cannot_warm, timeout_s=30, step_s=0.2,
                               what=lambda: f"no 'cannot warm'; agent log:\n{procs[0].output_tail()}")
            async with http.get(f"{admin}/events?limit=100") as r:
                events = [e for e in (await r.json())["events"] if e["node"] == "wrong-url"]
        hint = "/v1/models answered 404: is --engine-url an inference engine?"
        assert n["state"] == "WARMING" and n["routed"] is False and n["eds_health_status"] == "UNHEALTHY"
        assert n["consecutive_probe_failures"] >= 2
        assert n["reason"].startswith("cannot warm: ") and "consecutive probe failures from an engine that answers" \
            in n["reason"] and hint in n["reason"]
        assert n["display_reason"] == n["reason"]            # said once, not repeated by the display
        assert hint in n["not_routed_because"]
        assert n["last_probe_failure"].startswith("HTTP_STATUS 404: ") and hint in n["last_probe_failure"]
        reported = [e for e in events if e["reason"].startswith("cannot warm: ")]
        assert len(reported) == 1 and reported[0]["from"] == reported[0]["to"] == "WARMING"
        assert hint in reported[0]["reason"]
        # off the event loop: the 404 server above answers on it, and a probe it left unanswered
        # while the CLI starts would time out and change the node's reason under us
        out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "xds_server.cli", "status",
                                                       "--admin", admin], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        row = next(line for line in out.stdout.splitlines() if line.startswith("wrong-url"))
        assert " WARMING " in row and "cannot warm: " in row and "is --engine-url an inference engine?" in row
    finally:
        for p in reversed(procs):
            p.stop()
        await runner.cleanup()
