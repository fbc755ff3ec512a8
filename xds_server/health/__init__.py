"""Health model: pure functions from observations and time to node health."""
from xds_server.health.model import *  # noqa: F403
from xds_server.health.model import __all__  # noqa: F401
