"""Shared pieces of the configuration schema: the error type, HOST:PORT parsing, the base model."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigError", "parse_hostport", "yaml_problem"]


class ConfigError(ValueError):
    """A configuration file is unreadable or invalid; the message names field(s) and reason(s)."""


def parse_hostport(value: str) -> tuple[str, int]:
    """Split ``"HOST:PORT"`` (``"[v6]:PORT"`` for IPv6) into ``(host, port)``.

    Raises ValueError when the port is missing, not an integer, or outside 0..65535.
    """
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host, _, port_s = value.rpartition(":")
    host = host.strip("[]")
    if not host:
        raise ValueError(f"missing host in {value!r}")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"port {port_s!r} is not an integer") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} outside 0..65535")
    return host, port


def yaml_problem(e: Exception) -> str:
    """``" at line L, column C: PROBLEM"`` of a PyYAML parse error (the place when it has one)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{where}: {getattr(e, 'problem', e)}"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_hostport(v: str) -> str:
    parse_hostport(v)
    return v
