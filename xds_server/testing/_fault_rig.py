"""The fault matrix's rig (:class:`FaultRig`: a local fleet with a state file and
``sentinel-relay`` in front of its Envoy), its rows (:class:`FaultRow`, :func:`format_table`) and
the traffic helpers the faults share. The faults are in :mod:`xds_server.testing._faults`,
:mod:`xds_server.testing._ads_faults`, :mod:`xds_server.testing._agent_faults` and
:mod:`xds_server.testing._replica_faults`."""
from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from xds_server.testing._fleet import Fleet
from xds_server.testing._process import ManagedProcess, free_port
from xds_server.testing._traffic import TrafficLoad, TrafficStats
from xds_server.testing._wait import wait_for

__all__ = ["FaultRig", "FaultRow", "format_table", "prometheus_value"]

TOKEN = "fault-matrix"
#: Health settings of the rig: a 1.5 s half-open period and a 2-step ramp (defaults: 60 s,
#: 1 %/s) so a node's recovery fits in a test; probes every 0.3 s. Ramp steps of 0.5 s: a
#: poller on a loaded 2-core host (Envoy's and the control plane's admin, ~3 requests a round)
#: missed 0.2 s steps.
FAST_HEALTH = {"probation_clean_s": 1.5, "ramp_step_percent": 50, "ramp_step_s": 0.5}
#: The module the rig's first agent runs (``python -m``): node-probe whose event loop SIGUSR1 blocks
#: for the seconds in :attr:`FaultRig.block_file` (the other agents run node_probe.cli itself).
BLOCKABLE_AGENT = "xds_server.testing._blockable_agent"
#: Envoy's own passive outlier ejection stays on, with a 1 s base ejection time (default 10 s):
#: the connect failures of a killed engine trip it, and a test should not wait 10 s for it.
OUTLIER = {"outlier_detection": {"base_ejection_time_ms": 1000}}


@dataclass
class FaultRow:
    """One line of the matrix: what the clients on one path saw across ``repeats`` faults."""

    fault: str
    path: str                     # "Envoy" or "relay -> Envoy"
    repeats: int
    stats: TrafficStats
    rescued: int | None = None    # relay rescues that resumed a stream (relay path only)
    notes: str = ""


def format_table(rows: list[FaultRow]) -> str:
    """The matrix as a Markdown table."""
    out = ["| fault | path | times | requests ok / failed | streams whole / cut | rescued | "
           "refused connects (retried) | notes |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        s = r.stats
        fails = f"{s.failed}" + (f" ({dict(s.requests_failed)})" if s.failed else "")
        cuts = f"{s.cut}" + (f" ({dict(s.streams_cut)})" if s.cut else "")
        out.append(f"| {r.fault} | {r.path} | {r.repeats} | {s.requests_ok} / {fails} | {s.streams_ok} / {cuts} | "
                   f"{'-' if r.rescued is None else r.rescued} | {s.refused} | {r.notes} |")
    return "\n".join(out)


def prometheus_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` in a text exposition."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and want <= set(head.partition("{")[2].rstrip("}").split(",")):
            total += float(value)
    return total


@dataclass
class FaultRig:
    """A fleet for the matrix and ``sentinel-relay`` in front of its Envoy. Start with
    :meth:`start` (blocking, a few seconds), always :meth:`stop`."""

    n_nodes: int = 3
    token_interval_ms: float = 10.0
    api_type: str = "GRPC"  # Envoy's ADS: GRPC (SotW) or DELTA_GRPC
    config_options: dict[str, Any] = field(default_factory=dict)  # more config sections ({"probe": {...}})
    agents: str = "dial"  # how agents and control plane meet (Fleet.agents: dial, dial-in, register)
    replicas: int = 1  # control-plane replicas (Fleet.replicas); the relay's routing feed lists each
    health: dict[str, Any] = field(default_factory=dict)  # health settings over FAST_HEALTH ({"outlier": {...}})
    fleet: Fleet | None = None
    relay: ManagedProcess | None = None
    relay_port: int = 0
    relay_admin_port: int = 0
    _tmp: Any = field(default=None, repr=False)

    def start(self) -> FaultRig:
        """Start the fleet and the relay; waits until Envoy routes to every node."""
        self._tmp = tempfile.TemporaryDirectory(prefix="xds-faults-")
        wd = Path(self._tmp.name)
        self.fleet = Fleet(
            n_nodes=self.n_nodes, workdir=wd, probe_interval_s=0.3, token_interval_ms=self.token_interval_ms,
            api_type=self.api_type, agents=self.agents, replicas=self.replicas,
            agent_modules=[BLOCKABLE_AGENT], agent_args=[["--block-file", str(wd / "agent-block-s")]],
            health={**FAST_HEALTH, **self.health}, per_try_timeout_s=None, per_try_idle_timeout_s=2.0,
            admin_options={"token": TOKEN}, cluster_options=OUTLIER,
            config_options={"state": {"path": str(wd / "state.json"), "write_interval_s": 0.2},
                            **self.config_options})
        try:
            self.fleet.start()
            asyncio.run(self._routed())
            self.relay_port, self.relay_admin_port = free_port(), free_port()
            self.relay = ManagedProcess("relay", [
                sys.executable, "-m", "sentinel_relay.cli", "--listen", f"127.0.0.1:{self.relay_port}",
                "--upstream", self.fleet.url,
                *(a for port in self.fleet.xds_ports for a in ("--routing-feed", f"127.0.0.1:{port}")),
                "--admin-listen", f"127.0.0.1:{self.relay_admin_port}", "--ping-interval-s", "0.1",
                "--log-level", "WARNING"], wd / "relay.log", ready_pattern="ready").start()
        except BaseException:
            self.stop()
            raise
        return self

    async def _routed(self) -> None:
        assert self.fleet is not None
        async with aiohttp.ClientSession() as s:
            await self.fleet.wait_all_routed(s)

    def stop(self) -> None:
        """Stop the relay and the fleet (always safe to call)."""
        if self.relay is not None:
            self.relay.stop()
        if self.fleet is not None:
            self.fleet.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    @property
    def block_file(self) -> Path:
        """The file whose number (s) says how long a SIGUSR1 blocks the first node's agent loop
        (:data:`BLOCKABLE_AGENT`)."""
        assert self._tmp is not None
        return Path(self._tmp.name) / "agent-block-s"

    @property
    def relay_url(self) -> str:
        """Base URL of the relay."""
        return f"http://127.0.0.1:{self.relay_port}"

    def load(self, relay: bool = False, **kw: Any) -> TrafficLoad:
        """A (not started) mixed load against Envoy, or the relay when ``relay``."""
        assert self.fleet is not None
        return TrafficLoad(self.relay_url if relay else self.fleet.url, **kw)

    async def heal(self, http: aiohttp.ClientSession, timeout_s: float = 30.0) -> None:
        """Restart dead engines and agents, thaw frozen ones, wait until Envoy routes all nodes
        at full weight."""
        assert self.fleet is not None
        for n in self.fleet.nodes:
            for p in (n.engine, n.agent):
                if p is not None and not p.alive():
                    await asyncio.to_thread(p.start)
                elif p is not None and p.frozen:
                    p.thaw()
        await self.fleet.wait_all_routed(http, timeout_s=timeout_s)
        await wait_for(lambda: self._full_weight(http), timeout_s=timeout_s, step_s=0.05,
                       what="every node back at full weight")

    async def _full_weight(self, http: aiohttp.ClientSession) -> bool:
        assert self.fleet is not None
        nodes = await self.fleet.cp_nodes(http)
        return all(v["state"] == "HEALTHY" for v in nodes.values())

    async def envoy_synced(self, http: aiohttp.ClientSession, admin_port: int | None = None) -> bool:
        """True when the control plane (the replica with admin port ``admin_port``; default the
        first) has an Envoy stream that asked for CDS and EDS and ACKed everything sent to it."""
        assert self.fleet is not None
        try:
            async with http.get(f"http://127.0.0.1:{admin_port or self.fleet.admin_port}/xds/clients") as r:
                clients = (await r.json())["clients"]
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return False
        return any(c["node_id"].startswith("envoy-") and len(c["types"]) == 2 and all(
            t["acked_nonce"] == t["last_nonce"] for t in c["types"].values()) for c in clients)

    async def relay_in_flight(self, http: aiohttp.ClientSession, address: str) -> float:
        """Streams the relay runs on the engine at ``address`` now (``sentinel_relay_in_flight{node}``:
        where each stream runs at present, also after a rescue moved it)."""
        async with http.get(f"http://127.0.0.1:{self.relay_admin_port}/metrics") as r:
            return prometheus_value(await r.text(), "sentinel_relay_in_flight", node=address)

    async def rescued(self, http: aiohttp.ClientSession) -> float:
        """The relay's resumed rescues so far (``sentinel_relay_rescues_total{outcome="resumed"}``)."""
        async with http.get(f"http://127.0.0.1:{self.relay_admin_port}/metrics") as r:
            return prometheus_value(await r.text(), "sentinel_relay_rescues_total", outcome="resumed")


@contextlib.asynccontextmanager
async def _loads(rig: FaultRig, relay: bool = False, **kw: Any):
    loads = [await rig.load(**kw).start()]
    if relay:
        loads.append(await rig.load(relay=True, **kw).start())
    try:
        yield loads
    finally:
        for ld in loads:
            await ld.stop()


async def _warm(loads: list[TrafficLoad], timeout_s: float = 5.0) -> None:
    """Wait until every load has a finished request and a finished stream (traffic flows)."""
    await wait_for(lambda: all(ld.totals().requests_ok and ld.totals().streams_ok for ld in loads),
                   timeout_s=timeout_s, what="traffic flowing")


def _paths(rig: FaultRig, loads: list[TrafficLoad]) -> list[str]:
    assert rig.fleet is not None
    return ["Envoy" if ld.base == rig.fleet.url else "relay -> Envoy" for ld in loads]
