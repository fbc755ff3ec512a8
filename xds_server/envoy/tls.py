"""TLS on the bootstrap's control-plane clusters: the ``transport_socket`` that verifies the
control plane (and presents Envoy's client certificate for mutual TLS), inline files or
filesystem SDS files Envoy watches (rotation without a restart), put on every cluster a rendered
bootstrap (:mod:`xds_server.envoy.bootstrap`) uses to reach a control plane.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["SDS_CA_FILE", "SDS_CERT_FILE", "add_xds_tls", "xds_tls_sds_secrets", "xds_tls_transport_socket"]


def _validation(ca_file: str, server_name: str | None) -> dict[str, Any]:
    v: dict[str, Any] = {"trusted_ca": {"filename": ca_file}}
    if server_name:
        v["match_typed_subject_alt_names"] = [{"san_type": "DNS", "matcher": {"exact": server_name}}]
    return v


SDS_CA_FILE = "xds-ca-sds.yaml"
SDS_CERT_FILE = "xds-client-sds.yaml"


def xds_tls_transport_socket(ca_file: str, cert_file: str | None = None, key_file: str | None = None,
                             server_name: str | None = None, sds_dir: str | None = None) -> dict[str, Any]:
    """The ``transport_socket`` (UpstreamTlsContext) for Envoy's ``xds_cluster``: verify the
    control plane's certificate against ``ca_file`` (its DNS SAN must be ``server_name``, also sent
    as SNI, when given) and, with ``cert_file`` + ``key_file``, present a client certificate
    (mutual TLS). Paths should be absolute: Envoy resolves them from its own working directory.

    ``sds_dir``: instead of inline file names, point Envoy at filesystem SDS resources in that
    directory (:func:`xds_tls_sds_secrets`, written there: one secret per file, as Envoy wants),
    which Envoy watches: moving a new SDS file into place there (an atomic rename) makes it re-read
    the secret and the certificate files it names, so the client certificate and CA rotate
    without a restart. Inline files are read once, at Envoy's start.
    Raises ValueError when only one of ``cert_file``/``key_file`` is given.
    """
    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file go together")
    ctx: dict[str, Any] = {}
    if sds_dir:
        def source(name: str) -> dict[str, Any]:
            return {"path_config_source": {"path": str(Path(sds_dir) / name),
                                           "watched_directory": {"path": str(sds_dir)}},
                    "resource_api_version": "V3"}
        ctx["validation_context_sds_secret_config"] = {"name": "xds_ca", "sds_config": source(SDS_CA_FILE)}
        if cert_file:
            ctx["tls_certificate_sds_secret_configs"] = [{"name": "xds_client_cert",
                                                          "sds_config": source(SDS_CERT_FILE)}]
    else:
        ctx["validation_context"] = _validation(ca_file, server_name)
        if cert_file:
            ctx["tls_certificates"] = [{"certificate_chain": {"filename": cert_file},
                                        "private_key": {"filename": key_file}}]
    upstream: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": ctx}
    if server_name:
        upstream["sni"] = server_name
    return {"name": "envoy.transport_sockets.tls", "typed_config": upstream}


def xds_tls_sds_secrets(ca_file: str, cert_file: str | None = None, key_file: str | None = None,
                        server_name: str | None = None) -> dict[str, dict[str, Any]]:
    """The filesystem SDS documents :func:`xds_tls_transport_socket` points at with ``sds_dir``:
    file name -> document; secret ``xds_ca`` (validation context) and, with a certificate,
    ``xds_client_cert``."""
    secret = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
    out = {SDS_CA_FILE: {"resources": [{"@type": secret, "name": "xds_ca",
                                        "validation_context": _validation(ca_file, server_name)}]}}
    if cert_file and key_file:
        out[SDS_CERT_FILE] = {"resources": [{
            "@type": secret, "name": "xds_client_cert",
            "tls_certificate": {"certificate_chain": {"filename": cert_file},
                                "private_key": {"filename": key_file}}}]}
    return out


def add_xds_tls(doc: dict[str, Any], transport_socket: dict[str, Any]) -> dict[str, Any]:
    """Put ``transport_socket`` (:func:`xds_tls_transport_socket`) on every cluster the bootstrap
    uses to reach a control plane: the ADS ``xds_cluster``, and with several control-plane groups
    each group's cluster that an EDS ``api_config_source`` names. Returns ``doc``. Raises
    ValueError when it names none."""
    names = set()
    for svc in doc.get("dynamic_resources", {}).get("ads_config", {}).get("grpc_services", ()):
        names.add(svc.get("envoy_grpc", {}).get("cluster_name"))
    clusters = doc["static_resources"]["clusters"]
    for c in clusters:
        source = c.get("eds_cluster_config", {}).get("eds_config", {}).get("api_config_source", {})
        names.update(svc.get("envoy_grpc", {}).get("cluster_name") for svc in source.get("grpc_services", ()))
    targets = [c for c in clusters if c["name"] in names]
    if not targets:
        raise ValueError("the bootstrap has no control-plane (xds) cluster")
    for c in targets:
        c["transport_socket"] = transport_socket
    return doc
