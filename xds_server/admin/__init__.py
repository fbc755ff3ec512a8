"""Admin HTTP endpoint: :func:`build_admin_app` over a read-only view and a drain command.

The names are loaded on first use, so ``xds_server.admin.status_text`` (what the ``status``,
``drain`` and ``undrain`` commands need) is imported without aiohttp and the control plane.
"""
from __future__ import annotations

from typing import Any

__all__ = ["DrainCommand", "build_admin_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from xds_server.admin import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
