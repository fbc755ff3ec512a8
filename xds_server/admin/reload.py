"""``POST /reload`` on the admin endpoint: re-read the config file (bearer token, ``admin.token``).

Answers: 200 with the reload status (changes applied); 422 with the errors when the new file is
invalid (the running config stays); 409 when the server was started without a config file; 403
when no token is configured; 401 for a missing or wrong token.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from xds_server.admin.access import refused_token
from xds_server.admin.app import json_dumps
from xds_server.config import SentinelConfig

__all__ = ["add_reload_route"]

ReloadCommand = Callable[[str], Awaitable[dict]]
"""``reload_file(source) -> reload status``; ValueError when there is no file to reload."""


def add_reload_route(app: web.Application, config: Callable[[], SentinelConfig], reload_file: ReloadCommand) -> None:
    """Register ``POST /reload`` on ``app`` (before it is started)."""

    def answer(body: dict, status: int = 200) -> web.Response:
        return web.json_response(body, status=status, dumps=json_dumps)

    async def reload_handler(request: web.Request) -> web.Response:
        token = config().admin.token
        if token is None:
            return answer({"error": "reload is disabled: set admin.token in the config"}, status=403)
        if refused_token(request, token):  # constant time; counted and logged per peer
            return answer({"error": "missing or wrong bearer token"}, status=401)
        try:
            status = await reload_file("admin")
        except ValueError as e:
            return answer({"error": str(e)}, status=409)
        return answer(status, status=200 if status["ok"] else 422)

    app.router.add_post("/reload", reload_handler)
