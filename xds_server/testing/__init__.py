"""Test seam and local fleet harness, used by the demo, our integration tests and users' tests.

One private module per job, behind this curated surface (import from ``xds_server.testing``
only; the underscored modules may move):

- processes (``_process``): :func:`free_port`, a free TCP port on 127.0.0.1; :class:`ManagedProcess`,
  a child process in its own process group, with its output captured, a "ready" line to wait
  for, freeze/thaw (SIGSTOP/SIGCONT) and a stop that always reaps it. Every process started
  here is killed at interpreter exit as a last resort, so a failed test never leaves an Envoy
  behind. Our own ``python -m`` programs are forked from a zygote that imported them once
  (``_zygote``; ``XDS_SENTINEL_TEST_FORK=0`` execs them instead).
- fleet (``_fleet``): :class:`Fleet`, N simulated engines (:class:`NodeProcs`), N node_probe
  agents, one xds-server and one real Envoy on free 127.0.0.1 ports, with helpers to read
  Envoy's and the control plane's view; :func:`restart_control_plane`.
- load (``_load``): :class:`LoadGenerator`, a steady request load through Envoy counting
  requests per serving replica (``x-served-by``) and every failure, per phase (:class:`LoadStats`).
- scripted xDS clients (``_ads_clients``): :class:`ScriptedAdsClient` (SotW) and
  :class:`ScriptedDeltaAdsClient` (delta).
- Envoy admin (``_envoy``): :class:`StandaloneEnvoy`, a real Envoy against the test's own ADS
  server; :func:`parse_envoy_clusters` (the one parser of ``/clusters?format=json``, into
  :class:`EnvoyHost` values), :func:`fetch_envoy_hosts`, :func:`parse_envoy_stats`.
- metrics (``_promlint``): :func:`lint_exposition`, the rules of ``promtool check metrics``
  over a Prometheus text exposition, for hosts without promtool.
- mixed traffic (``_traffic``): :class:`TrafficLoad`, non-streaming and SSE completions counting
  failed requests, cut streams and refused connects per phase (:class:`TrafficStats`).
- the fault matrix (``_fault_rig``, ``_faults``, ``_ads_faults``, ``_agent_faults``, ``_replica_faults``):
  :class:`FaultRig` (a fleet with the relay in front; its first agent runs ``_blockable_agent``,
  whose event loop SIGUSR1 blocks) and one coroutine per fault returning :class:`FaultRow` values;
  :func:`format_table`. ``_fleet_watch`` polls what Envoy and each control-plane replica show
  while a fault runs.
- polling (``_wait``): :func:`wait_for` a condition with a deadline.
- CPU time (``_proc_cpu``): :func:`process_cpu_s` of a process, :func:`threads_cpu_s` of this
  process's threads, :class:`ProcCpu` (name, user and system seconds of one ``/proc`` stat file).
- certificates (``_certs``; ``cryptography`` from the ``dev`` extra, imported when a CA is made):
  :class:`TestCA` issues server and client certificates (DNS, IP and URI SANs) as PEM files;
  :class:`CertPair` holds the paths.
- in-memory seams, re-exported from :mod:`xds_server.process.clock` and
  :mod:`xds_server.probing.memory`: :class:`ManualClock` (time moves only when told, due timers
  run in order; also a ``Callable[[], float]``), :class:`InMemoryProbes` and
  :class:`InMemoryProbeSource` (drive a control plane's probe observations without agents:
  ``ControlPlane(cfg, clock=ManualClock(), probe_sources=InMemoryProbes())``).
"""

from xds_server.probing.memory import InMemoryProbes, InMemoryProbeSource
from xds_server.process.clock import ManualClock
from xds_server.testing._ads_clients import ScriptedAdsClient, ScriptedDeltaAdsClient
from xds_server.testing._ads_faults import ads_stream_churn, slow_ads_reader
from xds_server.testing._agent_faults import agent_loop_block, cpu_burners
from xds_server.testing._certs import CertPair, TestCA
from xds_server.testing._envoy import (
    EnvoyHost,
    StandaloneEnvoy,
    fetch_envoy_hosts,
    parse_envoy_clusters,
    parse_envoy_stats,
)
from xds_server.testing._fault_rig import FaultRig, FaultRow, format_table
from xds_server.testing._faults import (
    agent_kill_restart,
    cp_kill_restart,
    cp_sigstop,
    engine_kill_restart,
    envoy_restart,
)
from xds_server.testing._fleet import Fleet, NodeProcs, restart_control_plane
from xds_server.testing._load import LoadGenerator, LoadStats
from xds_server.testing._proc_cpu import ProcCpu, process_cpu_s, threads_cpu_s
from xds_server.testing._process import ManagedProcess, free_port
from xds_server.testing._promlint import lint_exposition
from xds_server.testing._replica_faults import replica_kill
from xds_server.testing._traffic import TrafficLoad, TrafficStats
from xds_server.testing._wait import wait_for

__all__ = [
    "CertPair",
    "EnvoyHost",
    "FaultRig",
    "FaultRow",
    "Fleet",
    "InMemoryProbeSource",
    "InMemoryProbes",
    "LoadGenerator",
    "LoadStats",
    "ManagedProcess",
    "ManualClock",
    "NodeProcs",
    "ProcCpu",
    "ScriptedAdsClient",
    "ScriptedDeltaAdsClient",
    "StandaloneEnvoy",
    "TestCA",
    "TrafficLoad",
    "TrafficStats",
    "ads_stream_churn",
    "agent_kill_restart",
    "agent_loop_block",
    "cp_kill_restart",
    "cp_sigstop",
    "cpu_burners",
    "engine_kill_restart",
    "envoy_restart",
    "fetch_envoy_hosts",
    "format_table",
    "free_port",
    "lint_exposition",
    "parse_envoy_clusters",
    "parse_envoy_stats",
    "process_cpu_s",
    "replica_kill",
    "restart_control_plane",
    "slow_ads_reader",
    "threads_cpu_s",
    "wait_for",
]

