"""Process-wide logging setup of the three programs (``xds-server``, ``node-probe`` and its
``sim-engine``, ``sentinel-relay``): one format, one timestamp format, structured fields.

Two formats (``--log-format``):

- ``text``: ``2026-01-01T00:00:00.000Z INFO xds_server.server: message node=gpu-a cluster=llm``
- ``json``: one JSON object per line: ``{"ts", "level", "logger", "msg", ...fields}``.

Structured fields come from ``extra=`` on a log call; the known ones are :data:`FIELDS`
(``node``, ``cluster``, ``reason``, ``version``, ``client``, ``stream``, ``type``, ``nonce``).
:func:`set_replica` adds ``replica`` (``xds.replica_id``) to every line of the process, so the
logs of two replicas can be told apart once collected together; :func:`set_process_field`
does the same for another name (the relay's ``worker``).
Their values are text that may come from agents or xDS clients, so they are escaped with
:func:`xds_server.process.untrusted.for_log` (bounded, one line) before they are written.

gRPC core noise: the C core's own stderr lines are off (``GRPC_VERBOSITY=NONE``) unless the
environment sets ``GRPC_VERBOSITY``; :func:`quiet_grpc_core` must run before ``grpc`` is first
imported to take effect. The ``grpc`` Python loggers are raised to WARNING unless
``--log-level DEBUG``.

Tracebacks: a record with an exception carries it as one line (``exc=TYPE: text``) unless the
level is DEBUG, which writes the full traceback (an operator's log is one line per event).
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
    "set_process_field",
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


def set_process_field(name: str, value: str | None) -> None:
    """Add ``name=<value>`` to every later log line of this process (None: stop)."""
    if value:
        _process_fields[name] = for_log(value, _FIELD_MAX_CHARS)
    else:
        _process_fields.pop(name, None)


def _exc_text(fmt: logging.Formatter, record: logging.LogRecord, tracebacks: bool) -> str:
    if tracebacks or not record.exc_info:
        return fmt.formatException(record.exc_info) if record.exc_info else ""
    exc = record.exc_info[1]
    return for_log(f"{type(exc).__name__}: {exc}", 500)


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
    """``TS LEVEL logger: message key=value ...`` (UTC timestamps, fields of :data:`FIELDS`);
    ``tracebacks``: write an exception's traceback (else one ``exc=`` field)."""

    def __init__(self, tracebacks: bool = True) -> None:
        super().__init__()
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_ts(record)} {record.levelname} {record.name}: {record.getMessage()}"
        fields = _fields(record)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            exc = _exc_text(self, record, self.tracebacks)
            line += ("\n" + exc) if self.tracebacks else f" exc={exc}"
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, fields, ``exc``
    (the traceback when ``tracebacks``, else ``TYPE: text``)."""

    def __init__(self, tracebacks: bool = True) -> None:
        super().__init__()
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, str] = {"ts": _ts(record), "level": record.levelname, "logger": record.name,
                               "msg": record.getMessage()}
        doc.update(_fields(record))
        if record.exc_info:
            doc["exc"] = _exc_text(self, record, self.tracebacks)
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
    tracebacks = lvl == "DEBUG"
    handler.setFormatter(JsonFormatter(tracebacks) if fmt == "json" else TextFormatter(tracebacks))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(lvl)
    quiet = logging.DEBUG if lvl == "DEBUG" else logging.WARNING
    for name in ("grpc", "asyncio"):  # library chatter: only at DEBUG
        logging.getLogger(name).setLevel(quiet)
