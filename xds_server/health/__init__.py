"""Health model: pure functions from observations and time to node health."""
from xds_server.health.model import *  # noqa: F403  the package re-exports the model's public API
from xds_server.health.model import __all__  # noqa: F401  re-exported: the package's __all__ is the model's
