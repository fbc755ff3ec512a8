"""The configuration reference (docs/config.md), generated from the models themselves: every key
with its default, unit and description (the description names the source of the default), one
table per section, protection limits marked *advanced*. ``xds-server config-reference`` prints
it; a test keeps docs/config.md equal to it, so the page cannot fall behind the code.

Pure: reads the pydantic models, returns text.
"""
from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from xds_server.config import SentinelConfig
from xds_server.config.duration import Duration
from xds_server.config.renames import _Renaming

__all__ = ["ESSENTIAL", "Key", "keys", "render_reference"]

#: The keys most deployments set, with why; the reference lists them first.
ESSENTIAL: tuple[tuple[str, str], ...] = (
    ("xds.listen", "where Envoy (ADS, LRS) and the relay's routing feed connect"),
    ("admin.listen", "the admin HTTP endpoint: /nodes, /clusters, /metrics, the dashboard"),
    ("admin.token", "needed by drain, undrain, reload and shifts; without it they are refused"),
    ("state.path", "a restart resumes states, ejections, ramps and drains from this file"),
    ("tls.mode", "the xDS port's TLS (tls, mtls); plaintext off loopback must be said"),
    ("tls.agents.identity", "the name an agent's certificate must carry for the node it claims (dial-in)"),
    ("clusters[].name", "the Envoy cluster name (envoy-bootstrap --cluster)"),
    ("clusters[].nodes[].id", "the node's id, as its agent names it"),
    ("clusters[].nodes[].address", "where Envoy sends requests: the engine's HOST:PORT"),
    ("clusters[].discovery", "find nodes from a file, Kubernetes pods or agents that register themselves"),
    ("probe.dial_in.keepalive", "how often the control plane PINGs each agent: a frozen host is seen within ~2x"),
    ("health.heartbeat.interval", "the agents' heartbeat period; detection time scales with it"),
    ("health.outlier.max_ejection_percent", "the most of a cluster that health may take out at once"),
    ("lrs.enabled", "Envoy's load reports: real-traffic ejection and overload shedding"),
    ("probe.workers", "probe streams in worker processes, for fleets past one core"),
)

_UNITS = (("_ms", "ms"), ("_s", "s"), ("_percent", "%"), ("_bytes", "bytes"), ("_per_s", "per s"),
          ("_ratio", "ratio (0..1)"), ("_fraction", "fraction (0..1)"), ("_chars", "characters"))


@dataclass(frozen=True)
class Key:
    """One configuration key: its dotted path (``[]`` marks a list item), type, default as JSON
    (``required`` when it has none), unit from its name, description, and whether it is an
    advanced protection limit."""

    path: str
    type: str
    default: str
    unit: str
    description: str
    advanced: bool


def _models(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models inside ``annotation`` (itself, Optional[M], list[M], dict[str, M])."""
    out: list[type[BaseModel]] = []
    stack = [annotation]
    while stack:
        a = stack.pop()
        if isinstance(a, type) and issubclass(a, BaseModel):
            out.append(a)
        else:
            stack.extend(typing.get_args(a))
    return out


def _is_list(annotation: object) -> bool:
    return typing.get_origin(annotation) is list or any(
        typing.get_origin(a) is list for a in typing.get_args(annotation))


def _is_duration(annotation: object) -> bool:
    """``annotation`` is a Duration, possibly Annotated with validators."""
    if annotation is Duration:
        return True
    return typing.get_origin(annotation) is typing.Annotated and typing.get_args(annotation)[0] is Duration


def _type_name(annotation: object) -> str:
    if _is_duration(annotation):
        return "Duration"
    if isinstance(annotation, type):
        return annotation.__name__
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    return str(annotation).replace("typing.", "").replace("xds_server.config.", "")


def _default(field: typing.Any) -> str:
    if field.default is PydanticUndefined:
        if field.default_factory is None:
            return "required"
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, Duration):
        return json.dumps(str(value))
    try:
        return json.dumps(value, default=list)
    except (TypeError, ValueError):
        return repr(value)


def _unit(name: str) -> str:
    for suffix, unit in _UNITS:
        if name.endswith(suffix):
            return unit
    return ""


def keys(model: type[BaseModel] = SentinelConfig, prefix: str = "") -> Iterator[Key]:
    """Every key of ``model``, depth first in declaration order; a section's own keys come
    before its subsections'."""
    sections: list[tuple[str, type[BaseModel]]] = []
    advanced: frozenset[str] = getattr(model, "ADVANCED", frozenset())
    for name, field in model.model_fields.items():
        path = prefix + name
        subs = _models(field.annotation)
        if subs:
            sections.append((path + ("[]" if _is_list(field.annotation) else ""), subs[0]))
            continue
        duration = _is_duration(field.annotation) or any(_is_duration(a) for a in typing.get_args(field.annotation))
        unit = "duration" if duration else _unit(name)
        yield Key(path, _type_name(field.annotation), _default(field), unit,
                  " ".join((field.description or "").split()), name in advanced)
    for path, sub in sections:
        yield Key(path, sub.__name__, "(section)", "", " ".join((sub.__doc__ or "").split()), False)
        yield from keys(sub, path + ".")


def _renaming_models(model: type[BaseModel]) -> list[type[_Renaming]]:
    """Every model under ``model`` (itself included, depth first, once) that reads old names."""
    found: list[type[_Renaming]] = []
    stack = [model]
    while stack:
        m = stack.pop(0)
        if issubclass(m, _Renaming) and m.MOVED and m not in found:
            found.append(m)
        stack.extend(s for f in m.model_fields.values() for s in _models(f.annotation))
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_reference() -> str:
    """docs/config.md: the essential keys, then one table per section (Markdown)."""
    all_keys = list(keys())
    by_path = {k.path: k for k in all_keys}
    out = ["# Configuration reference", "",
           "Generated from the configuration models (`xds-server config-reference -o docs/config.md`); a",
           "test keeps this page equal to them. Every key with its default, unit and description; the",
           "description names the source of each default (the seeds: docs/sources.md). A list item is",
           "written `[]`. *Advanced*: a protection limit that rarely needs changing. A *duration* is",
           "written with its unit: `100ms`, `1.5s`, `5m`, `1h` (a bare number other than 0 is refused).", "",
           "## The keys most deployments set", "", "| key | default | why |", "| --- | --- | --- |"]
    for path, why in ESSENTIAL:
        k = by_path[path]
        out.append(f"| `{path}` | `{_cell(k.default)}` | {_cell(why)} |")
    current: str | None = None
    for k in all_keys:
        if k.default == "(section)":
            continue
        section = k.path.rpartition(".")[0] or "(top level)"
        if section != current:
            current = section
            out += ["", f"## `{section}`", "", "| key | type | default | unit | description |",
                    "| --- | --- | --- | --- | --- |"]
        name = k.path.rpartition(".")[2]
        mark = " *(advanced)*" if k.advanced else ""
        out.append(f"| `{name}`{mark} | {_cell(k.type)} | `{_cell(k.default)}` | {k.unit} | {_cell(k.description)} |")
    out += ["", "## Names of earlier releases", "",
            "Still read, each with a deprecation note (`check-config` prints them; `check-config --rewrite`",
            "prints the file in today's names). A number of ms or s becomes a duration with that unit.", "",
            "| earlier name | today's key |", "| --- | --- |"]
    for model in _renaming_models(SentinelConfig):
        for old, (path, _) in model.MOVED.items():
            out.append(f"| `{model.WHERE}.{old}` | `{model.WHERE}.{path}` |")
    return "\n".join(out) + "\n"
