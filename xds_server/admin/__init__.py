"""Admin HTTP endpoint: :func:`build_admin_app` over a read-only view and a drain command."""
from xds_server.admin.app import DrainCommand, build_admin_app

__all__ = ["DrainCommand", "build_admin_app"]
