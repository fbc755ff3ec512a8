"""Admin routes of gated shifts (:class:`~xds_server.load.gated_shifts.ShiftService`), registered by the server.

- ``POST /clusters/{name}/shift`` (bearer token, ``admin.token``), JSON body::

      {"to": "eu-west" | 1, "to_kind": "region" | "priority" (default: a number is a priority),
       "step_percent": 10, "every_s": 300 (or "every": "5m"), "hard": false,
       "start_at": <wall s, optional: the same on every replica>}

  200 with the shift's view; 400 naming the field (``{"error", "field"}``), 404 unknown cluster,
  409 a shift already running on the cluster; 403 no token configured; 401 missing or wrong token.
- ``GET /clusters/{name}/shift``: the view (phase ``none`` when the cluster has none; 404 for an
  unknown cluster); ``GET /shifts``: all.
- ``POST /clusters/{name}/shift/pause``, ``/resume``, ``/cancel`` (token): 200 with the view,
  404 no shift, 409 not possible in its phase (a finished shift cannot be paused).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from xds_server.admin.access import refused_token
from xds_server.admin.app import json_dumps
from xds_server.load.gated_shifts import ShiftRequestError, ShiftService
from xds_server.process.cancellation import cancel_and_wait

__all__ = ["MAX_BODY_BYTES", "add_shift_routes"]

MAX_BODY_BYTES = 4096


def _answer(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=json_dumps)


def add_shift_routes(app: web.Application, svc: ShiftService) -> None:
    """Register the routes above and the shifts' tick loop (``svc.run``) for the app's lifetime."""

    def refused(request: web.Request) -> web.Response | None:
        token = svc.admin_token()
        if token is None:
            return _answer({"error": "shifts are disabled: set admin.token in the config"}, status=403)
        if refused_token(request, token):
            return _answer({"error": "missing or wrong bearer token"}, status=401)
        return None

    async def post_shift(request: web.Request) -> web.Response:
        if (no := refused(request)) is not None:
            return no
        raw = await request.content.read(MAX_BODY_BYTES + 1)
        if len(raw) > MAX_BODY_BYTES:
            return _answer({"error": f"body: larger than {MAX_BODY_BYTES} bytes", "field": "body"}, status=400)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return _answer({"error": "body: not JSON", "field": "body"}, status=400)
        try:
            return _answer(svc.begin(request.match_info["name"], body))
        except ShiftRequestError as e:
            return _answer({"error": e.message, "field": e.field}, status=e.status)

    async def get_shift(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        v = svc.view(name)
        if v is None:
            try:
                svc.cluster_config(name)  # 404 for an unknown cluster only
            except ShiftRequestError as e:
                return _answer({"error": e.message, "field": e.field}, status=e.status)
            return _answer({"cluster": name, "phase": "none", "reason": "no shift: the configured layout"})
        return _answer(v)

    async def all_shifts(_: web.Request) -> web.Response:
        return _answer({"shifts": [svc.view(n) for n in sorted(svc.shifts)]})

    async def command(request: web.Request) -> web.Response:
        if (no := refused(request)) is not None:
            return no
        try:
            return _answer(svc.command(request.match_info["name"], request.match_info["what"]))
        except ShiftRequestError as e:
            return _answer({"error": e.message, "field": e.field}, status=e.status)

    async def ticking(_app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(svc.run())
        yield
        await cancel_and_wait(task)

    app.router.add_post("/clusters/{name}/shift", post_shift)
    app.router.add_get("/clusters/{name}/shift", get_shift)
    app.router.add_get("/shifts", all_shifts)
    app.router.add_post("/clusters/{name}/shift/{what:pause|resume|cancel}", command)
    app.cleanup_ctx.append(ticking)
