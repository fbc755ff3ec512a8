"""``admin:`` section: the admin HTTP server (JSON, metrics, dashboard, drain).

The live feed (``GET /live``) is an open GET like ``/nodes`` (it shows nothing the JSON views do
not): no token, bounded instead by ``live_max_clients``, ``live_queue_max``, ``live_write_timeout_s``,
``live_send_buffer_bytes`` and ``live_write_buffer_bytes``."""
from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field, field_validator, model_validator

from xds_server.config.base import _check_hostport, _Model, parse_hostport
from xds_server.config.duration import Duration, NonNegativeDuration, PositiveDuration, at_least, at_most
from xds_server.config.renames import Moves, _Renaming
from xds_server.config.tls import _not_expired, _readable
from xds_server.process.dialing import is_loopback

__all__ = ["AdminConfig", "AdminTls"]



class AdminTls(_Model):
    """HTTPS on the admin port: a server certificate and key (PEM), read at start."""

    cert_file: str = Field(..., min_length=1, description="the admin port's certificate (may be tls.cert_file)")
    key_file: str = Field(..., min_length=1, description="its private key (may be tls.key_file)")

    @model_validator(mode="after")
    def _files(self) -> AdminTls:
        for name in ("cert_file", "key_file"):
            _readable(getattr(self, name), name)
        _not_expired(self.cert_file, "cert_file")
        return self


class AdminConfig(_Renaming):
    """The admin HTTP endpoint (aiohttp)."""

    WHERE: ClassVar[str] = "admin"
    MOVED: ClassVar[Moves] = {
        "live_interval_ms": ("live_interval", "ms"),
        "live_ping_s": ("live_ping", "s"),
        "history_s": ("history", "s"),
        "history_interval_ms": ("history_interval", "ms"),
        "live_write_timeout_s": ("live_write_timeout", "s"),
    }

    #: Protection limits that rarely need changing (marked advanced in docs/config.md).
    ADVANCED: ClassVar[frozenset[str]] = frozenset({
        "drain_reason_max_chars", "event_reason_max_chars", "events_buffer", "live_max_clients", "live_ping",
        "live_queue_max", "live_send_buffer_bytes", "live_write_buffer_bytes", "live_write_timeout"})

    listen: str = Field("127.0.0.1:19000", description="HOST:PORT of the admin HTTP server")
    token: str | None = Field(None, description="bearer token for POST drain/undrain and /reload; None = "
                              "disabled, allowed only on a loopback admin.listen (check-config and serve exit 2 "
                              "naming admin.token otherwise)")
    events_buffer: int = Field(1000, ge=10, description="events kept in the ring buffer")
    event_reason_max_chars: int = Field(
        512, ge=16, le=65_536,
        description="an event's reason is clipped to this before it is stored (ours: the longest "
        "reason the model writes is ~200 characters; agent and operator text is cut)",
    )
    drain_reason_max_chars: int = Field(
        200, ge=1, le=4096, description="the drain/undrain ?reason= text is clipped to this",
    )
    live_interval: Annotated[PositiveDuration, at_least("50ms"), at_most("1m")] = Field(
        Duration.parse("500ms"),
        description="the dashboard's live feed (GET /live) sends a snapshot this often while a "
        "browser listens (ours: 2 Hz reads well and costs one /nodes view per tick)",
    )
    live_queue_max: int = Field(
        64, ge=2, le=10_000,
        description="messages queued per live-feed client; a client that falls this far behind is "
        "dropped and reconnects (ours: 64 is ~30 s of snapshots at the default rate)",
    )
    live_ping: Annotated[PositiveDuration, at_most("5m")] = Field(
        Duration.parse("15s"),
        description="an idle live-feed stream gets a comment line this often (ours: under the "
        "common 30-60 s proxy idle timeouts)",
    )
    history: Annotated[NonNegativeDuration, at_most("24h")] = Field(
        Duration.parse("15m"),
        description="the dashboard's recent history (GET /history: each node's shown state, weight, "
        "RTT, TTFT), s; 0 = off (ours: 15 min covers what led to an incident an operator opens the "
        "page for; ~9 KB per node at the default resolution)",
    )
    history_interval: Annotated[PositiveDuration, at_least("50ms"), at_most("10m")] = Field(
        Duration.parse("2s"),
        description="one history sample this often, ms (ours: 2 s keeps a 15-minute sparkline at "
        "450 points, finer than a table cell's pixels; the live feed fills in between)",
    )

    live_max_clients: int = Field(
        100, ge=1, le=100_000,
        description="live-feed clients (GET /live) open at once; one more is answered 503 (ours: an "
        "operator team's browsers, a few tabs each; each client costs at most live_queue_max "
        "messages and one socket's send buffer, so 100 bound the feed's memory to tens of MB)",
    )
    live_write_timeout: Annotated[PositiveDuration, at_most("5m")] = Field(
        Duration.parse("10s"),
        description="a write to a live-feed client may take this long (s); a client that does not "
        "take it in time (it stopped reading) is disconnected, its socket closed and its memory "
        "given back (ours: 20 ticks at the default rate; a browser reads in milliseconds)",
    )
    live_send_buffer_bytes: int = Field(
        64 * 1024, ge=4096, le=16 * 1024 * 1024,
        description="the kernel send buffer (SO_SNDBUF, bytes; Linux doubles it) of each live-feed "
        "connection. Autotuned, it grew to 3.9 MB per client that stopped reading on loopback, so a "
        "stuck client was noticed only after minutes and 500 of them held ~2 GB of kernel memory; "
        "64 KiB holds a few snapshots and the write timeout notices a stuck client within seconds",
    )
    live_write_buffer_bytes: int = Field(
        16 * 1024, ge=1024, le=16 * 1024 * 1024,
        description="bytes a live-feed connection may hold in our process beyond what the kernel "
        "took before the next write waits for it to drain (the transport's high-water mark). "
        "Ours: aiohttp's default (64 KiB + a message) for 500 clients that stopped reading left "
        "the process 63 MB larger after they were disconnected (allocator retention); 16 KiB "
        "is a few dashboard messages",
    )

    tls: AdminTls | None = Field(
        None, description="serve the admin port over HTTPS with this certificate (the xDS port's "
        "files or its own); unset: plain HTTP (then keep it on loopback or behind a proxy: the "
        "token would travel in clear)",
    )

    _v_listen = field_validator("listen")(_check_hostport)

    token_file: str | None = Field(
        None, description="read admin.token from this file (its content, surrounding white space "
        "stripped; e.g. a mounted Kubernetes Secret), at load and at every reload; excludes admin.token",
    )

    @model_validator(mode="before")
    @classmethod
    def _read_token_file(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("token_file") is not None:
            if data.get("token") is not None:
                raise ValueError("admin.token and admin.token_file exclude each other")
            path = str(data["token_file"])
            try:
                with open(path, encoding="utf-8") as f:
                    token = f.read().strip()
            except (OSError, UnicodeError) as e:
                raise ValueError(f"admin.token_file: cannot read {path!r}: {e}") from e
            if not token:
                raise ValueError(f"admin.token_file: {path!r} is empty")
            data = {**data, "token": token}
        return data

    @model_validator(mode="after")
    def _token_off_loopback(self) -> AdminConfig:
        host = parse_hostport(self.listen)[0]
        if self.token is None and not is_loopback(host):
            raise ValueError(
                f"admin.token: admin.listen {self.listen} is not a loopback address and admin.token "
                "is not set: /nodes, /config_dump, /events and /xds/clients would be open to the "
                "network and drain/reload disabled; set admin.token (and admin.tls), or listen on "
                "127.0.0.1")
        return self
