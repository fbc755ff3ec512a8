"""Envoy's side of the deployment: :mod:`~xds_server.envoy.bootstrap` finds the ``envoy`` binary
and renders the bootstrap template beside it (``envoy.yaml``, package data) with given ports and
every control-plane replica; :mod:`~xds_server.envoy.tls` adds TLS to its control-plane clusters;
:mod:`~xds_server.envoy.class_routes` renders the request-class routes.
"""
from xds_server.envoy.bootstrap import (
    BOOTSTRAP_TEMPLATE,
    ROUTE_HEADER,
    ControlPlaneGroup,
    EnvoyNotFound,
    find_envoy,
    render_bootstrap,
    write_bootstrap,
)

__all__ = ["BOOTSTRAP_TEMPLATE", "ROUTE_HEADER", "ControlPlaneGroup", "EnvoyNotFound", "find_envoy", "render_bootstrap",
           "write_bootstrap"]
