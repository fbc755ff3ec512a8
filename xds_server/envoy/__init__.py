"""Envoy's side of the deployment: :mod:`~xds_server.envoy.bootstrap` finds the ``envoy`` binary
and renders the bootstrap template beside it (``envoy.yaml``, package data) with given ports and
every control-plane replica; :mod:`~xds_server.envoy.tls` adds TLS to its control-plane clusters;
:mod:`~xds_server.envoy.class_routes` renders the request-class routes.

Import from those modules: the package itself imports nothing, so a command that needs none of
it (``xds-server status``, ``drain``, ``shift``) starts without loading the xDS protos (~0.5 s of
CPU a start).
"""
