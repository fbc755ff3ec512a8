"""Envoy's side of the deployment: :mod:`~xds_server.envoy.bootstrap` finds the ``envoy`` binary
and renders the bootstrap template beside it (``envoy.yaml``, package data) with given ports,
every control-plane replica and TLS.
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
