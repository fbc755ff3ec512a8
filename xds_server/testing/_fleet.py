"""A local fleet on free 127.0.0.1 ports: N simulated engines, N node_probe agents, one
xds-server (or several replicas of it) and one real Envoy (:class:`Fleet`), and
:func:`restart_control_plane`."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from xds_server.config.health_names import RENAMED
from xds_server.config.renames import move_old_names
from xds_server.envoy.bootstrap import find_envoy, render_bootstrap, write_bootstrap
from xds_server.envoy.tls import add_xds_tls
from xds_server.testing._envoy import envoy_process, fetch_envoy_hosts
from xds_server.testing._process import ManagedProcess, free_port
from xds_server.testing._wait import wait_for

__all__ = ["Fleet", "NodeProcs", "restart_control_plane"]


@dataclass
class NodeProcs:
    """One simulated inference node: its engine and its agent, with their ports."""

    node_id: str
    engine_port: int
    agent_port: int
    engine: ManagedProcess | None = None
    agent: ManagedProcess | None = None

    @property
    def engine_url(self) -> str:
        """Base URL of the simulated engine."""
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def address(self) -> str:
        """``HOST:PORT`` of the engine, as the control plane publishes it to Envoy."""
        return f"127.0.0.1:{self.engine_port}"


@dataclass
class Fleet:
    """A local fleet on free 127.0.0.1 ports: engines, agents, xds-server, Envoy.

    Durations in seconds unless named otherwise. ``health`` overrides keys of the config's
    ``health`` section. Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    n_nodes: int = 3
    cluster: str = "llm"
    probe_interval_s: float = 1.0
    probe_timeout_ms: int = 800
    heartbeat_interval_ms: int = 100
    token_interval_ms: float = 10.0
    per_try_timeout_s: float | None = 1.0
    per_try_idle_timeout_s: float = 2.0
    api_type: str = "GRPC"
    envoy_binary: str | None = None
    health: dict[str, Any] = field(default_factory=dict)
    cluster_options: dict[str, Any] = field(default_factory=dict)
    workdir: Path | None = None
    node_prefix: str = "gpu-"
    # Extra config per node (by index: {"priority": 1, "locality": {...}}) and for the xds
    # section; merged into :meth:`config_dict`. Empty: the spine's config.
    node_options: list[dict[str, Any]] = field(default_factory=list)
    xds_options: dict[str, Any] = field(default_factory=dict)
    # Extra top-level config sections (``{"state": {...}, "reload": {...}}``); a section given
    # here replaces the fleet's own of that name.
    config_options: dict[str, Any] = field(default_factory=dict)
    admin_options: dict[str, Any] = field(default_factory=dict)  # merged into the admin section
    serve_args: list[str] = field(default_factory=list)  # more `xds-server serve` arguments ("--loop", ...)
    # Envoy's xds_cluster transport_socket (envoy.tls.xds_tls_transport_socket); None: plaintext.
    envoy_xds_tls: dict[str, Any] | None = None
    engine_args: list[str] = field(default_factory=list)  # more `sim-engine` arguments ("--byte-token-rate", ...)
    agent_args: list[list[str]] = field(default_factory=list)  # more agent arguments, by node index
    # The module each agent runs with ``python -m``, by node index (default node_probe.cli; a
    # wrapper such as xds_server.testing._blockable_agent runs node_probe.cli's main itself).
    agent_modules: list[str] = field(default_factory=list)
    # Control-plane replicas (docs/replicas.md): each its own xds-server with its own ports,
    # ``xds.replica_id`` cp-0, cp-1 ... and state file, the same clusters; every agent meets every
    # replica, Envoy's xds_cluster lists them all. 1: one xds-server, no replica_id set.
    replicas: int = 1
    # How the agents and the control plane meet: "dial" (the control plane dials each agent's
    # probe_address), "dial-in" (each agent dials the xDS port; nodes listed without probe_address)
    # or "register" (no node list: the cluster takes registrations, each agent says its node).
    agents: str = "dial"
    nodes: list[NodeProcs] = field(default_factory=list)
    procs: list[ManagedProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.xds_port = self.admin_port = self.envoy_port = self.envoy_admin_port = 0
        self.xds_ports: list[int] = []     # by replica; xds_port is replica 0's
        self.admin_ports: list[int] = []   # by replica; admin_port is replica 0's
        self.envoy: ManagedProcess | None = None
        self.control_plane: ManagedProcess | None = None   # replica 0
        self.control_planes: list[ManagedProcess] = []     # by replica

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _py(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def start(self) -> Fleet:
        """Start everything; raises EnvoyNotFound or RuntimeError (with output) on failure."""
        envoy_bin = find_envoy(self.envoy_binary)
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="xds-sentinel-")
            self.workdir = Path(self._tmp.name)
        wd = self.workdir
        try:
            letters = "abcdefghijklmnopqrstuvwxyz"
            for i in range(self.n_nodes):
                nid = f"{self.node_prefix}{letters[i] if i < 26 else i}"
                self.nodes.append(NodeProcs(nid, free_port(), free_port()))
            for n in self.nodes:
                n.engine = self._launch(ManagedProcess(
                    f"engine-{n.node_id}",
                    self._py("-m", "node_probe.cli", "sim-engine", "--port", str(n.engine_port),
                             "--replica-id", n.node_id, "--token-interval-ms", str(self.token_interval_ms),
                             *self.engine_args),
                    wd / f"engine-{n.node_id}.log", ready_pattern="listening"))
            self._wait_ready()
            self.xds_ports = [free_port() for _ in range(self.replicas)]
            self.admin_ports = [free_port() for _ in range(self.replicas)]
            self.xds_port, self.admin_port = self.xds_ports[0], self.admin_ports[0]
            for i, n in enumerate(self.nodes):
                module = self.agent_modules[i] if i < len(self.agent_modules) else "node_probe.cli"
                n.agent = self._launch(ManagedProcess(
                    f"agent-{n.node_id}",
                    self._py("-m", module, "--engine-url", n.engine_url, *self._meeting(n),
                             "--node-id", n.node_id,
                             "--heartbeat-interval-ms", str(self.heartbeat_interval_ms),
                             "--probe-interval-s", str(self.probe_interval_s),
                             "--probe-timeout-ms", str(self.probe_timeout_ms),
                             *(self.agent_args[i] if i < len(self.agent_args) else [])),
                    wd / f"agent-{n.node_id}.log", ready_pattern="listening|dialling"))
            self._wait_ready()
            for r in range(self.replicas):
                self._config_path(r).write_text(yaml.safe_dump(self.config_dict(r), sort_keys=False))
                self.control_planes.append(self._launch(self._control_plane_process(r)))
            self._wait_ready()
            self.control_plane = self.control_planes[0]
            self.envoy_port, self.envoy_admin_port = free_port(), free_port()
            doc = render_bootstrap(
                xds_port=self.xds_port, listener_port=self.envoy_port, admin_port=self.envoy_admin_port,
                cluster=self.cluster, api_type=self.api_type, per_try_timeout_s=self.per_try_timeout_s,
                per_try_idle_timeout_s=self.per_try_idle_timeout_s,
                xds_replicas=[f"127.0.0.1:{p}" for p in self.xds_ports] if self.replicas > 1 else ())
            if self.envoy_xds_tls is not None:
                add_xds_tls(doc, self.envoy_xds_tls)
            boot = write_bootstrap(wd / "envoy.yaml", doc)
            self.envoy = self._launch(envoy_process(envoy_bin, boot, wd, concurrency=2))  # no ready line
        except BaseException:
            self.stop()
            raise
        return self

    def _meeting(self, n: NodeProcs) -> list[str]:
        """The agent's arguments that say how it meets the control plane (``agents``)."""
        if self.agents == "dial":
            return ["--listen", f"127.0.0.1:{n.agent_port}"]
        out = ["--control-plane", ",".join(f"127.0.0.1:{p}" for p in self.xds_ports)]
        return out + (["--cluster", self.cluster, "--serving-address", n.address] if self.agents == "register" else [])

    def _config_path(self, replica: int = 0) -> Path:
        """Where replica ``replica``'s config is written: ``workdir/xds.yaml`` (replica 0),
        ``workdir/xds-cp-N.yaml``."""
        assert self.workdir is not None
        return self.workdir / ("xds.yaml" if replica == 0 else f"xds-cp-{replica}.yaml")

    def _control_plane_process(self, replica: int = 0) -> ManagedProcess:
        """Replica ``replica``'s xds-server process (not started) on its config file
        (:meth:`_config_path`)."""
        assert self.workdir is not None
        name = "xds-server" if replica == 0 else f"xds-server-cp-{replica}"
        return ManagedProcess(
            name, self._py("-m", "xds_server.cli", "serve", "--config", str(self._config_path(replica)),
                           *self.serve_args),
            self.workdir / f"{name}.log", ready_pattern="admin listening")

    def _launch(self, p: ManagedProcess) -> ManagedProcess:
        """Start ``p`` without waiting for it: the processes of one stage (the engines, the
        agents, the replicas) start together, and :meth:`_wait_ready` waits for them all (a
        fleet's start is its processes' imports, ~0.5-1.5 s of CPU each)."""
        self.procs.append(p)
        return p.launch()

    def _wait_ready(self) -> None:
        """Wait for every process started so far to say it is ready; raises RuntimeError (with
        the output tail of the first that is not) otherwise."""
        for p in self.procs:
            p.wait_ready()

    def stop(self) -> None:
        """Stop every process (Envoy first), always; then remove the temp dir."""
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def config_dict(self, replica: int = 0) -> dict[str, Any]:
        """The xds-server config replica ``replica`` runs with (the only one's: 0). With
        ``replicas`` > 1 each has its own ``xds.replica_id`` (cp-N), ports and ``state.path``
        (``NAME-cp-N.EXT`` beside replica 0's, when a state section is given), and
        ``health.score.rtt_weight`` 0 unless ``health`` says otherwise (docs/replicas.md: each
        replica measures RTT on its own path)."""
        given, _ = move_old_names(self.health, RENAMED, "health")  # flat names a test may still write
        health: dict[str, Any] = {**given, "heartbeat": {"interval": f"{self.heartbeat_interval_ms}ms",
                                                         **given.get("heartbeat", {})}}
        extra = dict(self.config_options)
        xds: dict[str, Any] = {"listen": f"127.0.0.1:{self.xds_ports[replica] if self.xds_ports else 0}"}
        if self.replicas > 1:
            health["score"] = {"rtt_weight": 0, **given.get("score", {})}
            xds["replica_id"] = f"cp-{replica}"
            state = extra.get("state")
            if replica > 0 and isinstance(state, dict) and "path" in state:
                path = Path(state["path"])
                extra["state"] = {**state, "path": str(path.with_name(f"{path.stem}-cp-{replica}{path.suffix}"))}
        admin_port = self.admin_ports[replica] if self.admin_ports else 0

        def node_opts(i: int) -> dict[str, Any]:
            return self.node_options[i] if i < len(self.node_options) else {}

        return {
            "xds": {**xds, **self.xds_options},
            "admin": {"listen": f"127.0.0.1:{admin_port}", **self.admin_options},
            "health": health,
            "clusters": [{
                **self.cluster_options,
                "name": self.cluster,
                "nodes": [] if self.agents == "register" else [
                    {"id": n.node_id, "address": n.address, **node_opts(i),
                     **({"probe_address": f"127.0.0.1:{n.agent_port}"} if self.agents == "dial" else {})}
                    for i, n in enumerate(self.nodes)],
                **({"discovery": {"agents": {"allow": ["*"]}}} if self.agents == "register" else {}),
            }],
            **extra,
        }

    def addresses(self) -> list[tuple[str, str]]:
        """(what, address) for every listening port, in a stable order."""
        out = [
            ("xDS (ADS gRPC)", f"127.0.0.1:{self.xds_port}"),
            ("xds-server admin", f"http://127.0.0.1:{self.admin_port}"),
            ("Envoy listener", f"http://127.0.0.1:{self.envoy_port}"),
            ("Envoy admin", f"http://127.0.0.1:{self.envoy_admin_port}"),
        ]
        for n in self.nodes:
            out.append((f"{n.node_id} engine", n.engine_url))
            out.append((f"{n.node_id} agent", f"127.0.0.1:{n.agent_port}"))
        return out

    @property
    def url(self) -> str:
        """Base URL of Envoy's listener."""
        return f"http://127.0.0.1:{self.envoy_port}"

    def node(self, node_id: str) -> NodeProcs:
        """The NodeProcs of a node id (KeyError if unknown)."""
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(node_id)

    # -- views -------------------------------------------------------------------------------

    async def envoy_hosts(self, session: aiohttp.ClientSession) -> dict[str, str]:
        """Envoy's view: node id -> "HEALTHY" or the reason it is excluded (from /clusters JSON)."""
        by_port = {n.engine_port: n.node_id for n in self.nodes}
        hosts = await fetch_envoy_hosts(session, f"http://127.0.0.1:{self.envoy_admin_port}", self.cluster)
        return {by_port.get(h.port, str(h.port)): h.status for h in hosts}

    async def envoy_weights(self, session: aiohttp.ClientSession) -> dict[str, int]:
        """Envoy's view of endpoint weights: node id -> load_balancing_weight."""
        by_port = {n.engine_port: n.node_id for n in self.nodes}
        hosts = await fetch_envoy_hosts(session, f"http://127.0.0.1:{self.envoy_admin_port}", self.cluster)
        return {by_port.get(h.port, str(h.port)): h.weight for h in hosts}

    async def cp_nodes(self, session: aiohttp.ClientSession) -> dict[str, dict]:
        """The control plane's view: node id -> /nodes entry."""
        async with session.get(f"http://127.0.0.1:{self.admin_port}/nodes") as r:
            data = await r.json()
        return {v["id"]: v for v in data["nodes"]}

    async def cp_events(self, session: aiohttp.ClientSession, limit: int = 1000) -> list[dict]:
        """The control plane's newest ``limit`` events (/events), oldest first."""
        async with session.get(f"http://127.0.0.1:{self.admin_port}/events", params={"limit": str(limit)}) as r:
            return list((await r.json())["events"])

    async def wait_all_routed(self, session: aiohttp.ClientSession, timeout_s: float = 30.0) -> float:
        """Wait until Envoy routes to every node; returns seconds waited. Raises TimeoutError."""
        t0 = time.monotonic()
        hosts: dict[str, str] = {}
        while time.monotonic() - t0 < timeout_s:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                hosts = await self.envoy_hosts(session)
                if len(hosts) == len(self.nodes) and all(v == "HEALTHY" for v in hosts.values()):
                    return time.monotonic() - t0
            await asyncio.sleep(0.1)
        why = ""  # the control plane's own view: each node's state and why
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
            why = "\n".join(f"{i}: {n['state']} ({n['reason']})" for i, n in (await self.cp_nodes(session)).items())
        tails = "\n".join(f"--- {p.name}\n{p.output_tail(10)}" for p in self.procs)
        raise TimeoutError(f"Envoy did not route to all {len(self.nodes)} nodes in {timeout_s}s; Envoy's "
                           f"hosts: {hosts}; the control plane's /nodes:\n{why}\n{tails}")

    async def wait_ejected(self, session: aiohttp.ClientSession, node_id: str, timeout_s: float = 5.0) -> float:
        """Wait until the control plane has ``node_id`` UNHEALTHY and Envoy no longer routes to it;
        returns seconds waited. Raises AssertionError (:func:`wait_for`) naming which of the two did
        not happen within ``timeout_s`` of its own."""
        t0 = time.monotonic()

        async def unhealthy() -> bool:
            return (await self.cp_nodes(session))[node_id]["state"] == "UNHEALTHY"

        async def excluded() -> bool:
            return (await self.envoy_hosts(session)).get(node_id) != "HEALTHY"

        await wait_for(unhealthy, timeout_s, what=f"{node_id} not ejected in {timeout_s} s")
        await wait_for(excluded, timeout_s, what=f"Envoy still routes to {node_id}")
        return time.monotonic() - t0

    async def set_fault(self, session: aiohttp.ClientSession, node_id: str, mode: str, **params: Any) -> dict:
        """Set a simulated engine's fault (none, hang, slow, error, queue)."""
        async with session.post(f"{self.node(node_id).engine_url}/sim/fault",
                                json={"mode": mode, **params}) as r:
            r.raise_for_status()
            return await r.json()


async def restart_control_plane(fleet: Fleet, down_s: float = 0.5, timeout_s: float = 20.0,
                                kill: bool = False, replica: int = 0) -> float:
    """Stop the fleet's xds-server (replica ``replica`` of ``Fleet.replicas``; SIGTERM, SIGKILL at
    once when ``kill``: no shutdown code runs), wait ``down_s``, start it again with the same
    config and ports; blocking steps run in a thread so the caller's load keeps flowing. Returns
    the seconds the control plane was unreachable. Raises RuntimeError if it does not come back."""
    assert fleet.control_planes and fleet.workdir is not None
    old = fleet.control_planes[replica]
    t0 = time.monotonic()
    if kill:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old.pid, signal.SIGKILL)
    await asyncio.to_thread(old.stop)
    await asyncio.sleep(down_s)
    new = fleet._control_plane_process(replica)
    fleet.procs[fleet.procs.index(old)] = new
    fleet.control_planes[replica] = new
    fleet.control_plane = fleet.control_planes[0]
    await asyncio.to_thread(new.start, timeout_s)
    return time.monotonic() - t0
