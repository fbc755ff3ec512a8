"""More than one control plane, with the real Envoy and Envoy's own mechanisms. The
processes, once per bootstrap variant:

- group A owns cluster ``pool-a`` (nodes gpu-a1, gpu-a2) and runs two replicas, ``cp-a1`` and
  ``cp-a2``, watching the same agents; group B owns ``pool-b`` (gpu-b1) with one process;
- Envoy's bootstrap comes from :func:`render_bootstrap`, one variant per module setup:
  ``eds-sotw``: two :class:`ControlPlaneGroup` s, ``xds_a`` listing both A replicas and ``xds_b``
  the B process, each cluster's ``eds_config`` (SotW) pointing at its group, the header
  ``x-sentinel-cluster`` picking the cluster; ``ads-delta``: one delta ADS stream (CDS + EDS) to
  ``xds_cluster`` listing both A replicas (docs/replicas.md, "Running two replicas"), routing to pool-a
  (group B runs, unused by Envoy, as the probe-rate reference).

Tests: both clusters answer and a host frozen in pool-a is excluded by Envoy while pool-b is
untouched (``eds-sotw``); in both variants the A replica Envoy is connected to is frozen (Envoy
moves to the other within the keepalive's ~2 s), then killed with SIGKILL, then stopped with
SIGTERM (a rolling restart) under load: no request fails, the survivor held the same versions,
Envoy's pool-a update stats show no change beyond the reconnect (delta: no update at all) and no
cluster is added or modified, and the agents watched by two replicas probe their engines no
more than the one watched by a single process.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from xds_server.config import parse_config
from xds_server.envoy.bootstrap import ROUTE_HEADER, ControlPlaneGroup, find_envoy, render_bootstrap, write_bootstrap
from xds_server.testing import (
    LoadGenerator,
    ManagedProcess,
    NodeProcs,
    fetch_envoy_hosts,
    free_port,
    parse_envoy_stats,
    wait_for,
)
from xds_server.testing._fault_rig import prometheus_value

pytestmark = pytest.mark.envoy

# Replicas weight nodes from what the agents report: RTT is measured by each replica on its own
# path (docs/replicas.md: Running two replicas), so its score term is off here. Slow probes and late
# heartbeats on a loaded CI machine are tolerated (TTFT up to 700 ms healthy, 3 misses of 500 ms)
# so the state stays put while the test looks at failover; a frozen host is still out in ~1.5 s.
HEALTH = {"heartbeat": {"interval": "100ms", "grace": "400ms", "failure_detector": "count"},
          "probes": {"ttft_healthy": "700ms"},
          "probation": {"clean": "1s", "ramp_step_percent": 50, "ramp_step": "200ms"},
          "score": {"rtt_weight": 0.0}}
NODE_ID = "envoy-llm-gw-1"
EDS_SOTW, ADS_DELTA = "eds-sotw", "ads-delta"


@dataclass
class ControlPlaneProc:
    replica: str
    group: str
    xds_port: int
    admin_port: int
    proc: ManagedProcess | None = None

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


class Split:
    """The module's processes; :meth:`stop` stops every one by its own handle."""

    def __init__(self, wd: Path, variant: str = EDS_SOTW) -> None:
        self.wd = wd
        self.variant = variant
        # the clusters Envoy has; group B (pool-b) runs only where Envoy reaches it
        self.routed = ("pool-a", "pool-b") if variant == EDS_SOTW else ("pool-a",)
        self.procs: list[ManagedProcess] = []
        self.cluster_of = {"gpu-a1": "pool-a", "gpu-a2": "pool-a", "gpu-b1": "pool-b"}
        self.nodes = [NodeProcs(nid, free_port(), free_port())
                      for nid, c in self.cluster_of.items() if c in self.routed]
        self.cps = [ControlPlaneProc(r, g, free_port(), free_port())
                    for r, g in (("cp-a1", "a"), ("cp-a2", "a"), ("cp-b1", "b")) if f"pool-{g}" in self.routed]
        self.envoy_port, self.envoy_admin_port = free_port(), free_port()
        self.envoy: ManagedProcess | None = None
        self.last_seen: dict[str, object] = {}  # all_routed's last look, per cluster

    def _py(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def _start_all(self, procs: list[ManagedProcess]) -> None:
        self.procs.extend(procs)
        with ThreadPoolExecutor(len(procs)) as ex:
            for f in [ex.submit(p.start, 30.0) for p in procs]:
                f.result()

    def config(self, cp: ControlPlaneProc) -> dict:
        cluster = "pool-a" if cp.group == "a" else "pool-b"
        return {
            "xds": {"listen": f"127.0.0.1:{cp.xds_port}", "replica_id": cp.replica},
            "admin": {"listen": f"127.0.0.1:{cp.admin_port}"},
            "health": HEALTH,
            "clusters": [{"name": cluster, "outlier_detection": {"enabled": False}, "nodes": [
                {"id": n.node_id, "address": f"127.0.0.1:{n.engine_port}",
                 "probe_address": f"127.0.0.1:{n.agent_port}"}
                for n in self.nodes if self.cluster_of[n.node_id] == cluster]}],
        }

    def start(self) -> Split:
        wd = self.wd
        for n in self.nodes:
            n.engine = ManagedProcess(f"engine-{n.node_id}", self._py(
                "-m", "node_probe.cli", "sim-engine", "--port", str(n.engine_port), "--replica-id", n.node_id,
                "--token-interval-ms", "10"), wd / f"engine-{n.node_id}.log", ready_pattern="listening")
            n.agent = ManagedProcess(f"agent-{n.node_id}", self._py(
                "-m", "node_probe.cli", "--engine-url", f"http://127.0.0.1:{n.engine_port}",
                "--listen", f"127.0.0.1:{n.agent_port}", "--node-id", n.node_id, "--heartbeat-interval-ms", "100",
                "--probe-interval-s", "1.0", "--probe-timeout-ms", "800"),
                wd / f"agent-{n.node_id}.log", ready_pattern="listening")
        self._start_all([n.engine for n in self.nodes] + [n.agent for n in self.nodes])
        for cp in self.cps:
            (wd / f"{cp.replica}.yaml").write_text(yaml.safe_dump(self.config(cp), sort_keys=False))
            cp.proc = self._serve(cp)
        self._start_all([cp.proc for cp in self.cps])
        replicas = {g: tuple(f"127.0.0.1:{cp.xds_port}" for cp in self.cps if cp.group == g) for g in ("a", "b")}
        ports = {"listener_port": self.envoy_port, "admin_port": self.envoy_admin_port,
                 "per_try_timeout_s": 1.0, "per_try_idle_timeout_s": 2.0}
        if self.variant == EDS_SOTW:
            groups = [ControlPlaneGroup(g, replicas[g], tuple(parse_config(
                self.config(next(c for c in self.cps if c.group == g))).clusters)) for g in ("a", "b")]
            doc = render_bootstrap(groups=groups, **ports)
        else:
            doc = render_bootstrap(xds_replicas=replicas["a"], cluster="pool-a", api_type="DELTA_GRPC", **ports)
        boot = write_bootstrap(wd / "envoy.yaml", doc)
        self.envoy = ManagedProcess("envoy", [find_envoy(), "-c", str(boot), "--disable-hot-restart",
                                              "--concurrency", "2", "-l", "warning"], wd / "envoy.out")
        self.procs.append(self.envoy.start())
        return self

    def _serve(self, cp: ControlPlaneProc) -> ManagedProcess:
        return ManagedProcess(cp.replica, self._py("-m", "xds_server.cli", "serve", "--config",
                                                   str(self.wd / f"{cp.replica}.yaml")),
                              self.wd / f"{cp.replica}.log", ready_pattern="admin listening")

    def restart(self, cp: ControlPlaneProc) -> None:
        """Start ``cp`` again (same config and ports) after a test stopped it."""
        cp.proc = self._serve(cp)
        self.procs.append(cp.proc)
        cp.proc.start(30.0)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    def node(self, node_id: str) -> NodeProcs:
        return next(n for n in self.nodes if n.node_id == node_id)

    async def hosts(self, http, cluster: str) -> dict[str, str]:
        """Envoy's view of ``cluster``: node id -> "HEALTHY" or why it is excluded."""
        by_port = {n.engine_port: n.node_id for n in self.nodes}
        hosts = await fetch_envoy_hosts(http, f"http://127.0.0.1:{self.envoy_admin_port}", cluster)
        return {by_port.get(h.port, str(h.port)): h.status for h in hosts}

    async def all_routed(self, http) -> bool:
        """Every node of every cluster Envoy has is HEALTHY in Envoy (what was seen last is kept
        in ``last_seen`` for a failure message: :meth:`routed_why`)."""
        try:
            for cluster in self.routed:
                want = {n.node_id: "HEALTHY" for n in self.nodes if self.cluster_of[n.node_id] == cluster}
                got = self.last_seen[cluster] = await self.hosts(http, cluster)
                if got != want:
                    return False
            return True
        except Exception as e:  # a failed read is "not yet"; kept for the message
            self.last_seen["error"] = repr(e)[:200]
            return False

    def routed_why(self) -> str:
        """What :meth:`all_routed` saw last, and whether each process is alive (a failure message)."""
        alive = {cp.replica: cp.proc.alive() for cp in self.cps}
        agents = {n.node_id: n.agent.alive() for n in self.nodes}
        tails = "".join(f"\n--- {cp.replica} log tail:\n{cp.proc.output_tail(8)}" for cp in self.cps)
        return (f"every node HEALTHY in Envoy; last seen {self.last_seen}, control planes alive {alive}, "
                f"agents alive {agents}{tails}")

    async def envoy_stats(self, http, cluster: str) -> dict[str, int]:
        """Envoy's update counters of ``cluster`` (``update_success``, ``version``, ...) and its
        cluster manager's (``cluster_manager.cluster_added``/``_modified``/``_removed``, and with
        CDS ``cluster_manager.cds.*``)."""
        async with http.get(f"http://127.0.0.1:{self.envoy_admin_port}/stats", params={"filter": (
                rf"^cluster\.{cluster}\.(update_|membership_change|version$)"
                r"|^cluster_manager\.(cluster_(added|modified|removed)$|cds\.(update_|version$))")}) as r:
            stats = parse_envoy_stats(await r.text())
        return {k.split(".", 2)[2] if k.startswith("cluster.") else k: v for k, v in stats.items()}

    async def connected(self, http, cp: ControlPlaneProc, acked: bool = True) -> bool:
        """Whether Envoy holds an EDS stream on ``cp`` (with ``acked``: and everything sent on it
        is ACKed, which is momentarily false while a push is in flight: poll it with wait_for)."""
        with contextlib.suppress(Exception):
            async with http.get(f"{cp.admin}/xds/clients") as r:
                data = await r.json()
            assert data["replica"] == cp.replica
            return any(c["node_id"] == NODE_ID and c["types"] and (not acked or all(
                t["acked_nonce"] == t["last_nonce"] for t in c["types"].values())) for c in data["clients"])
        return False

    async def cla_version(self, http, cp: ControlPlaneProc, cluster: str) -> str:
        async with http.get(f"{cp.admin}/clusters") as r:
            data = await r.json()
        return next(c["xds_version"] for c in data["clusters"] if c["name"] == cluster)

    async def same_version(self, http) -> str | None:
        """pool-a's assignment version when both A replicas publish the same one (the same state:
        versions are content hashes), else None."""
        a1, a2 = self.cps[0], self.cps[1]
        v1, v2 = await self.cla_version(http, a1, "pool-a"), await self.cla_version(http, a2, "pool-a")
        return v1 if v1 == v2 != "" else None

    async def encoded(self, http, cp: ControlPlaneProc) -> int:
        """How many resources ``cp`` has encoded into its cache since it started: one per new
        version of a resource (``sentinel_xds_resources_encoded_total``). An A replica's cache
        holds pool-a's assignment and cluster, so this counts every version it published."""
        async with http.get(f"{cp.admin}/metrics") as r:
            return int(prometheus_value(await r.text(), "sentinel_xds_resources_encoded_total"))

    async def probes_at_engines(self, http) -> dict[str, int]:
        out = {}
        for n in self.nodes:
            async with http.get(f"http://127.0.0.1:{n.engine_port}/sim/stats") as r:
                out[n.node_id] = (await r.json())["requests_by_kind"]["probe"]
        return out


@pytest.fixture(scope="module", params=[EDS_SOTW, ADS_DELTA])
def split(request):
    """The module's processes with the bootstrap ``request.param`` (one setup per variant)."""
    with tempfile.TemporaryDirectory(prefix="xds-sentinel-split-") as d:
        s = Split(Path(d), request.param)
        try:
            yield s.start()
        finally:
            s.stop()


@pytest.mark.parametrize("split", [EDS_SOTW], indirect=True)  # pool-b is reached through group B
async def test_each_cluster_from_its_own_control_plane_frozen_node_excluded_other_cluster_untouched(split, http):
    await wait_for(lambda: split.all_routed(http), timeout_s=30.0, what=split.routed_why)
    # each cluster's EDS came from its own group: pool-b's stream is on cp-b1 only
    await wait_for(lambda: split.connected(http, split.cps[2]), timeout_s=10.0, what="Envoy's pool-b stream on cp-b1")
    load_a = LoadGenerator(split.url, concurrency=2)
    load_b = LoadGenerator(split.url, concurrency=2, headers={ROUTE_HEADER: "pool-b"})
    await load_a.start()
    await load_b.start()
    b_seen: list[dict[str, str]] = []
    frozen = split.node("gpu-a1")
    try:
        load_a.phase("steady")
        load_b.phase("steady")
        await asyncio.sleep(0.5)
        a_frozen, b_frozen = load_a.phase("a1 frozen"), load_b.phase("a1 frozen")
        frozen.engine.freeze()
        frozen.agent.freeze()
        try:
            async def a1_out() -> bool:
                b_seen.append(await split.hosts(http, "pool-b"))
                return (await split.hosts(http, "pool-a")).get("gpu-a1") != "HEALTHY"

            await wait_for(a1_out, timeout_s=5.0)
            await asyncio.sleep(0.5)
            b_seen.append(await split.hosts(http, "pool-b"))
        finally:
            frozen.agent.thaw()
            frozen.engine.thaw()
        load_a.phase("after")
        load_b.phase("after")
    finally:
        await load_a.stop()
        await load_b.stop()
    steady_a, steady_b = load_a.phases["steady"], load_b.phases["steady"]
    print(f"\npool-a: {dict(steady_a.ok_by_node)} then {dict(a_frozen.ok_by_node)} failed {dict(a_frozen.failures)}; "
          f"pool-b: {dict(steady_b.ok_by_node)} then {dict(b_frozen.ok_by_node)} failed {dict(b_frozen.failures)}")
    # requests to both clusters succeed, each served by its own cluster's engines
    assert steady_a.ok > 5 and set(steady_a.ok_by_node) <= {"gpu-a1", "gpu-a2"} and steady_a.failed == 0
    assert steady_b.ok > 5 and set(steady_b.ok_by_node) == {"gpu-b1"} and steady_b.failed == 0
    # pool-b untouched by pool-a's frozen host: routed all along, nothing failed
    assert b_seen and all(v == {"gpu-b1": "HEALTHY"} for v in b_seen)
    assert b_frozen.ok > 5 and b_frozen.failed == 0 and load_b.totals().failed == 0
    await wait_for(lambda: split.all_routed(http), timeout_s=15.0)  # gpu-a1 back after the thaw


async def test_freeze_of_the_connected_replica_moves_envoy_to_the_other_and_a_node_dying_then_is_excluded(split, http):
    """The host of the replica Envoy's stream is on freezes (SIGSTOP: no FIN, no RST, the kernel
    still accepts connections) and a node of pool-a dies right after. Envoy's HTTP/2 keepalive on
    the xDS cluster finds the stream dead, it redials (its xDS backoff) onto the other replica,
    and the dead node is out of Envoy's pool-a within the bound (docs/replicas.md: Running two replicas)."""
    await wait_for(lambda: split.all_routed(http), timeout_s=30.0, what=split.routed_why)
    # the other replica holds what Envoy holds (every node routed at full weight), so what it
    # sends after the move is the freeze's doing alone
    await wait_for(lambda: split.same_version(http), timeout_s=15.0)
    a1, a2 = split.cps[0], split.cps[1]
    holding = [cp for cp in (a1, a2) if await split.connected(http, cp, acked=False)]
    assert len(holding) == 1, [cp.replica for cp in holding]
    victim, survivor = holding[0], (a2 if holding[0] is a1 else a1)
    node = split.node("gpu-a1")
    t0 = time.monotonic()
    victim.proc.freeze()
    try:
        node.engine.freeze()
        node.agent.freeze()
        try:
            moved = await wait_for(lambda: split.connected(http, survivor, acked=False), timeout_s=45.0, step_s=0.05)
            t_moved = time.monotonic() - t0
            assert moved

            async def excluded() -> bool:
                return (await split.hosts(http, "pool-a")).get("gpu-a1") != "HEALTHY"

            await wait_for(excluded, timeout_s=45.0, step_s=0.05)
            t_out = time.monotonic() - t0
        finally:
            node.agent.thaw()
            node.engine.thaw()
    finally:
        victim.proc.thaw()
    print(f"\n{split.variant}: froze {victim.replica} and gpu-a1; Envoy on {survivor.replica} after "
          f"{t_moved:.2f} s, gpu-a1 out of Envoy's pool-a after {t_out:.2f} s")
    # keepalive 1 s + 1 s timeout, then a redial within the 1 s backoff cap (envoy.yaml)
    assert t_moved <= 4.5, t_moved
    assert t_out <= 6.0, t_out
    # both replicas serve again: the thawed one resumes its agents' streams, Envoy all routed
    await wait_for(lambda: split.all_routed(http), timeout_s=20.0, what=split.routed_why)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
async def test_kill_9_or_sigterm_of_the_connected_replica_under_load_changes_nothing_in_envoy(split, http, sig):
    """SIGKILL: the replica dies; SIGTERM: a rolling restart (it closes its streams and exits)."""
    a1, a2 = split.cps[0], split.cps[1]
    for cp in (a1, a2):
        if not cp.proc.alive():  # the one an earlier test killed
            split.restart(cp)
    await wait_for(lambda: split.all_routed(http), timeout_s=30.0, what=split.routed_why)
    same_version = functools.partial(split.same_version, http)
    # both replicas, fed by the same agents, publish the same version for the same state
    await wait_for(same_version, timeout_s=10.0)
    if split.variant == EDS_SOTW:  # where gpu-b1 runs: the reference with one watcher
        # two replicas watching gpu-a1/a2 do not double their probes: the agent fans one probe out
        p0, t0 = await split.probes_at_engines(http), time.monotonic()
        await asyncio.sleep(2.5)
        p1, dt = await split.probes_at_engines(http), time.monotonic() - t0
        rates = {n: (p1[n] - p0[n]) / dt for n in p0}
        assert rates["gpu-b1"] > 0.5, rates  # one watcher: the idle cadence (0.5 s +- 25 %)
        assert max(rates["gpu-a1"], rates["gpu-a2"]) <= rates["gpu-b1"] * 1.5 + 0.5, rates

    holding = [cp for cp in (a1, a2) if await split.connected(http, cp, acked=False)]
    assert len(holding) == 1, [cp.replica for cp in holding]  # Envoy's one EDS (or ADS) stream for pool-a
    victim, survivor = holding[0], (a2 if holding[0] is a1 else a1)
    await wait_for(lambda: split.connected(http, victim), timeout_s=10.0, what="pool-a pushes ACKed")
    version = await wait_for(same_version, timeout_s=10.0)  # the state Envoy holds, on both
    # the replicas' counts first, Envoy's second (and the reverse at the end): a version published
    # between the two reads is counted without its update being seen
    encoded_before = {cp.replica: await split.encoded(http, cp) for cp in (victim, survivor)}
    before = await split.envoy_stats(http, "pool-a")
    load_a = LoadGenerator(split.url, concurrency=3)
    published: list[str] = []  # the survivor's versions from the kill on, as polled
    await load_a.start()
    try:
        load_a.phase("before")
        await asyncio.sleep(0.5)
        load_a.phase(sig.name)
        victim_encoded = await split.encoded(http, victim) - encoded_before[victim.replica]
        t0 = time.monotonic()
        os.killpg(victim.proc.pid, sig)

        async def reconnected() -> bool:
            published.append(await split.cla_version(http, survivor, "pool-a"))
            return await split.connected(http, survivor)

        await wait_for(reconnected, timeout_s=15.0)
        moved_s = time.monotonic() - t0
        load_a.phase("on the survivor")
        await asyncio.sleep(0.5)
        published.append(await split.cla_version(http, survivor, "pool-a"))
    finally:
        await load_a.stop()
        victim.proc.stop()
    after = await split.envoy_stats(http, "pool-a")
    total = load_a.totals()
    # versions either replica published while Envoy could take them: the victim's up to the kill
    # and the survivor's from `before` on, counted by their caches (polling the survivor's
    # version alone misses one replaced within a poll)
    changes = victim_encoded + await split.encoded(http, survivor) - encoded_before[survivor.replica]
    print(f"\n{split.variant}: {sig.name} to {victim.replica}, Envoy on {survivor.replica} (ACKed) after "
          f"{moved_s:.2f} s; requests ok {total.ok} failed "
          f"{dict(total.failures)}; survivor's versions {version} -> {sorted(set(published))} (polled); "
          f"versions published: {victim_encoded} by the victim, {changes - victim_encoded} by the survivor; "
          f"Envoy pool-a stats before {before} after {after}")
    assert total.failed == 0 and total.ok > 20, dict(total.failures)
    assert load_a.phases["on the survivor"].ok > 5
    # no cluster was added, modified or removed (with CDS: the survivor's clusters are the same
    # resources, so Envoy warmed no cluster and its CDS version did not move)
    for k in ("cluster_manager.cluster_added", "cluster_manager.cluster_modified",
              "cluster_manager.cluster_removed", "cluster_manager.cds.version"):
        assert after.get(k) == before.get(k), k
    updates = after["update_success"] - before["update_success"]
    rebuilt = updates - (after["update_no_rebuild"] - before["update_no_rebuild"])
    if changes == 0:
        assert set(published) == {version}
        # the survivor held the dead one's version, and Envoy took nothing new from it: the
        # reconnect's resend is at most one update, and it rebuilt nothing
        assert after["version"] == before["version"]
        assert after["membership_change"] == before["membership_change"]
        assert updates <= 1 and rebuilt == 0
        if split.variant == ADS_DELTA:
            # delta: the reconnected stream's initial_resource_versions matched the survivor's,
            # so it sent nothing, for the endpoints as for the clusters
            assert updates == 0
            assert after["cluster_manager.cds.update_success"] == before["cluster_manager.cds.update_success"]
    else:
        # the nodes' state changed meanwhile (a loaded machine): Envoy rebuilt at most once per
        # version a replica published, never for the failover itself
        assert rebuilt <= changes and updates <= changes + 1
    assert await split.hosts(http, "pool-a") == {"gpu-a1": "HEALTHY", "gpu-a2": "HEALTHY"}
