"""Probe sessions across cores (docs/DESIGN.md section 12).

With ``probe.workers`` >= 1 the agents' probe streams and the per-node health model run in
worker processes, each owning the nodes ``worker_for(node_id, n)`` gives it; the main process
keeps cluster policy, fail-static, the operator's drain, xDS and the admin endpoint, and gets
from each worker only changes over a socketpair. Public surface:

- :class:`WorkerPool`: the main side (a probe-source factory, restarts, shutdown);
- :class:`RemoteSource`: one node watched by a worker, as the admin view reads it;
- :class:`Detector`: the worker side's pure per-node model with change reports;
- :func:`worker_for`: the stable node -> worker assignment.
"""
from xds_server.probing.workers._assign import worker_for
from xds_server.probing.workers._detector import Detector, NodeReport
from xds_server.probing.workers._pool import RemoteSource, WorkerPool

__all__ = ["Detector", "NodeReport", "RemoteSource", "WorkerPool", "worker_for"]
