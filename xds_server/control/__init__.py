"""The control plane's decisions and views, split by job (the I/O shell is ``xds_server.server``).

- :mod:`~xds_server.control.core`: observations -> health, events, fail-static, publish timing;
- :mod:`~xds_server.control.publish`: what to publish and when (pure, time passed in);
- :mod:`~xds_server.control.views`: read-only JSON views (what the admin app reads);
- :mod:`~xds_server.control.counters`, :mod:`~xds_server.control.events`: counters, event ring;
- :mod:`~xds_server.control.clock`, :mod:`~xds_server.control.probes`,
  :mod:`~xds_server.control.memory`: the seams (clock, probe-source factory, in-memory sources).
"""
from xds_server.control.clock import Clock, LoopClock, ManualClock
from xds_server.control.core import ControlCore
from xds_server.control.counters import Counters
from xds_server.control.events import EventLog, EventRecord
from xds_server.control.memory import InMemoryProbes, InMemoryProbeSource
from xds_server.control.probes import ProbeSource, ProbeSourceContext, ProbeSourceFactory, grpc_probe_source
from xds_server.control.publish import ClusterPublish, LastGoodHistory, PublishPlanner
from xds_server.control.views import ControlPlaneView

__all__ = [
    "Clock",
    "ClusterPublish",
    "ControlCore",
    "ControlPlaneView",
    "Counters",
    "EventLog",
    "EventRecord",
    "InMemoryProbeSource",
    "InMemoryProbes",
    "LastGoodHistory",
    "LoopClock",
    "ManualClock",
    "ProbeSource",
    "ProbeSourceContext",
    "ProbeSourceFactory",
    "PublishPlanner",
    "grpc_probe_source",
]
