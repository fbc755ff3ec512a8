"""``reload:`` and ``state:`` sections: hot reload and routing state kept across restarts."""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from xds_server.config.duration import Duration, NonNegativeDuration, PositiveDuration
from xds_server.config.renames import Moves, _Renaming

__all__ = ["ReloadConfig", "StateConfig"]



class ReloadConfig(_Renaming):
    """Hot reload of the config file (SIGHUP, ``POST /reload``, or a change of the file)."""

    WHERE: ClassVar[str] = "reload"
    MOVED: ClassVar[Moves] = {
        "watch_interval_s": ("watch_interval", "s"),
        "drain_check_interval_s": ("drain_check_interval", "s"),
    }

    watch_interval: NonNegativeDuration = Field(
        Duration.parse("2s"), description="how often the config file's mtime and content hash are checked; 0: "
                               "no watching, reload on SIGHUP or POST /reload only (ours)",
    )
    drain_check_interval: PositiveDuration = Field(
        Duration.parse("1s"), description="how often nodes removed by a reload are checked for having drained "
                               "(dropped then; health.drain_timeout bounds the wait) (ours)",
    )


class StateConfig(_Renaming):
    """Routing state kept across restarts (states, ramps, ejection back-offs, drains)."""

    WHERE: ClassVar[str] = "state"
    MOVED: ClassVar[Moves] = {
        "write_interval_s": ("write_interval", "s"),
        "max_age_s": ("max_age", "s"),
    }

    path: str | None = Field(
        None, description="state file, written atomically; None: nothing is kept across restarts",
    )
    write_interval: PositiveDuration = Field(
        Duration.parse("5s"), description="the state file is written at most once per this while state changes, "
                               "and on shutdown (ours)",
    )
    max_age: NonNegativeDuration = Field(
        Duration.parse("2m"), description="a state file older than this is ignored at start (ours: a node's "
                                 "agent may have changed a lot in two minutes; heartbeats re-confirm "
                                 "within 300 ms either way)",
    )
