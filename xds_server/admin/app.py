"""Admin HTTP endpoint (aiohttp): JSON views of health and xDS state, Prometheus metrics, and
the operator's drain/undrain.

Routes: ``/healthz`` (process up), ``/readyz`` (every cluster published), ``/nodes``,
``/nodes/{id}``, ``/clusters``, ``/xds/clients``, ``/config_dump``, ``/events``, ``/metrics``;
``POST /nodes/{id}/drain`` and ``/undrain`` (bearer token, ``admin.token``). Every GET only
reads (:class:`~xds_server.control.views.ControlPlaneView`); drain/undrain change a node's state
through the ``drain`` command the server passes in.
"""
from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from xds_server.admin.metrics import ControlPlaneCollector
from xds_server.control.views import ControlPlaneView

__all__ = ["DrainCommand", "build_admin_app"]

DrainCommand = Callable[[str, bool, str], dict]
"""``drain(node_id, drain, reason) -> node view``; KeyError for an unknown node."""


def build_admin_app(view: ControlPlaneView, drain: DrainCommand) -> web.Application:
    """The aiohttp application over a control plane's ``view`` and its ``drain`` command."""
    app = web.Application()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControlPlaneCollector(view))

    def unknown_node(node_id: str) -> web.Response:
        return _json({"error": f"unknown node {node_id!r}"}, status=404)

    def _json(body, status: int = 200) -> web.Response:
        return web.json_response(body, status=status)

    async def healthz(_: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ready, missing = view.readiness()
        return _json({"ready": ready, "unpublished_clusters": missing}, status=200 if ready else 503)

    async def nodes(_: web.Request) -> web.Response:
        return _json({"nodes": view.nodes()})

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
        try:
            limit = int(request.query.get("limit", "200"))
        except ValueError:
            return _json({"error": "limit must be an integer"}, status=400)
        return _json({"events": view.events(max(0, limit))})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def drain_handler(request: web.Request) -> web.Response:
        admin = view.config.admin
        if admin.token is None:
            return _json({"error": "drain is disabled: set admin.token in the config"}, status=403)
        if request.headers.get("Authorization", "") != f"Bearer {admin.token}":
            return _json({"error": "missing or wrong bearer token"}, status=401)
        node_id = request.match_info["id"]
        if not view.has_node(node_id):
            return unknown_node(node_id)
        reason = request.query.get("reason", "operator")[:admin.drain_reason_max_chars]
        want = request.path.endswith("/drain")
        try:
            body = drain(node_id, want, reason)
        except KeyError:
            return unknown_node(node_id)
        return _json(body)

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
