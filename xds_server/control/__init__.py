"""The control plane's decisions, split by job (stage 3 of docs/DESIGN.md section 1; the I/O
shell that wires it is :mod:`xds_server.server`).

- :mod:`~xds_server.control.core`: observations -> health, events, fail-static, publish timing;
- :mod:`~xds_server.control.node_table`: node health with folded heartbeats settled on read;
- :mod:`~xds_server.control.publish`: what to publish and when (pure, time passed in), with
  :mod:`~xds_server.control.last_good` (the fail-static look-back) and
  :mod:`~xds_server.control.wakes` (the outlier wake-up timers);
- :mod:`~xds_server.control.events`: the event ring; :mod:`~xds_server.control.reload`: what a
  new config changes;
- :mod:`~xds_server.control.state`, :mod:`~xds_server.control.state_file`: the kept state a
  restart resumes.

The decision layer is fed through a sink (:class:`~xds_server.probing.sources.ObservationSink`)
and imports nothing of probing or of xDS; the views the admin endpoint reads live in
:mod:`xds_server.admin`.
"""
from xds_server.control.core import ControlCore
from xds_server.control.events import EventLog, EventRecord
from xds_server.control.last_good import LastGoodHistory
from xds_server.control.publish import ClusterPublish, PublishPlanner

__all__ = [
    "ClusterPublish",
    "ControlCore",
    "EventLog",
    "EventRecord",
    "LastGoodHistory",
    "PublishPlanner",
]
