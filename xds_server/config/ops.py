"""``reload:`` and ``state:`` sections: hot reload and routing state kept across restarts."""
from __future__ import annotations

from pydantic import Field

from xds_server.config.base import _Model

__all__ = ["ReloadConfig", "StateConfig"]


class ReloadConfig(_Model):
    """Hot reload of the config file (SIGHUP, ``POST /reload``, or a change of the file)."""

    watch_interval_s: float = Field(
        2.0, ge=0, description="how often the config file's mtime and content hash are checked; 0: "
                               "no watching, reload on SIGHUP or POST /reload only (ours)",
    )
    drain_check_interval_s: float = Field(
        1.0, gt=0, description="how often nodes removed by a reload are checked for having drained "
                               "(dropped then; health.drain_timeout bounds the wait) (ours)",
    )


class StateConfig(_Model):
    """Routing state kept across restarts (states, ramps, ejection back-offs, drains)."""

    path: str | None = Field(
        None, description="state file, written atomically; None: nothing is kept across restarts",
    )
    write_interval_s: float = Field(
        5.0, gt=0, description="the state file is written at most once per this while state changes, "
                               "and on shutdown (ours)",
    )
    max_age_s: float = Field(
        120.0, ge=0, description="a state file older than this is ignored at start (ours: a node's "
                                 "agent may have changed a lot in two minutes; heartbeats re-confirm "
                                 "within 300 ms either way)",
    )
