"""``admin:`` section: the admin HTTP server (JSON, metrics, dashboard, drain)."""
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

    _v_listen = field_validator("listen")(_check_hostport)
