"""The discovery sources of every cluster, following the config (the I/O edge the server holds).

Shape::

    d = Discovery(on_change=apply)          # apply(): awaited with the node sets changed
    serving = d.configure(static_cfg)       # sources follow clusters[].discovery; files read now
    await d.start()                         # watch loops run; changes call apply(), coalesced
    serving = d.merged()                    # the last static config + every source's nodes
    await d.stop()

``configure`` keeps a source whose spec did not change (its nodes and watch go on), stops the
ones dropped or changed and creates the new ones. Changes are coalesced: a burst of events (a
relist, a scale-up) costs one ``apply``.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from xds_server.config import FileDiscoveryConfig, KubernetesDiscoveryConfig, NodeConfig, SentinelConfig
from xds_server.discovery.agent_registry import AgentRegistry
from xds_server.discovery.file_source import FileTargets
from xds_server.discovery.kube_source import KubernetesPods
from xds_server.discovery.nodeset import merge_discovered

__all__ = ["Discovery"]

log = logging.getLogger("xds_server.discovery")

Source = FileTargets | KubernetesPods


class Discovery:
    """Sources by (cluster name, kind); ``problems`` of the last merge (nodes left out)."""

    def __init__(self, on_change: Callable[[], Awaitable[object]]) -> None:
        self.on_change = on_change
        self.agents = AgentRegistry(self._changed)  # nodes that registered themselves (dial-in)
        self.static: SentinelConfig | None = None
        self.sources: dict[tuple[str, str], Source] = {}
        self.problems: tuple[str, ...] = ()
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}
        self._running = False
        self._pending: asyncio.Task | None = None
        self._dirty = False

    def configure(self, static: SentinelConfig) -> SentinelConfig:
        """Follow ``static``'s ``clusters[].discovery``; returns :meth:`merged`. Targets files are
        read now, so a start or reload serves their nodes at once."""
        self.static = static
        want: dict[tuple[str, str], FileDiscoveryConfig | KubernetesDiscoveryConfig] = {}
        for c in static.clusters:
            if c.discovery is not None:
                if c.discovery.file is not None:
                    want[(c.name, "file")] = c.discovery.file
                if c.discovery.kubernetes is not None:
                    want[(c.name, "kubernetes")] = c.discovery.kubernetes
        for key in [k for k, s in self.sources.items() if want.get(k) != s.spec]:
            del self.sources[key]
            task = self._tasks.pop(key, None)
            if task is not None:
                task.cancel()
        for key, spec in want.items():
            if key not in self.sources:
                src: Source = (FileTargets(key[0], spec, self._changed) if isinstance(spec, FileDiscoveryConfig)
                               else KubernetesPods(key[0], spec, self._changed))
                self.sources[key] = src
                src.check()
                if self._running:
                    self._tasks[key] = src.start()
        return self.merged()

    def found(self) -> dict[str, list[NodeConfig]]:
        """Cluster name -> discovered nodes (file first, then Kubernetes)."""
        out: dict[str, list[NodeConfig]] = {}
        for (cluster, _), src in sorted(self.sources.items()):
            out.setdefault(cluster, []).extend(src.nodes)
        taking = self._forget_after_s()
        for cluster, nodes in self.agents.found().items():
            if cluster in taking:
                out.setdefault(cluster, []).extend(nodes)
        return out

    def _forget_after_s(self) -> dict[str, float]:
        """Clusters that take registrations -> their ``discovery.agents.forget_after`` (s)."""
        if self.static is None:
            return {}
        return {c.name: c.discovery.agents.forget_after.s for c in self.static.clusters
                if c.discovery is not None and c.discovery.agents is not None}

    async def _expire_registered(self) -> None:
        """Every second: drop registered nodes whose agents stayed away (``forget_after``)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(1.0)
            gone = self.agents.expire(loop.time(), self._forget_after_s())
            if gone:
                log.info("discovery: dropped %d registered node(s) whose agents stayed away: %s",
                         len(gone), ", ".join(gone))

    def merged(self) -> SentinelConfig:
        """The last static config with every source's nodes (see
        :func:`~xds_server.discovery.nodeset.merge_discovered`); new problems are logged."""
        assert self.static is not None, "configure() first"
        cfg, problems = merge_discovered(self.static, self.found())
        for p in problems:
            if p not in self.problems:
                log.error("discovery: %s", p)
        self.problems = problems
        return cfg

    async def start(self) -> None:
        self._running = True
        if ("", "agents") not in self._tasks:
            self._tasks[("", "agents")] = asyncio.get_running_loop().create_task(self._expire_registered())
        for key, src in self.sources.items():
            if key not in self._tasks:
                self._tasks[key] = src.start()

    async def stop(self) -> None:
        self._running = False
        tasks = [*self._tasks.values(), *([self._pending] if self._pending else [])]
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _changed(self) -> None:
        """A source's nodes changed: one ``on_change`` for the burst (run on the next loop turn)."""
        self._dirty = True
        if self._running and (self._pending is None or self._pending.done()):
            self._pending = asyncio.get_running_loop().create_task(self._apply())

    async def _apply(self) -> None:
        await asyncio.sleep(0)  # let the rest of a burst arrive
        while self._dirty:  # a change during on_change() is applied by one more round
            self._dirty = False
            try:
                await self.on_change()
            except Exception:  # a failed apply must not end discovery
                log.exception("applying discovered nodes failed")

    def status(self) -> dict:
        """JSON-able: per cluster, each source's status, and the merge problems."""
        out: dict = {"problems": list(self.problems), "clusters": {}}
        for (cluster, _), src in sorted(self.sources.items()):
            out["clusters"].setdefault(cluster, []).append(src.status())
        for cluster in self._forget_after_s():
            out["clusters"].setdefault(cluster, []).append(self.agents.status(cluster))
        return out
