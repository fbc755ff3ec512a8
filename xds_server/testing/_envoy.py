"""Envoy admin helpers: one parser for ``/clusters?format=json`` and ``/stats``, and
:class:`StandaloneEnvoy` (a real Envoy against an ADS server the test runs itself)."""
from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from xds_server.envoy.bootstrap import find_envoy, render_bootstrap, write_bootstrap
from xds_server.envoy.tls import add_xds_tls
from xds_server.testing._process import ManagedProcess, free_port

__all__ = ["EnvoyHost", "StandaloneEnvoy", "envoy_process", "fetch_envoy_hosts", "parse_envoy_clusters",
           "parse_envoy_stats"]


def envoy_process(envoy_bin: str, bootstrap: Path, workdir: Path, concurrency: int) -> ManagedProcess:
    """An Envoy process (not started) on ``bootstrap``, with ``concurrency`` worker threads,
    warnings logged to ``workdir/envoy.log`` and its output to ``workdir/envoy.out``. A graceful
    drain (``POST /drain_listeners?graceful``) asks every connection to close after its next
    response at once (``--drain-strategy immediate``) and closes the listeners 1 s later."""
    return ManagedProcess(
        "envoy", [envoy_bin, "-c", str(bootstrap), "--disable-hot-restart", "--concurrency", str(concurrency),
                  "--drain-time-s", "1", "--drain-strategy", "immediate",
                  "-l", "warning", "--log-path", str(workdir / "envoy.log")],
        workdir / "envoy.out")


@dataclass(frozen=True)
class EnvoyHost:
    """One host of one cluster as Envoy's admin ``/clusters?format=json`` shows it.

    Attributes:
        port: the host's port (``address.socket_address.port_value``).
        health: ``eds_health_status`` (what the control plane published; ``"HEALTHY"`` when absent).
        flags: Envoy's own exclusion flags that are set, in Envoy's order (e.g.
            ``"failed_outlier_check"``, ``"failed_active_health_check"``).
        weight: ``load_balancing_weight`` (1 when absent).
        priority: the host's priority (0 when absent).
        requests, errors: the host's ``rq_total`` and ``rq_error`` counters (``stats``; 0 when
            absent, as Envoy leaves a zero out).
    """

    port: int
    health: str
    flags: tuple[str, ...]
    weight: int
    priority: int
    requests: int = 0
    errors: int = 0

    @property
    def status(self) -> str:
        """``"HEALTHY"`` if Envoy routes to the host, else why not: the EDS health status when
        it is not HEALTHY, otherwise the first exclusion flag."""
        if self.health != "HEALTHY":
            return self.health
        return self.flags[0] if self.flags else "HEALTHY"


def parse_envoy_clusters(data: dict[str, Any], cluster: str) -> list[EnvoyHost]:
    """The hosts of ``cluster`` in a parsed ``/clusters?format=json`` document, in Envoy's order
    (empty when the cluster is absent). Raises KeyError for a host without an address."""
    out: list[EnvoyHost] = []
    for cs in data.get("cluster_statuses", []):
        if cs.get("name") != cluster:
            continue
        for h in cs.get("host_statuses", []):
            hs = h.get("health_status", {})
            stats = {st.get("name"): int(st.get("value", 0)) for st in h.get("stats", [])}
            out.append(EnvoyHost(
                port=h["address"]["socket_address"]["port_value"],
                health=hs.get("eds_health_status", "HEALTHY"),
                flags=tuple(k for k, v in hs.items() if k != "eds_health_status" and v is True),
                weight=int(h.get("weight", 1)),
                priority=int(h.get("priority", 0)),
                requests=stats.get("rq_total", 0),
                errors=stats.get("rq_error", 0),
            ))
    return out


def parse_envoy_stats(text: str) -> dict[str, int]:
    """Envoy's plain-text ``/stats`` (``name: value`` lines) as name -> integer value; lines whose
    value is not an integer (histograms) are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        with contextlib.suppress(ValueError):
            out[name.strip()] = int(value.strip())
    return out


async def fetch_envoy_hosts(session: aiohttp.ClientSession, admin_url: str, cluster: str) -> list[EnvoyHost]:
    """GET ``{admin_url}/clusters?format=json`` and parse it with :func:`parse_envoy_clusters`.
    Raises aiohttp.ClientError / asyncio.TimeoutError when Envoy's admin does not answer."""
    async with session.get(f"{admin_url}/clusters?format=json") as r:
        data = await r.json(content_type=None)
    return parse_envoy_clusters(data, cluster)


class StandaloneEnvoy:
    """A real Envoy whose ADS server is one the test runs itself (no fleet), on free ports.

    ``xds_port``: where the test's ADS server listens; ``api_type``: "GRPC" or "DELTA_GRPC";
    ``retry_after_max_s``: bound on honouring ``Retry-After`` (s; the bootstrap's when None).
    ``xds_tls``: the xds_cluster's ``transport_socket``
    (:func:`~xds_server.envoy.tls.xds_tls_transport_socket`; None: plaintext).
    ``await start()`` waits until Envoy's admin answers (RuntimeError with its output if it
    exits); :meth:`stop` always reaps it. Admin helpers return parsed JSON or stats as a dict.
    """

    def __init__(self, xds_port: int, *, api_type: str = "GRPC", cluster: str = "llm",
                 node_id: str = "envoy-llm-gw-1", envoy_binary: str | None = None,
                 retry_after_max_s: float | None = None, xds_tls: dict[str, Any] | None = None) -> None:
        self.xds_port = xds_port
        self.xds_tls = xds_tls
        self.retry_after_max_s = retry_after_max_s
        self.api_type = api_type
        self.cluster = cluster
        self.node_id = node_id
        self.envoy_binary = envoy_binary
        self.listener_port = self.admin_port = 0
        self.proc: ManagedProcess | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """Base URL of Envoy's listener."""
        return f"http://127.0.0.1:{self.listener_port}"

    @property
    def admin_url(self) -> str:
        """Base URL of Envoy's admin endpoint."""
        return f"http://127.0.0.1:{self.admin_port}"

    async def start(self, timeout_s: float = 20.0) -> StandaloneEnvoy:
        """Start Envoy and wait for its admin endpoint. Raises EnvoyNotFound or RuntimeError."""
        envoy_bin = find_envoy(self.envoy_binary)
        self._tmp = tempfile.TemporaryDirectory(prefix="xds-envoy-")
        wd = Path(self._tmp.name)
        self.listener_port, self.admin_port = free_port(), free_port()
        doc = render_bootstrap(
            xds_port=self.xds_port, listener_port=self.listener_port, admin_port=self.admin_port,
            cluster=self.cluster, node_id=self.node_id, api_type=self.api_type,
            retry_after_max_s=self.retry_after_max_s)
        if self.xds_tls is not None:
            add_xds_tls(doc, self.xds_tls)
        boot = write_bootstrap(wd / "envoy.yaml", doc)
        self.proc = envoy_process(envoy_bin, boot, wd, concurrency=1).start()
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while time.monotonic() < deadline:
                if not self.proc.alive():
                    break
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with s.get(f"{self.admin_url}/server_info") as r:
                        if r.status == 200:
                            return self
                await asyncio.sleep(0.05)
        tail = self.proc.output_tail()
        self.stop()
        raise RuntimeError(f"Envoy admin did not come up; output:\n{tail}")

    def stop(self) -> None:
        """Stop Envoy (always safe to call) and remove its temp dir."""
        if self.proc is not None:
            self.proc.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def admin_json(self, path: str) -> Any:
        """GET an admin path and parse JSON (``/clusters?format=json``, ``/config_dump?include_eds``)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            async with s.get(f"{self.admin_url}{path}") as r:
                return await r.json(content_type=None)

    async def stats(self, filter_re: str = "") -> dict[str, int]:
        """Counters and gauges from ``/stats`` (``?filter=`` regex) as name -> integer value."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            async with s.get(f"{self.admin_url}/stats", params={"filter": filter_re} if filter_re else None) as r:
                return parse_envoy_stats(await r.text())

    async def hosts(self, cluster: str | None = None) -> dict[int, dict]:
        """Envoy's hosts of a cluster: port -> {health (eds_health_status), weight, priority}."""
        data = await self.admin_json("/clusters?format=json")
        return {h.port: {"health": h.health, "weight": h.weight, "priority": h.priority}
                for h in parse_envoy_clusters(data, cluster or self.cluster)}

    async def cluster_state(self, name: str) -> str:
        """"active", "warming" or "absent", from ``/config_dump`` (dynamic clusters)."""
        dump = await self.admin_json("/config_dump?resource=dynamic_active_clusters")
        for c in dump.get("configs", []):
            if c.get("cluster", {}).get("name") == name:
                return "active"
        dump = await self.admin_json("/config_dump?resource=dynamic_warming_clusters")
        for c in dump.get("configs", []):
            if c.get("cluster", {}).get("name") == name:
                return "warming"
        return "absent"
