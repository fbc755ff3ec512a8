"""Names of earlier releases, still read: a model lists where each old key of its mapping lives
now, and reading a mapping moves each old key there, says so in one line, and refuses an old key
given beside its new one.

Shape::

    class M(_Renaming):
        WHERE = "xds"                                  # the model's path in the file, for the lines
        MOVED = {"keepalive_time_ms": ("keepalive.time", "ms")}   # old -> (new path, unit of the old value)
        keepalive: KeepaliveConfig = ...
    M(keepalive_time_ms=1000).keepalive.time.ms        # 1000.0
    moved_notes(config)                                # every line, from every model in the tree

A duration's old value was a number of ``ms`` or ``s`` (its name said which); moved, it becomes
a duration string with that unit (``1000ms`` -> written back as ``1s``). ``unit`` "" moves the
value as it is.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ModelWrapValidatorHandler, PrivateAttr, model_validator

from xds_server.config.base import _Model
from xds_server.config.duration import Duration

__all__ = ["Moves", "move_old_names", "moved_notes", "rewrite_old_names"]

#: Old key -> (its new path in the same mapping, dotted; unit of the old value: "ms", "s" or "").
Moves = Mapping[str, tuple[str, str]]


def _with_unit(old: str, value: Any, unit: str) -> Any:
    """An old value in the new form: a number of ``unit`` becomes a duration string.
    ValueError naming ``old`` when a duration's value is not a number."""
    if not unit or value is None:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return str(Duration.parse(f"{value!r}{unit}"))
        except ValueError:  # not finite: refused by the field, with its name
            return f"{value!r}{unit}"
    raise ValueError(f"{old}: {str(value)[:40]!r} is not a number of {unit}")


def move_old_names(data: Mapping[str, Any], moves: Moves, where: str) -> tuple[dict[str, Any], list[str]]:
    """``data`` with each old key of ``moves`` moved to its new path, and one line per key moved
    (``where``: the mapping's path in the file, e.g. ``health``). ValueError when an old key and its
    new path are both given."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items() if k not in moves}
    lines: list[str] = []
    for old, value in data.items():
        if old not in moves:
            continue
        path, unit = moves[old]
        *sections, key = path.split(".")
        target: Any = out
        for s in sections:
            target = target.setdefault(s, {})
            if not isinstance(target, dict):
                break
        if not isinstance(target, dict) or key in target:
            raise ValueError(f"{old} is the old name of {where}.{path}, which is also set: keep one")
        target[key] = _with_unit(old, value, unit)
        shown = target[key] if unit and value is not None else json.dumps(value, default=str)
        lines.append(f"{where}.{old} is deprecated: write {where}.{path}: {shown}")
    return out, lines


class _Renaming(_Model):
    """A config model that still reads the names of earlier releases (see module docstring).
    Equal values are equal models, whichever names they were written with."""

    WHERE: ClassVar[str] = ""
    MOVED: ClassVar[Moves] = {}
    _moved: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _old_names(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        lines: list[str] = []
        if cls.MOVED and isinstance(data, dict) and any(k in cls.MOVED for k in data):
            data, lines = move_old_names(data, cls.MOVED, cls.WHERE)
        out = handler(data)
        if lines:
            out._moved = tuple(lines)
        return out

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # mutable lists inside: never hashable


def moved_notes(model: BaseModel) -> list[str]:
    """Every line said about old names, from ``model`` and every model inside it, in field order."""
    out: list[str] = list(getattr(model, "_moved", ()) if isinstance(model, _Renaming) else ())
    for name in type(model).model_fields:
        value = getattr(model, name)
        for v in value if isinstance(value, list) else (value,):
            if isinstance(v, BaseModel):
                out += moved_notes(v)
    return out


def _models_in(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in getattr(annotation, "__args__", ()) for m in _models_in(a)]


def rewrite_old_names(data: Any, model: type[BaseModel]) -> Any:
    """A copy of the parsed document ``data`` (read as ``model``) with every old name of every
    model in it moved to its new path (what ``check-config --rewrite`` prints)."""
    if not isinstance(data, dict):
        return data
    if issubclass(model, _Renaming) and model.MOVED:
        data, _ = move_old_names(data, model.MOVED, model.WHERE)
    out = dict(data)
    for name, field in model.model_fields.items():
        subs = _models_in(field.annotation)
        if subs and name in out:
            value = out[name]
            out[name] = [rewrite_old_names(v, subs[0]) for v in value] if isinstance(value, list) \
                else rewrite_old_names(value, subs[0])
    return out
