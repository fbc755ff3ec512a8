"""A targets file's text -> the nodes it lists (pure: the caller reads the file).

Format (YAML, so JSON too): a list of nodes, or a mapping with the list under ``nodes``; each
node has the fields of a static node (:class:`~xds_server.config.NodeConfig`)::

    - {id: gpu-a, address: 10.0.0.5:8000, probe_address: 10.0.0.5:9100}
    - id: gpu-b
      address: 10.0.0.6:8000
      probe_address: 10.0.0.6:9100
      locality: {zone: us-east-1b}
      priority: 1

``[]`` lists no nodes (a pool scaled to zero); an empty file is an error (a writer may be half
way through it). Errors: :class:`TargetsError`, naming the file, the entry (index and id) and
the reason; the whole file is rejected, so the caller keeps the last good node set.
"""
from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError

from xds_server.config import NodeConfig
from xds_server.config.base import yaml_problem

__all__ = ["TargetsError", "parse_targets"]


class TargetsError(ValueError):
    """A targets file that cannot be used; the message names file, entry and reason."""


def _entry_name(i: int, raw: Any) -> str:
    nid = raw.get("id") if isinstance(raw, dict) else None
    return f"entry {i}" + (f" (id {nid!r})" if isinstance(nid, str) else "")


def parse_targets(text: str, path: str) -> tuple[NodeConfig, ...]:
    """The nodes listed in ``text`` (the content of the targets file ``path``), in file order.

    Raises TargetsError: not YAML (with line/column), empty, not a list, an entry that is not a
    valid node (each field by name), or two entries with the same id.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TargetsError(f"targets file {path}: not valid YAML/JSON{yaml_problem(e)}") from None
    if data is None:
        raise TargetsError(f"targets file {path}: empty (write [] for no nodes)")
    if isinstance(data, dict) and set(data) == {"nodes"}:
        data = data["nodes"]
    if not isinstance(data, list):
        raise TargetsError(f"targets file {path}: expected a list of nodes (or {{nodes: [...]}}), "
                           f"got {type(data).__name__}")
    nodes: list[NodeConfig] = []
    errors: list[str] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(data):
        if not isinstance(raw, dict):
            errors.append(f"{_entry_name(i, raw)}: expected a mapping, got {type(raw).__name__}")
            continue
        try:
            n = NodeConfig.model_validate(raw)
        except ValidationError as e:
            for err in e.errors():
                field = ".".join(str(p) for p in err["loc"]) or "(entry)"
                msg = err["msg"].removeprefix("Value error, ")
                errors.append(f"{_entry_name(i, raw)}: {field}: {msg}")
            continue
        if n.id in seen:
            errors.append(f"{_entry_name(i, raw)}: duplicate id (entry {seen[n.id]} has it too)")
            continue
        seen[n.id] = i
        nodes.append(n)
    if errors:
        raise TargetsError(f"targets file {path}: " + "; ".join(errors))
    return tuple(nodes)
