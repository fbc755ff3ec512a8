"""The agent's own Prometheus metrics, served on ``--metrics-listen`` (``GET /metrics``, and
``GET /healthz`` for a container's liveness check).

:class:`AgentMetrics` counts what the agent does (micro-probes by result with a TTFT histogram,
engine ``/metrics`` scrapes and their errors) with prometheus-client's own types in a per-agent
registry, and reads the rest at scrape time from the agent (engine state, stall flag, open
streams, GPU readings from the latest NVML telemetry). Units are base units (seconds, bytes,
ratio 0..1, watts, celsius); counters end in ``_total``. Labels come from bounded sets: result
(``ok`` or a failure kind), engine state, NVML state, GPU index; every series also carries
``node`` (the agent's ``--node-id``), so dashboards join the agent's series with the control
plane's ``sentinel_node_*`` without relabelling. Counters export no ``_created`` samples
(counted here, exposed through a collector: a restart resets them, which ``rate()`` handles).
"""
from __future__ import annotations

import logging
import platform
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily

from node_probe.lifecycle import STATE_NAMES
from node_probe.proto import probe_pb2
from xds_server.process.certwatch import CertWatch

__all__ = ["TTFT_BUCKETS_S", "AgentMetrics"]

log = logging.getLogger(__name__)

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)
"""Probe TTFT histogram buckets, seconds: 200 ms and 800 ms are the good / timeout limits
(seed 001), the rest spread around them."""


class _AgentState(Protocol):
    cfg: Any

    @property
    def engine_state(self) -> int: ...

    @property
    def stalled(self) -> bool: ...

    @property
    def subscriber_count(self) -> int: ...

    def telemetry(self) -> probe_pb2.Telemetry: ...


def _version() -> str:
    from importlib import metadata
    try:
        return metadata.version("xds-sentinel")
    except metadata.PackageNotFoundError:
        return "unknown"


class _StateCollector:
    """Gauges read from the agent at scrape time, and the counts :class:`AgentMetrics` keeps."""

    def __init__(self, agent: _AgentState, node: str, counts: AgentMetrics) -> None:
        self.agent = agent
        self.node = node
        self.counts = counts

    def collect(self):
        a, n = self.agent, [self.node]
        info = InfoMetricFamily("node_probe_build", "version of this build and the Python running it",
                                labels=["node"])
        info.add_metric(n, {"version": _version(), "python": platform.python_version()})
        yield info
        state = GaugeMetricFamily("node_probe_engine_state", "1 for the engine's current lifecycle state "
                                  "(COLD, WARMING, READY, FAILED)", labels=["node", "state"])
        current = a.engine_state
        for value, name in sorted(STATE_NAMES.items()):
            if value:
                state.add_metric([*n, name.removeprefix("ENGINE_STATE_")], 1.0 if value == current else 0.0)
        yield state
        stalled = GaugeMetricFamily("node_probe_engine_stalled", "1 while requests run and the engine's "
                                    "progress counters have not moved for the stall window", labels=["node"])
        stalled.add_metric(n, 1.0 if a.stalled else 0.0)
        yield stalled
        streams = GaugeMetricFamily("node_probe_connected_streams", "open streams with control planes (Watch "
                                    "streams served, dial-in streams begun)", labels=["node"])
        streams.add_metric(n, a.subscriber_count)
        yield streams
        dialer = getattr(a, "dialer", None)  # dial-in: per control-plane target
        if dialer is not None:
            yield from _dial_in(self.node, dialer.states())
        yield from self.counts.families(self.node)
        refusals = getattr(a, "refusals", None)  # node_probe_access_refused_total{port="agent"}
        if refusals is not None:
            yield from refusals.metric_families()
        watch = self.counts.cert_watch()  # node_probe_tls_certificate_expiry_*
        if watch is not None:
            watch.reasons()  # the warning line, at most hourly
            yield from watch.metric_families()
        yield from self._gpu(a.telemetry().gpu)

    def _gpu(self, tel: probe_pb2.GpuTelemetry):
        n = [self.node]
        nvml = GaugeMetricFamily("node_probe_nvml_state", "1 for the NVML state (OK, ABSENT, ERROR)",
                                 labels=["node", "state"])
        for name, value in probe_pb2.NvmlState.items():
            if value:
                nvml.add_metric([*n, name.removeprefix("NVML_STATE_")], 1.0 if value == tel.state else 0.0)
        yield nvml
        gl = ["node", "gpu"]
        fams = {
            "memory_total": GaugeMetricFamily("node_probe_gpu_memory_total_bytes", "GPU memory, bytes", labels=gl),
            "memory_used": GaugeMetricFamily("node_probe_gpu_memory_used_bytes", "GPU memory in use, bytes",
                                             labels=gl),
            "util": GaugeMetricFamily("node_probe_gpu_utilization_ratio", "GPU utilization, 0..1", labels=gl),
            "temp": GaugeMetricFamily("node_probe_gpu_temperature_celsius", "GPU temperature, celsius",
                                      labels=gl),
            "power": GaugeMetricFamily("node_probe_gpu_power_watts", "GPU power draw, watts", labels=gl),
            "ecc": GaugeMetricFamily("node_probe_gpu_ecc_uncorrected_errors", "uncorrected ECC errors NVML "
                                     "reports (its volatile count)", labels=gl),
            "throttle": GaugeMetricFamily("node_probe_gpu_clock_event_reasons", "NVML clocks-event "
                                          "(throttle) reason bit mask", labels=gl),
            "xids": GaugeMetricFamily("node_probe_gpu_recent_xid_events", "Xid events in the latest reading",
                                      labels=gl),
        }
        for g in tel.gpus:
            idx = [*n, str(g.index)]
            if g.HasField("memory_total_bytes"):
                fams["memory_total"].add_metric(idx, g.memory_total_bytes)
            if g.HasField("memory_used_bytes"):
                fams["memory_used"].add_metric(idx, g.memory_used_bytes)
            if g.HasField("utilization_ratio"):
                fams["util"].add_metric(idx, g.utilization_ratio)
            if g.HasField("temperature_c"):
                fams["temp"].add_metric(idx, g.temperature_c)
            if g.HasField("power_w"):
                fams["power"].add_metric(idx, g.power_w)
            if g.HasField("ecc_uncorrected"):
                fams["ecc"].add_metric(idx, g.ecc_uncorrected)
            fams["throttle"].add_metric(idx, g.throttle_reasons)
            fams["xids"].add_metric(idx, len(g.xid_events))
        yield from fams.values()


def _dial_in(node: str, states: dict[str, Any]):
    """node_probe_control_plane_streams and node_probe_control_plane_dials_total, per target."""
    streams = GaugeMetricFamily("node_probe_control_plane_streams", "dial-in: streams open to the control-plane "
                                "target (0: none; a DNS name: one per address)", labels=["node", "target"])
    dials = CounterMetricFamily("node_probe_control_plane_dials", "dial-in: streams opened or tried to the "
                                "control-plane target", labels=["node", "target"])
    for target, st in sorted(states.items()):
        streams.add_metric([node, target], st.streams)
        dials.add_metric([node, target], st.dials)
    yield streams
    yield dials


class AgentMetrics:
    """The agent's registry; ``probe()`` and ``scrape()`` count, :meth:`serve` exposes them.
    ``node_id``: the ``node`` label (default: the agent's ``cfg.node_id``)."""

    def __init__(self, agent: _AgentState, node_id: str | None = None) -> None:
        node = node_id if node_id is not None else getattr(getattr(agent, "cfg", None), "node_id", None)
        self.node = str(node or "unknown")
        self.probes: dict[str, float] = dict.fromkeys(("ok", *_FAILURE_NAMES.values()), 0.0)
        self.ttft_buckets = [0] * (len(TTFT_BUCKETS_S) + 1)  # per bucket (not cumulative), last: +Inf
        self.ttft_sum_s = 0.0
        self.scrapes = 0
        self.scrape_errors = 0
        self._cfg = getattr(agent, "cfg", None)
        self._watch: CertWatch | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StateCollector(agent, self.node, self))
        self._runner: web.AppRunner | None = None

    def probe(self, ok: bool, failure: int, ttft_ms: float | None) -> None:
        """Count one probe result (``failure`` a ``FailureKind`` value; TTFT in ms)."""
        kind = "ok" if ok else _FAILURE_NAMES.get(failure, "OTHER")
        self.probes[kind] = self.probes.get(kind, 0.0) + 1
        if ok and ttft_ms is not None:
            s = ttft_ms / 1000.0
            self.ttft_buckets[next((i for i, le in enumerate(TTFT_BUCKETS_S) if s <= le), len(TTFT_BUCKETS_S))] += 1
            self.ttft_sum_s += s

    def scrape(self, error: str) -> None:
        """Count one engine /metrics scrape (``error`` empty when it worked)."""
        self.scrapes += 1
        if error:
            self.scrape_errors += 1

    def families(self, node: str):
        """The counted families (``_total`` counters and the TTFT histogram), labelled ``node``."""
        probes = CounterMetricFamily("node_probe_probes", "micro-probes run, by result (ok or the failure kind)",
                                     labels=["node", "result"])
        for kind, v in self.probes.items():
            probes.add_metric([node, kind], v)
        yield probes
        cum, buckets = 0, []
        for le, c in zip((*(f"{b:g}" for b in TTFT_BUCKETS_S), "+Inf"), self.ttft_buckets, strict=True):
            cum += c
            buckets.append((le, float(cum)))
        ttft = HistogramMetricFamily("node_probe_probe_ttft_seconds", "TTFT of successful micro-probes, seconds",
                                     labels=["node"])
        ttft.add_metric([node], buckets, sum_value=self.ttft_sum_s)
        yield ttft
        scrapes = CounterMetricFamily("node_probe_metrics_scrapes", "scrapes of the engine's /metrics",
                                      labels=["node"])
        scrapes.add_metric([node], self.scrapes)
        yield scrapes
        errors = CounterMetricFamily("node_probe_metrics_scrape_errors", "failed scrapes of the engine's "
                                     "/metrics", labels=["node"])
        errors.add_metric([node], self.scrape_errors)
        yield errors

    def cert_watch(self) -> CertWatch | None:
        """The agent's certificate files (``tls_cert_file``, ``tls_client_ca_file``; dial-in's
        ``client_cert_file``, ``control_plane_ca_file``) watched for expiry within
        ``tls_expiry_warning_days``; None without TLS."""
        cfg = self._cfg
        dial_in = (getattr(cfg, "client_cert_file", None), getattr(cfg, "control_plane_ca_file", None))
        if self._watch is None and cfg is not None and (getattr(cfg, "tls_cert_file", None) or any(dial_in)):
            self._watch = CertWatch(cfg.tls_expiry_warning_days * 86400.0, prefix="node_probe",
                                    labels={"node": self.node})
            self._watch.add("agent_server", cfg.tls_cert_file)
            self._watch.add("agent_client_ca", cfg.tls_client_ca_file)
            self._watch.add("agent_dial_client", dial_in[0])
            self._watch.add("agent_dial_ca", dial_in[1])
        return self._watch

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def serve(self, listen: str) -> int:
        """Serve ``GET /metrics`` and ``GET /healthz`` on ``listen`` (HOST:PORT; port 0 picks one);
        the bound port. ``/healthz`` answers 200 ``{"status": "ok"}`` while the agent's event loop
        runs, whatever the engine's state (that is what the agent reports, not its own health).

        Raises OSError when it cannot be bound."""
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=self.exposition(),
                                headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        host, _, port = listen.rpartition(":")
        site = web.TCPSite(self._runner, host.strip("[]"), int(port))
        try:
            await site.start()
        except OSError:
            await self.close()
            raise
        bound = self._runner.addresses[0][1]
        log.info("agent metrics on http://%s:%d/metrics", host, bound)
        return bound

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


_FAILURE_NAMES = {v: n.removeprefix("FAILURE_KIND_") for n, v in probe_pb2.FailureKind.items() if v}
