"""``admin:`` section: the admin HTTP server (JSON, metrics, dashboard, drain).

The live feed (``GET /live``) is an open GET like ``/nodes`` (it shows nothing the JSON views do
not): no token, bounded instead by ``live_max_clients``, ``live_queue_max``, ``live_write_timeout_s``,
``live_send_buffer_bytes`` and ``live_write_buffer_bytes``."""
from __future__ import annotations

from pydantic import Field, field_validator

from xds_server.config.base import _check_hostport, _Model

__all__ = ["AdminConfig"]


class AdminConfig(_Model):
    """The admin HTTP endpoint (aiohttp)."""

    listen: str = Field("127.0.0.1:19000", description="HOST:PORT of the admin HTTP server")
    token: str | None = Field(None, description="bearer token for POST drain/undrain; None = disabled")
    events_buffer: int = Field(1000, ge=10, description="events kept in the ring buffer")
    event_reason_max_chars: int = Field(
        512, ge=16, le=65_536,
        description="an event's reason is clipped to this before it is stored (ours: the longest "
        "reason the model writes is ~200 characters; agent and operator text is cut)",
    )
    drain_reason_max_chars: int = Field(
        200, ge=1, le=4096, description="the drain/undrain ?reason= text is clipped to this",
    )
    live_interval_ms: int = Field(
        500, ge=50, le=60_000,
        description="the dashboard's live feed (GET /live) sends a snapshot this often while a "
        "browser listens (ours: 2 Hz reads well and costs one /nodes view per tick)",
    )
    live_queue_max: int = Field(
        64, ge=2, le=10_000,
        description="messages queued per live-feed client; a client that falls this far behind is "
        "dropped and reconnects (ours: 64 is ~30 s of snapshots at the default rate)",
    )
    live_ping_s: float = Field(
        15.0, gt=0, le=300,
        description="an idle live-feed stream gets a comment line this often (ours: under the "
        "common 30-60 s proxy idle timeouts)",
    )
    history_s: float = Field(
        900.0, ge=0, le=86_400,
        description="the dashboard's recent history (GET /history: each node's shown state, weight, "
        "RTT, TTFT), s; 0 = off (ours: 15 min covers what led to an incident an operator opens the "
        "page for; ~9 KB per node at the default resolution)",
    )
    history_interval_ms: int = Field(
        2000, ge=50, le=600_000,
        description="one history sample this often, ms (ours: 2 s keeps a 15-minute sparkline at "
        "450 points, finer than a table cell's pixels; the live feed fills in between)",
    )

    live_max_clients: int = Field(
        100, ge=1, le=100_000,
        description="live-feed clients (GET /live) open at once; one more is answered 503 (ours: an "
        "operator team's browsers, a few tabs each; each client costs at most live_queue_max "
        "messages and one socket's send buffer, so 100 bound the feed's memory to tens of MB)",
    )
    live_write_timeout_s: float = Field(
        10.0, gt=0, le=300,
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

    _v_listen = field_validator("listen")(_check_hostport)
