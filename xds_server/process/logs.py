"""Process-wide logging setup for the ``xds-server`` command: one format, structured fields.

Two formats (``--log-format``):

- ``text``: ``2026-01-01T00:00:00.000Z INFO xds_server.server: message node=gpu-a cluster=llm``
- ``json``: one JSON object per line: ``{"ts", "level", "logger", "msg", ...fields}``.

Structured fields come from ``extra=`` on a log call; the known ones are :data:`FIELDS`
(``node``, ``cluster``, ``reason``, ``version``, ``client``, ``stream``, ``type``, ``nonce``).
:func:`set_replica` adds ``replica`` (``xds.replica_id``) to every line of the process, so the
logs of two replicas can be told apart once collected together.
Their values are text that may come from agents or xDS clients, so they are escaped with
:func:`xds_server.process.untrusted.for_log` (bounded, one line) before they are written.

gRPC core noise: the C core's own stderr lines are off (``GRPC_VERBOSITY=NONE``) unless the
environment sets ``GRPC_VERBOSITY``; :func:`quiet_grpc_core` must run before ``grpc`` is first
imported to take effect. The ``grpc`` Python loggers are raised to WARNING unless
``--log-level DEBUG``.
"""
from __future__ import annotations

import json
import logging
import os
import time

from xds_server.process.untrusted import for_log

__all__ = [
    "FIELDS",
    "FORMATS",
    "LEVELS",
    "JsonFormatter",
    "TextFormatter",
    "configure_logging",
    "quiet_grpc_core",
    "set_replica",
]

FIELDS = ("node", "cluster", "reason", "version", "client", "stream", "type", "nonce")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")
_FIELD_MAX_CHARS = 256
_process_fields: dict[str, str] = {}


def set_replica(replica_id: str | None) -> None:
    """Add ``replica=<replica_id>`` to every later log line of this process (None: stop)."""
    if replica_id:
        _process_fields["replica"] = for_log(replica_id, _FIELD_MAX_CHARS)
    else:
        _process_fields.pop("replica", None)


def _ts(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, str]:
    out = dict(_process_fields)
    for k in FIELDS:
        v = record.__dict__.get(k)
        if v is not None:
            out[k] = for_log(str(v), _FIELD_MAX_CHARS)
    return out


class TextFormatter(logging.Formatter):
    """``TS LEVEL logger: message key=value ...`` (UTC timestamps, fields of :data:`FIELDS`)."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_ts(record)} {record.levelname} {record.name}: {record.getMessage()}"
        fields = _fields(record)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, fields, ``exc``."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, str] = {"ts": _ts(record), "level": record.levelname, "logger": record.name,
                               "msg": record.getMessage()}
        doc.update(_fields(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=True)


def quiet_grpc_core() -> None:
    """Turn the gRPC C core's own log lines off unless ``GRPC_VERBOSITY`` is set already."""
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Install one stderr handler with the chosen format on the root logger (replacing others).

    ``level``: one of :data:`LEVELS` (any case); ``fmt``: one of :data:`FORMATS`. Raises
    ValueError naming the option for anything else.
    """
    lvl = str(level).upper()
    if lvl not in LEVELS:
        raise ValueError(f"--log-level: expected one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--log-format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(lvl)
    quiet = logging.DEBUG if lvl == "DEBUG" else logging.WARNING
    for name in ("grpc", "asyncio"):  # library chatter: only at DEBUG
        logging.getLogger(name).setLevel(quiet)
