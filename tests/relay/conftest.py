"""Fixtures for the relay's tests: tiny aiohttp upstreams on free 127.0.0.1 ports."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).parent))  # relay_fake_engine


@pytest.fixture
async def serve():
    """``await serve({(method, path): handler})`` -> base URL; stopped at teardown."""
    runners: list[web.AppRunner] = []

    async def start(routes):
        app = web.Application()
        for (method, path), handler in routes.items():
            app.router.add_route(method, path, handler)
        runner = web.AppRunner(app, shutdown_timeout=0.2, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()
