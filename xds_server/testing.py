"""Test seam and local fleet harness, used by the demo, our integration tests and users' tests.

- :func:`free_port`: a free TCP port on 127.0.0.1.
- :class:`ManagedProcess`: a child process in its own process group, with its output captured,
  a "ready" line to wait for, freeze/thaw (SIGSTOP/SIGCONT) and a stop that always reaps it.
- :class:`Fleet`: N simulated engines, N node_probe agents, one xds-server and one real Envoy on
  free 127.0.0.1 ports, with helpers to read Envoy's and the control plane's view.
- :class:`LoadGenerator`: a steady request load through Envoy that counts requests per serving
  replica (``x-served-by``) and every failure.

Every process started here is registered and killed at interpreter exit as a last resort, so a
failed test never leaves an Envoy behind.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from xds_server.envoy_bootstrap import find_envoy, render_bootstrap, write_bootstrap

__all__ = [
    "Fleet",
    "LoadGenerator",
    "ManagedProcess",
    "NodeProcs",
    "ScriptedAdsClient",
    "ScriptedDeltaAdsClient",
    "StandaloneEnvoy",
    "free_port",
    "restart_control_plane",
]

_LIVE: set["ManagedProcess"] = set()


def _kill_all_at_exit() -> None:
    for p in list(_LIVE):
        with contextlib.suppress(Exception):
            p.stop(timeout_s=1.0)


atexit.register(_kill_all_at_exit)


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedProcess:
    """A child process in its own process group (so signals reach all of it).

    Output (stdout+stderr) goes to ``log_path`` and is scanned for ``ready_pattern``.
    """

    def __init__(self, name: str, argv: list[str], log_path: Path, ready_pattern: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.ready_re = re.compile(ready_pattern) if ready_pattern else None
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._ready = threading.Event()
        self._lines: collections.deque[str] = collections.deque(maxlen=200)
        self.frozen = False

    @property
    def pid(self) -> int:
        """PID of the child (raises RuntimeError before start)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} not started")
        return self.proc.pid

    def start(self, timeout_s: float = 20.0) -> "ManagedProcess":
        """Start and wait for the ready line. Raises RuntimeError (with the output tail) on failure."""
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        if self.env:
            env.update(self.env)
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )
        _LIVE.add(self)
        threading.Thread(target=self._pump, daemon=True, name=f"pump-{self.name}").start()
        if self.ready_re is None:
            return self
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._ready.wait(0.05):
                return self
            if self.proc.poll() is not None:
                break
        tail = "\n".join(list(self._lines)[-30:])
        rc = self.proc.poll()
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready (exit code {rc}); output:\n{tail}")

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log_path, "ab") as log:
            for raw in self.proc.stdout:
                log.write(raw)
                log.flush()
                line = raw.decode("utf-8", "replace").rstrip()
                self._lines.append(line)
                if self.ready_re is not None and not self._ready.is_set() and self.ready_re.search(line):
                    self._ready.set()

    def output_tail(self, n: int = 30) -> str:
        """Last ``n`` lines of output."""
        return "\n".join(list(self._lines)[-n:])

    def freeze(self) -> None:
        """SIGSTOP the whole process group (a host freeze, as a hung kernel or VM pause)."""
        os.killpg(self.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        """SIGCONT the process group."""
        os.killpg(self.pid, signal.SIGCONT)
        self.frozen = False

    def alive(self) -> bool:
        """True while the child runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM the group (SIGCONT first if frozen), SIGKILL after ``timeout_s``; returns exit code."""
        if self.proc is None:
            return None
        try:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGCONT)
                    os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(5)
            # Reap anything left in the group (e.g. grandchildren).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.returncode
        finally:
            _LIVE.discard(self)


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
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def address(self) -> str:
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
    per_try_timeout_s: float = 1.0
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
    nodes: list[NodeProcs] = field(default_factory=list)
    procs: list[ManagedProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.xds_port = self.admin_port = self.envoy_port = self.envoy_admin_port = 0
        self.envoy: ManagedProcess | None = None
        self.control_plane: ManagedProcess | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "Fleet":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _py(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def start(self) -> "Fleet":
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
                n.engine = self._spawn(ManagedProcess(
                    f"engine-{n.node_id}",
                    self._py("-m", "node_probe.cli", "sim-engine", "--port", str(n.engine_port),
                             "--replica-id", n.node_id, "--token-interval-ms", str(self.token_interval_ms)),
                    wd / f"engine-{n.node_id}.log", ready_pattern="listening"))
            for n in self.nodes:
                n.agent = self._spawn(ManagedProcess(
                    f"agent-{n.node_id}",
                    self._py("-m", "node_probe.cli", "--engine-url", n.engine_url,
                             "--listen", f"127.0.0.1:{n.agent_port}", "--node-id", n.node_id,
                             "--heartbeat-interval-ms", str(self.heartbeat_interval_ms),
                             "--probe-interval-s", str(self.probe_interval_s),
                             "--probe-timeout-ms", str(self.probe_timeout_ms)),
                    wd / f"agent-{n.node_id}.log", ready_pattern="listening"))
            self.xds_port, self.admin_port = free_port(), free_port()
            cfg = self.config_dict()
            cfg_path = wd / "xds.yaml"
            cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            self.control_plane = self._spawn(ManagedProcess(
                "xds-server", self._py("-m", "xds_server.cli", "serve", "--config", str(cfg_path)),
                wd / "xds-server.log", ready_pattern="admin listening"))
            self.envoy_port, self.envoy_admin_port = free_port(), free_port()
            boot = write_bootstrap(wd / "envoy.yaml", render_bootstrap(
                xds_port=self.xds_port, listener_port=self.envoy_port, admin_port=self.envoy_admin_port,
                cluster=self.cluster, api_type=self.api_type, per_try_timeout_s=self.per_try_timeout_s,
                per_try_idle_timeout_s=self.per_try_idle_timeout_s))
            self.envoy = self._spawn(ManagedProcess(
                "envoy", [envoy_bin, "-c", str(boot), "--disable-hot-restart", "--concurrency", "2",
                          "-l", "warning", "--log-path", str(wd / "envoy.log")],
                wd / "envoy.out", ready_pattern=None))
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, p: ManagedProcess) -> ManagedProcess:
        self.procs.append(p)
        return p.start()

    def stop(self) -> None:
        """Stop every process (Envoy first), always; then remove the temp dir."""
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def config_dict(self) -> dict[str, Any]:
        """The xds-server config this fleet runs with."""
        health = {"heartbeat_interval_ms": self.heartbeat_interval_ms}
        health.update(self.health)

        def node_opts(i: int) -> dict[str, Any]:
            return self.node_options[i] if i < len(self.node_options) else {}

        return {
            "xds": {"listen": f"127.0.0.1:{self.xds_port}", **self.xds_options},
            "admin": {"listen": f"127.0.0.1:{self.admin_port}"},
            "health": health,
            "clusters": [{
                **self.cluster_options,
                "name": self.cluster,
                "nodes": [{"id": n.node_id, "address": n.address,
                           "probe_address": f"127.0.0.1:{n.agent_port}", **node_opts(i)}
                          for i, n in enumerate(self.nodes)],
            }],
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
        async with session.get(f"http://127.0.0.1:{self.envoy_admin_port}/clusters?format=json") as r:
            data = await r.json(content_type=None)
        out: dict[str, str] = {}
        for cs in data.get("cluster_statuses", []):
            if cs.get("name") != self.cluster:
                continue
            for h in cs.get("host_statuses", []):
                port = h["address"]["socket_address"]["port_value"]
                hs = h.get("health_status", {})
                flags = [k for k, v in hs.items() if k != "eds_health_status" and v is True]
                eds = hs.get("eds_health_status", "HEALTHY")
                status = "HEALTHY" if eds == "HEALTHY" and not flags else (eds if eds != "HEALTHY" else flags[0])
                out[by_port.get(port, str(port))] = status
        return out

    async def envoy_weights(self, session: aiohttp.ClientSession) -> dict[str, int]:
        """Envoy's view of endpoint weights: node id -> load_balancing_weight."""
        by_port = {n.engine_port: n.node_id for n in self.nodes}
        async with session.get(f"http://127.0.0.1:{self.envoy_admin_port}/clusters?format=json") as r:
            data = await r.json(content_type=None)
        out: dict[str, int] = {}
        for cs in data.get("cluster_statuses", []):
            if cs.get("name") == self.cluster:
                for h in cs.get("host_statuses", []):
                    port = h["address"]["socket_address"]["port_value"]
                    out[by_port.get(port, str(port))] = int(h.get("weight", 1))
        return out

    async def cp_nodes(self, session: aiohttp.ClientSession) -> dict[str, dict]:
        """The control plane's view: node id -> /nodes entry."""
        async with session.get(f"http://127.0.0.1:{self.admin_port}/nodes") as r:
            data = await r.json()
        return {v["id"]: v for v in data["nodes"]}

    async def wait_all_routed(self, session: aiohttp.ClientSession, timeout_s: float = 30.0) -> float:
        """Wait until Envoy routes to every node; returns seconds waited. Raises TimeoutError."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                hosts = await self.envoy_hosts(session)
                if len(hosts) == len(self.nodes) and all(v == "HEALTHY" for v in hosts.values()):
                    return time.monotonic() - t0
            await asyncio.sleep(0.1)
        tails = "\n".join(f"--- {p.name}\n{p.output_tail(10)}" for p in self.procs)
        raise TimeoutError(f"Envoy did not route to all {len(self.nodes)} nodes in {timeout_s}s\n{tails}")

    async def set_fault(self, session: aiohttp.ClientSession, node_id: str, mode: str, **params: Any) -> dict:
        """Set a simulated engine's fault (none, hang, slow, error, queue)."""
        async with session.post(f"{self.node(node_id).engine_url}/sim/fault",
                                json={"mode": mode, **params}) as r:
            r.raise_for_status()
            return await r.json()


@dataclass
class LoadStats:
    """Counts for one phase of load."""

    ok_by_node: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return sum(self.ok_by_node.values())

    @property
    def failed(self) -> int:
        return sum(self.failures.values())


class LoadGenerator:
    """``concurrency`` workers sending non-streaming completions through Envoy in a loop.

    Counts go to the current phase (:meth:`phase`). A request fails if Envoy answers non-200 or
    the connection breaks; the status or exception name is counted. Bounded: stops at
    :meth:`stop` or after ``max_duration_s``.
    """

    def __init__(self, url: str, concurrency: int = 4, max_tokens: int = 4, pause_s: float = 0.0,
                 max_duration_s: float = 300.0, request_timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/") + "/v1/completions"
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.pause_s = pause_s
        self.max_duration_s = max_duration_s
        self.request_timeout_s = request_timeout_s
        self.phases: dict[str, LoadStats] = {}
        self.current = "start"
        self.phases[self.current] = LoadStats()
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None

    def phase(self, name: str) -> LoadStats:
        """Start counting into a new phase; returns its stats object."""
        self.current = name
        self.phases.setdefault(name, LoadStats())
        return self.phases[name]

    async def start(self) -> None:
        """Start the workers."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            connector=aiohttp.TCPConnector(limit=self.concurrency * 2),
        )
        self._t0 = time.monotonic()
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.concurrency)]

    async def _worker(self, i: int) -> None:
        assert self._session is not None
        body = {"model": "sim-model", "prompt": f"load {i}", "max_tokens": self.max_tokens,
                "temperature": 0, "stream": False}
        while not self._stop.is_set() and time.monotonic() - self._t0 < self.max_duration_s:
            phase = self.phases[self.current]
            t = time.monotonic()
            try:
                async with self._session.post(self.url, json=body) as r:
                    await r.read()
                    if r.status == 200:
                        phase.ok_by_node[r.headers.get("x-served-by", "?")] += 1
                        phase.latencies_ms.append((time.monotonic() - t) * 1000.0)
                    else:
                        phase.failures[f"HTTP {r.status}"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                phase.failures[type(e).__name__] += 1
            if self.pause_s:
                await asyncio.sleep(self.pause_s)

    async def stop(self) -> None:
        """Stop the workers, wait for in-flight requests, close the session."""
        self._stop.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def totals(self) -> LoadStats:
        """All phases summed."""
        t = LoadStats()
        for s in self.phases.values():
            t.ok_by_node.update(s.ok_by_node)
            t.failures.update(s.failures)
            t.latencies_ms.extend(s.latencies_ms)
        return t


class ScriptedAdsClient:
    """A scripted SotW ADS client for protocol tests: send requests, read responses, expect silence.

    Example::

        c = ScriptedAdsClient("127.0.0.1:18000")
        await c.open()
        await c.send(type_url=CLUSTER_TYPE_URL, node_id="envoy-1")
        resp = await c.recv()
        await c.send(type_url=CLUSTER_TYPE_URL, version=resp.version_info, nonce=resp.nonce)  # ACK
        await c.expect_silence(0.3)
        await c.close()
    """

    def __init__(self, target: str) -> None:
        import grpc
        from envoy.service.discovery.v3 import ads_pb2_grpc

        self.channel = grpc.aio.insecure_channel(target)
        self.stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)
        self._q: asyncio.Queue[Any] = asyncio.Queue()
        self.call: Any = None

    def _rpc(self) -> Any:
        """The stub method this client drives (SotW here; delta in the subclass)."""
        return self.stub.StreamAggregatedResources

    async def open(self) -> None:
        """Open the stream; one task reads it so a timed-out wait never cancels the RPC itself."""
        import grpc

        async def requests():
            while True:
                item = await self._q.get()
                if item is None:
                    return
                yield item

        self.call = self._rpc()(requests())
        self._responses: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                while True:
                    msg = await self.call.read()
                    if msg is grpc.aio.EOF:
                        await self._responses.put(EOFError("stream ended"))
                        return
                    await self._responses.put(msg)
            except grpc.aio.AioRpcError as e:
                await self._responses.put(e)

        self._pump = asyncio.create_task(pump())

    async def send(self, *, type_url: str, names: list[str] | None = None, version: str = "",
                   nonce: str = "", node_id: str | None = None, error: str | None = None) -> None:
        """Send one DiscoveryRequest (``error`` set makes it a NACK)."""
        from envoy.service.discovery.v3 import discovery_pb2
        from google.rpc import status_pb2

        req = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names or [],
                                             version_info=version, response_nonce=nonce)
        if node_id is not None:
            req.node.id = node_id
        if error is not None:
            req.error_detail.CopyFrom(status_pb2.Status(code=13, message=error))
        await self._q.put(req)

    async def recv(self, timeout_s: float = 2.0) -> Any:
        """Next DiscoveryResponse; raises asyncio.TimeoutError after ``timeout_s``, or the
        stream's AioRpcError / EOFError when it ended."""
        item = await asyncio.wait_for(self._responses.get(), timeout_s)
        if isinstance(item, BaseException):
            raise item
        return item

    async def expect_silence(self, duration_s: float) -> None:
        """Raise AssertionError if any response arrives within ``duration_s``."""
        try:
            resp = await asyncio.wait_for(self._responses.get(), duration_s)
        except asyncio.TimeoutError:
            return
        raise AssertionError(f"expected no response, got {resp}")

    async def close(self) -> None:
        """Cancel the stream and close the channel."""
        await self._q.put(None)
        if self.call is not None:
            self.call.cancel()
            self._pump.cancel()
        await self.channel.close()


# ---- xDS protocol test seams (delta client, Envoy alone, control-plane restart) --------------


class ScriptedDeltaAdsClient(ScriptedAdsClient):
    """A scripted delta (incremental) ADS client: the same seam as :class:`ScriptedAdsClient`
    for ``DeltaAggregatedResources``.

    Example::

        c = ScriptedDeltaAdsClient("127.0.0.1:18000")
        await c.open()
        await c.send(type_url=CLUSTER_TYPE_URL, node_id="envoy-1")          # legacy wildcard
        resp = await c.recv()                                                # DeltaDiscoveryResponse
        await c.send(type_url=CLUSTER_TYPE_URL, nonce=resp.nonce)            # ACK
        await c.send(type_url=CLA_TYPE_URL, subscribe=["llm"])
        await c.expect_silence(0.3)
        await c.close()
    """

    def _rpc(self) -> Any:
        return self.stub.DeltaAggregatedResources

    async def send(self, *, type_url: str, subscribe: list[str] | None = None,  # type: ignore[override]
                   unsubscribe: list[str] | None = None, initial_versions: dict[str, str] | None = None,
                   nonce: str = "", node_id: str | None = None, error: str | None = None) -> None:
        """Send one DeltaDiscoveryRequest (``nonce`` set: an ACK, plus ``error``: a NACK)."""
        from envoy.service.discovery.v3 import discovery_pb2
        from google.rpc import status_pb2

        req = discovery_pb2.DeltaDiscoveryRequest(
            type_url=type_url, resource_names_subscribe=subscribe or [],
            resource_names_unsubscribe=unsubscribe or [], initial_resource_versions=initial_versions or {},
            response_nonce=nonce)
        if node_id is not None:
            req.node.id = node_id
        if error is not None:
            req.error_detail.CopyFrom(status_pb2.Status(code=13, message=error))
        await self._q.put(req)

    async def send_raw(self, req: Any) -> None:
        """Send a prepared DeltaDiscoveryRequest as is."""
        await self._q.put(req)


class StandaloneEnvoy:
    """A real Envoy whose ADS server is one the test runs itself (no fleet), on free ports.

    ``xds_port``: where the test's ADS server listens; ``api_type``: "GRPC" or "DELTA_GRPC".
    ``await start()`` waits until Envoy's admin answers (RuntimeError with its output if it
    exits); :meth:`stop` always reaps it. Admin helpers return parsed JSON or stats as a dict.
    """

    def __init__(self, xds_port: int, *, api_type: str = "GRPC", cluster: str = "llm",
                 node_id: str = "envoy-llm-gw-1", envoy_binary: str | None = None) -> None:
        self.xds_port = xds_port
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

    async def start(self, timeout_s: float = 20.0) -> "StandaloneEnvoy":
        """Start Envoy and wait for its admin endpoint. Raises EnvoyNotFound or RuntimeError."""
        envoy_bin = find_envoy(self.envoy_binary)
        self._tmp = tempfile.TemporaryDirectory(prefix="xds-envoy-")
        wd = Path(self._tmp.name)
        self.listener_port, self.admin_port = free_port(), free_port()
        boot = write_bootstrap(wd / "envoy.yaml", render_bootstrap(
            xds_port=self.xds_port, listener_port=self.listener_port, admin_port=self.admin_port,
            cluster=self.cluster, node_id=self.node_id, api_type=self.api_type))
        self.proc = ManagedProcess(
            "envoy", [envoy_bin, "-c", str(boot), "--disable-hot-restart", "--concurrency", "1",
                      "-l", "warning", "--log-path", str(wd / "envoy.log")],
            wd / "envoy.out").start()
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
        out: dict[str, int] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            async with s.get(f"{self.admin_url}/stats", params={"filter": filter_re} if filter_re else None) as r:
                for line in (await r.text()).splitlines():
                    name, _, value = line.partition(": ")
                    with contextlib.suppress(ValueError):
                        out[name.strip()] = int(value.strip())
        return out

    async def hosts(self, cluster: str | None = None) -> dict[int, dict]:
        """Envoy's hosts of a cluster: port -> {health (eds_health_status), weight, priority}."""
        data = await self.admin_json("/clusters?format=json")
        out: dict[int, dict] = {}
        for cs in data.get("cluster_statuses", []):
            if cs.get("name") != (cluster or self.cluster):
                continue
            for h in cs.get("host_statuses", []):
                port = h["address"]["socket_address"]["port_value"]
                out[port] = {"health": h.get("health_status", {}).get("eds_health_status", "HEALTHY"),
                             "weight": h.get("weight", 1), "priority": h.get("priority", 0)}
        return out

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


async def restart_control_plane(fleet: Fleet, down_s: float = 0.5, timeout_s: float = 20.0) -> float:
    """Stop the fleet's xds-server (SIGTERM), wait ``down_s``, start it again with the same config
    and ports; blocking steps run in a thread so the caller's load keeps flowing. Returns the
    seconds the control plane was unreachable. Raises RuntimeError if it does not come back."""
    assert fleet.control_plane is not None and fleet.workdir is not None
    old = fleet.control_plane
    t0 = time.monotonic()
    await asyncio.to_thread(old.stop)
    await asyncio.sleep(down_s)
    new = ManagedProcess(
        "xds-server", fleet._py("-m", "xds_server.cli", "serve", "--config", str(fleet.workdir / "xds.yaml")),
        fleet.workdir / "xds-server.log", ready_pattern="admin listening")
    fleet.procs[fleet.procs.index(old)] = new
    fleet.control_plane = new
    await asyncio.to_thread(new.start, timeout_s)
    return time.monotonic() - t0
