"""Admin HTTP endpoint (aiohttp): JSON views of health and xDS state, Prometheus metrics.

Routes: ``/healthz`` (process up), ``/readyz`` (every cluster published), ``/nodes``,
``/nodes/{id}``, ``/clusters``, ``/xds/clients``, ``/config_dump``, ``/events``, ``/metrics``.
The admin app only reads the control plane's state.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from google.protobuf import json_format
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xds_server.xds.resources import CLA_TYPE_URL, CLUSTER_TYPE_URL

if TYPE_CHECKING:
    from xds_server.server import ControlPlane

__all__ = ["build_admin_app"]

_CP = web.AppKey("control_plane", object)

_STATES = ("COLD", "WARMING", "HEALTHY", "DEGRADED", "UNHEALTHY", "PROBATION", "DRAINING")


class _Collector:
    """Reads the control plane's state at scrape time (nothing is counted on the hot path twice)."""

    def __init__(self, cp: "ControlPlane") -> None:
        self.cp = cp

    def collect(self):
        cp = self.cp
        state = GaugeMetricFamily("sentinel_node_state", "1 for the node's current health state",
                                  labels=["cluster", "node", "state"])
        weight = GaugeMetricFamily("sentinel_node_weight", "published EDS load_balancing_weight",
                                   labels=["cluster", "node"])
        routed = GaugeMetricFamily("sentinel_node_routable", "1 if published HEALTHY to Envoy",
                                   labels=["cluster", "node"])
        rtt = GaugeMetricFamily("sentinel_node_ewma_rtt_ms", "EWMA of probe-stream ping RTT, ms",
                                labels=["cluster", "node"])
        ttft = GaugeMetricFamily("sentinel_node_last_ttft_ms", "last micro-probe TTFT, ms",
                                 labels=["cluster", "node"])
        hbs = CounterMetricFamily("sentinel_heartbeats", "heartbeats received", labels=["cluster", "node"])
        bad = CounterMetricFamily("sentinel_probe_malformed_messages", "malformed agent messages",
                                  labels=["cluster", "node"])
        for node_id, nh in cp.health.items():
            c = cp.node_cluster[node_id]
            for s in _STATES:
                state.add_metric([c, node_id, s], 1.0 if nh.state.value == s else 0.0)
            r = cp.routing.get(node_id)
            if r is not None:
                weight.add_metric([c, node_id], r.weight)
                routed.add_metric([c, node_id], 1.0 if r.health_status == "HEALTHY" else 0.0)
            if nh.ewma_rtt_ms is not None:
                rtt.add_metric([c, node_id], nh.ewma_rtt_ms)
            if nh.last_ttft_ms is not None:
                ttft.add_metric([c, node_id], nh.last_ttft_ms)
            hbs.add_metric([c, node_id], cp.heartbeats[node_id])
            bad.add_metric([c, node_id], cp.malformed[node_id])
        yield from (state, weight, routed, rtt, ttft, hbs, bad)
        yield from cp.ads.metric_families()
        if getattr(cp, "routing_feed", None) is not None:  # the relay's feed (routing_feed.py)
            yield from cp.routing_feed.metrics()
        tr = CounterMetricFamily("sentinel_health_events", "health transitions (kind to_<STATE>) and "
                                 "cluster-policy events", labels=["kind"])
        for k, v in sorted(cp.event_counts.items()):
            tr.add_metric([k], v)
        yield tr
        fs = GaugeMetricFamily("sentinel_fail_static", "1 while fail-static holds the last good assignment")
        fs.add_metric([], 1.0 if cp.fail_static.active else 0.0)
        yield fs
        ramp = GaugeMetricFamily("sentinel_node_ramp_percent", "PROBATION ramp, percent of full weight",
                                 labels=["cluster", "node"])
        for node_id, nh in cp.health.items():
            if nh.state.value == "PROBATION":
                ramp.add_metric([cp.node_cluster[node_id], node_id], nh.ramp_percent)
        yield ramp
        lag = CounterMetricFamily("sentinel_detection_timer_lag_deferrals",
                                  "detection timers deferred because our own event loop was late")
        lag.add_metric([], sum(s.lag_deferrals for s in cp.sessions.values()))
        yield lag


def build_admin_app(cp: "ControlPlane") -> web.Application:
    """The aiohttp application for a running :class:`~xds_server.server.ControlPlane`."""
    app = web.Application()
    app[_CP] = cp
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(cp))

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        missing = [c.name for c in cp.config.clusters if not cp.cla_version(c.name)]
        body = {"ready": not missing, "unpublished_clusters": missing}
        return web.json_response(body, status=200 if not missing else 503)

    async def nodes(_: web.Request) -> web.Response:
        return web.json_response({"nodes": [cp.node_view(n) for n in cp.node_cfg]})

    async def node(request: web.Request) -> web.Response:
        node_id = request.match_info["id"]
        if node_id not in cp.node_cfg:
            return web.json_response({"error": f"unknown node {node_id!r}"}, status=404)
        return web.json_response(cp.node_view(node_id))

    async def clusters(_: web.Request) -> web.Response:
        out = []
        for c in cp.config.clusters:
            views = [cp.node_view(n.id) for n in c.nodes]
            healthy = sum(1 for v in views if v["eds_health_status"] == "HEALTHY")
            out.append({
                "name": c.name,
                "nodes": len(views),
                "routable": healthy,
                "healthy_fraction": healthy / len(views),
                "xds_version": cp.cla_version(c.name),
                "published": bool(cp.cla_version(c.name)),
            })
        return web.json_response({"clusters": out})

    async def xds_clients(_: web.Request) -> web.Response:
        return web.json_response(cp.ads.clients_view())

    async def config_dump(_: web.Request) -> web.Response:
        def dump(tu: str) -> list[dict]:
            from envoy.config.cluster.v3 import cluster_pb2
            from envoy.config.endpoint.v3 import endpoint_pb2
            cls = cluster_pb2.Cluster if tu == CLUSTER_TYPE_URL else endpoint_pb2.ClusterLoadAssignment
            out = []
            for name, r in sorted(cp.cache.resources(tu).items()):
                msg = cls()
                msg.ParseFromString(r.any.value)
                out.append({"name": name, "version": r.version,
                            "resource": json_format.MessageToDict(msg)})
            return out
        return web.json_response({
            "config": cp.config.model_dump(mode="json"),
            "clusters": {"version": cp.cache.type_version(CLUSTER_TYPE_URL), "resources": dump(CLUSTER_TYPE_URL)},
            "endpoints": {"version": cp.cache.type_version(CLA_TYPE_URL), "resources": dump(CLA_TYPE_URL)},
        })

    async def events(request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", "200"))
        except ValueError:
            return web.json_response({"error": "limit must be an integer"}, status=400)
        recs = list(cp.events)[-max(0, limit):] if limit else []
        return web.json_response({"events": [r.to_json() for r in recs]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/nodes", nodes)
    app.router.add_get("/nodes/{id}", node)
    app.router.add_get("/clusters", clusters)
    app.router.add_get("/xds/clients", xds_clients)
    app.router.add_get("/config_dump", config_dump)
    app.router.add_get("/events", events)
    app.router.add_get("/metrics", metrics)

    async def drain(request: web.Request) -> web.Response:
        token = cp.config.admin.token
        if token is None:
            return web.json_response({"error": "drain is disabled: set admin.token in the config"}, status=403)
        if request.headers.get("Authorization", "") != f"Bearer {token}":
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        node_id = request.match_info["id"]
        reason = request.query.get("reason", "operator")[:200]
        want = request.path.endswith("/drain")
        try:
            view = cp.drain(node_id, want, reason)
        except KeyError:
            return web.json_response({"error": f"unknown node {node_id!r}"}, status=404)
        return web.json_response(view)

    app.router.add_post("/nodes/{id}/drain", drain)
    app.router.add_post("/nodes/{id}/undrain", drain)
    return app
