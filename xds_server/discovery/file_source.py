"""A cluster's targets file, re-read when it changes (the I/O around :mod:`.targets`).

Every ``interval_s`` the file is read and hashed (sha256); a content whose hash differs from the
last one read is parsed. The hash decides, not the mtime: a rewrite of the same size within one
filesystem timestamp tick keeps the mtime, and reading a small file once a second is cheap. A
good file replaces ``nodes`` and calls ``on_change``; a bad one (unreadable, invalid:
:class:`~xds_server.discovery.targets.TargetsError`) keeps the last good ``nodes``, logs the
error once per distinct content and counts it in ``errors``.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable

from xds_server.config import FileDiscoveryConfig, NodeConfig
from xds_server.discovery.targets import TargetsError, parse_targets

__all__ = ["FileTargets"]

log = logging.getLogger("xds_server.discovery")


class FileTargets:
    """Nodes of one cluster from a targets file. ``nodes`` (last good, ``()`` before any),
    ``error`` (the last read's error, None when it was good), ``errors`` / ``loads`` (counts of
    rejected / accepted contents)."""

    kind = "file"

    def __init__(self, cluster: str, spec: FileDiscoveryConfig, on_change: Callable[[], None]) -> None:
        self.cluster, self.spec, self.on_change = cluster, spec, on_change
        self.nodes: tuple[NodeConfig, ...] = ()
        self.error: str | None = None
        self.errors = 0
        self.loads = 0
        self._seen: str | None = None  # sha256 of the last content read ("" when unreadable)

    def check(self) -> bool:
        """Read the file if it changed; True when ``nodes`` changed (``on_change`` not called)."""
        try:
            with open(self.spec.path, "rb") as f:
                data = f.read()
        except OSError as e:
            return self._reject("", f"targets file {self.spec.path}: cannot read: {e.strerror or e}")
        sig = hashlib.sha256(data).hexdigest()
        if sig == self._seen:
            return False
        try:
            nodes = parse_targets(data.decode("utf-8"), self.spec.path)
        except UnicodeDecodeError as e:
            return self._reject(sig, f"targets file {self.spec.path}: not UTF-8 ({e.reason} at byte {e.start})")
        except TargetsError as e:
            return self._reject(sig, str(e))
        self._seen, self.error = sig, None
        self.loads += 1
        if nodes == self.nodes:
            return False
        log.info("cluster %s: targets file %s lists %d node(s)", self.cluster, self.spec.path, len(nodes))
        self.nodes = nodes
        return True

    def _reject(self, sig: str, error: str) -> bool:
        if sig != self._seen or error != self.error:
            self.errors += 1
            log.error("cluster %s: %s; keeping the last good %d node(s)", self.cluster, error, len(self.nodes))
        self._seen, self.error = sig, error
        return False

    def start(self) -> asyncio.Task:
        return asyncio.create_task(self._run(), name=f"discovery file {self.cluster}")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.spec.interval.s)
            if self.check():
                self.on_change()

    def status(self) -> dict:
        return {"source": "file", "path": self.spec.path, "nodes": [n.id for n in self.nodes],
                "error": self.error, "errors": self.errors, "loads": self.loads}
