"""Admin HTTP endpoint (aiohttp): JSON views of health and xDS state, Prometheus metrics, and
the operator's drain/undrain.

Every answer is a bounded JSON (or Prometheus text) document, never a 5xx for anything a client
sends: bad query values are 400 with a message naming the parameter, non-finite numbers are
written as ``null`` (valid JSON always), client text echoed back is clipped and escaped, and a
malformed HTTP request is logged as one rate-limited line, never a traceback.

Routes: ``/`` (the dashboard: static HTML/JS/CSS from ``admin/static``, no build step, no
CDN), ``/live`` (the dashboard's Server-Sent Events feed, :mod:`xds_server.admin.live`),
``/history`` (its recent past, fetched with the page: :mod:`xds_server.admin.history`),
``/healthz`` (process up), ``/readyz`` (every cluster published and at least one node
routable; the body says why not), ``/nodes``,
``/nodes/{id}``, ``/clusters``, ``/xds/clients``, ``/config_dump``, ``/events``, ``/metrics``;
``POST /nodes/{id}/drain`` and ``/undrain`` (bearer token, ``admin.token``). Every GET only
reads (:class:`~xds_server.admin.views.ControlPlaneView`); drain/undrain change a node's state
through the ``drain`` command the server passes in.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from xds_server.admin.access import REFUSALS, refused_token
from xds_server.admin.history import History
from xds_server.admin.live import LiveFeed
from xds_server.admin.metrics import ControlPlaneCollector, EventLoopCollector
from xds_server.admin.views import ControlPlaneView
from xds_server.process.cancellation import cancel_and_wait
from xds_server.process.untrusted import RateLimitedLog, clip, for_log

__all__ = ["DrainCommand", "HttpErrorLog", "build_admin_app", "json_dumps"]

log = logging.getLogger(__name__)

EVENTS_DEFAULT_LIMIT = 200
STATIC_DIR = Path(__file__).parent / "static"


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_dumps(obj: Any) -> str:
    """JSON text of ``obj`` with every NaN/Infinity written as ``null`` (strict JSON)."""
    try:
        return json.dumps(obj, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=json_dumps)


class HttpErrorLog(logging.LoggerAdapter):
    """The logger aiohttp's request handler writes to: an exception (malformed HTTP, a client
    that went away) becomes one WARNING line without traceback, at most one per exception type
    per ``interval_s``; everything else passes through without ``exc_info``."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        super().__init__(logger, {})
        self._rl = RateLimitedLog(logger, interval_s, max_keys=64)

    def log(self, level: int, msg: object, *args: object, exc_info: object = None, **kwargs: object) -> None:
        if exc_info:
            exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
            if level >= logging.WARNING:
                name = type(exc).__name__ if exc is not None else "error"
                self._rl.warning(time.monotonic(), name, "admin: request failed (%s: %s)", name,
                                 for_log(str(exc) if exc is not None else "", 200))
                return
        self.logger.log(level, msg, *args)


_HISTORY_SLICE = 200
"""Nodes per slice of a history sample (~5 ms of the event loop on the test machine)."""


def _history(view: ControlPlaneView, app: web.Application) -> History | None:
    """The dashboard's recent history, sampled every ``admin.history_interval`` from the
    app's start to its cleanup (whether a browser listens or not); None when ``admin.history``
    is 0. Its size is fixed at start (a reload of the two fields applies at the next start)."""
    cfg = view.config.admin
    if cfg.history.s <= 0:
        return None
    interval_s = cfg.history_interval.s
    history = History(max(1, round(cfg.history.s / interval_s)), interval_s)

    async def sample() -> None:
        while True:
            try:
                # in slices, the event loop free between them: a sample of 2,000 nodes in one go
                # stopped it for ~50 ms every interval, a frozen host's detection waiting behind
                ids, rows, at = view.node_ids(), [], time.time()
                for k in range(0, len(ids), _HISTORY_SLICE):
                    rows += view.history_rows(ids[k:k + _HISTORY_SLICE])
                    await asyncio.sleep(0)
                history.add(at, rows)
            except Exception:  # a view error must not end the history for the rest of the run
                log.exception("admin: history sample failed")
            await asyncio.sleep(interval_s)

    async def run(_app: web.Application):
        task = asyncio.get_running_loop().create_task(sample(), name="admin-history")
        yield
        await cancel_and_wait(task)

    app.cleanup_ctx.append(run)
    return history


DrainCommand = Callable[[str, bool, str], dict]
"""``drain(node_id, drain, reason) -> node view``; KeyError for an unknown node."""


def build_admin_app(view: ControlPlaneView, drain: DrainCommand) -> web.Application:
    """The aiohttp application over a control plane's ``view`` and its ``drain`` command."""
    app = web.Application()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControlPlaneCollector(view))
    registry.register(EventLoopCollector())
    ProcessCollector(registry=registry)  # process_resident_memory_bytes, open fds, CPU seconds
    live = LiveFeed(view, json_dumps)
    if view.refusals is not None:
        app[REFUSALS] = view.refusals  # the admin token check counts its refusals there
    registry.register(live)  # sentinel_admin_live_clients, its drops and refusals
    app.on_startup.append(live.start)
    app.on_shutdown.append(live.close)  # before aiohttp waits for open requests: ends SSE streams

    history = _history(view, app)
    history_body: list = [-1, b""]  # (samples added when encoded, the encoded answer): one encoding per sample

    async def history_handler(_: web.Request) -> web.Response:
        if history is None:
            return _json({"error": "history is off: admin.history is 0"}, status=404)
        if history_body[0] != history.added:
            history_body[:] = [history.added, json_dumps(history.to_json()).encode()]
        return web.Response(body=history_body[1], content_type="application/json")

    async def dashboard(_: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    def unknown_node(node_id: str) -> web.Response:
        return _json({"error": f"unknown node {for_log(node_id, 64)!r}"}, status=404)

    async def healthz(_: web.Request) -> web.Response:
        return _json({"status": "ok", "replica": view.config.xds.replica_id})

    async def readyz(_: web.Request) -> web.Response:
        published, missing = view.readiness()
        routable = view.routable_counts()
        total = sum(routable.values())
        why = []
        if missing:
            why.append(f"{len(missing)} cluster(s) not published yet")
        if published and total == 0:
            why.append("0 routable nodes: Envoy has nowhere to send requests")
        certs = view.cert_watch.reasons() if view.cert_watch is not None else []  # within tls.expiry_warning_days
        why += [c for c in certs if " expired at " in c]  # an expired certificate is not ready; a near one warns
        ready = not why
        return _json({"ready": ready, "why_not_ready": "; ".join(why) or None, "certificate_warnings": certs,
                      "unpublished_clusters": missing,
                      "routable_nodes": total, "routable_by_cluster": routable,
                      "config_reload": view.reload_status(), "discovery": view.discovery_status()},
                     status=200 if ready else 503)

    async def nodes(_: web.Request) -> web.Response:
        return _json({"fail_static": view.fail_static_view(), "cluster_failures": view.cluster_failures(),
                      "shifts": view.shift_views(), "nodes": view.nodes()})

    async def node(request: web.Request) -> web.Response:
        node_id = request.match_info["id"]
        if not view.has_node(node_id):
            return unknown_node(node_id)
        return _json(view.node(node_id))

    async def clusters(_: web.Request) -> web.Response:
        return _json({"clusters": view.cluster_summaries()})

    async def xds_clients(_: web.Request) -> web.Response:
        return _json(view.xds_clients())

    async def config_dump(_: web.Request) -> web.Response:
        return _json(view.config_dump())

    async def events(request: web.Request) -> web.Response:
        raw = request.query.get("limit", str(EVENTS_DEFAULT_LIMIT))
        try:
            limit = int(raw)
        except ValueError:
            return _json({"error": f"limit must be an integer >= 0, got {for_log(raw, 32)!r}"}, status=400)
        if limit < 0:
            return _json({"error": f"limit must be an integer >= 0, got {limit}"}, status=400)
        return _json({"events": view.events(limit)})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def drain_handler(request: web.Request) -> web.Response:
        admin = view.config.admin
        if admin.token is None:
            return _json({"error": "drain is disabled: set admin.token in the config"}, status=403)
        if refused_token(request, admin.token):  # constant time; counted and logged per peer
            return _json({"error": "missing or wrong bearer token"}, status=401)
        node_id = request.match_info["id"]
        if not view.has_node(node_id):
            return unknown_node(node_id)
        reason = clip(request.query.get("reason", "operator"), admin.drain_reason_max_chars)
        want = request.path.endswith("/drain")
        try:
            body = drain(node_id, want, reason)
        except KeyError:
            return unknown_node(node_id)
        return _json(body)

    app.router.add_get("/", dashboard)
    app.router.add_static("/static/", STATIC_DIR, follow_symlinks=False)
    app.router.add_get("/live", live.handle)
    app.router.add_get("/history", history_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/nodes", nodes)
    app.router.add_get("/nodes/{id}", node)
    app.router.add_get("/clusters", clusters)
    app.router.add_get("/xds/clients", xds_clients)
    app.router.add_get("/config_dump", config_dump)
    app.router.add_get("/events", events)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/nodes/{id}/drain", drain_handler)
    app.router.add_post("/nodes/{id}/undrain", drain_handler)
    return app
