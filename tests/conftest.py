"""Fixtures shared by every test package: tiny aiohttp servers on free 127.0.0.1 ports."""
from __future__ import annotations

import os

# The gRPC C core's own stderr lines (GOAWAY notes and the like) are noise in test output: off
# unless the environment asks for them. Set before any test module imports grpc.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def serve():
    """``await serve({(method, path): handler})`` starts an aiohttp app on 127.0.0.1 (free port)
    and returns its base URL; every app is stopped at teardown."""
    runners: list[web.AppRunner] = []

    async def start(routes: dict[tuple[str, str], Handler]) -> str:
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
