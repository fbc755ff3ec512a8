"""Versioned snapshot cache: resources encoded once per change and shared by every ADS stream.

Each resource is serialized once (deterministically) into its ``Any`` when it changes; its
version is a content hash, so identical state after a restart yields identical versions and
Envoy sees no churn. Streams wait on :meth:`SnapshotCache.wait_for_change`; they never build or
encode resources themselves (the ADS send loop stays cheap).

This module knows nothing about probes or health; it stores what it is given.
"""
from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from google.protobuf import any_pb2
from google.protobuf.message import Message

__all__ = ["CachedResource", "SnapshotCache", "version_of"]


@dataclass(frozen=True, slots=True)
class CachedResource:
    """One encoded resource: ``name``, content-hash ``version`` and the packed ``Any``."""

    name: str
    version: str
    any: any_pb2.Any


def version_of(parts: Iterable[tuple[str, str]], prefix: str) -> str:
    """A type- or response-level version: ``prefix`` + hash over sorted (name, version) pairs."""
    h = hashlib.sha256()
    for name, ver in sorted(parts):
        h.update(name.encode())
        h.update(b"\0")
        h.update(ver.encode())
        h.update(b"\n")
    return f"{prefix}-{h.hexdigest()[:16]}"


class SnapshotCache:
    """Holds, per type_url, the current resources by name.

    ``server_id`` prefixes every version so two control-plane replicas never produce colliding
    versions for different content. Thread-unsafe: use from one asyncio loop.
    """

    def __init__(self, server_id: str) -> None:
        self.server_id = server_id
        self._resources: dict[str, dict[str, CachedResource]] = {}
        self._type_version: dict[str, str] = {}
        self._generation = 0
        self._changed = asyncio.Event()
        self.encode_count = 0  # resources encoded so far (for tests and metrics)

    @property
    def generation(self) -> int:
        """Increments on every content change of any type."""
        return self._generation

    def set_resource(self, type_url: str, name: str, message: Message) -> bool:
        """Insert or replace one resource. Returns True when its content changed."""
        data = message.SerializeToString(deterministic=True)
        ver = hashlib.sha256(data).hexdigest()[:16]
        cur = self._resources.setdefault(type_url, {})
        old = cur.get(name)
        if old is not None and old.version == ver:
            return False
        packed = any_pb2.Any(type_url=type_url, value=data)
        self.encode_count += 1
        cur[name] = CachedResource(name, ver, packed)
        self._bump(type_url)
        return True

    def set_resources(self, type_url: str, messages: Mapping[str, Message]) -> bool:
        """Replace the whole set of a type (names not given are removed). True when anything changed."""
        changed = False
        cur = self._resources.setdefault(type_url, {})
        for name in list(cur):
            if name not in messages:
                del cur[name]
                changed = True
        for name, msg in messages.items():
            data = msg.SerializeToString(deterministic=True)
            ver = hashlib.sha256(data).hexdigest()[:16]
            old = cur.get(name)
            if old is not None and old.version == ver:
                continue
            self.encode_count += 1
            cur[name] = CachedResource(name, ver, any_pb2.Any(type_url=type_url, value=data))
            changed = True
        if changed:
            self._bump(type_url)
        return changed

    def remove_resource(self, type_url: str, name: str) -> bool:
        """Remove one resource. Returns True if it existed."""
        cur = self._resources.get(type_url, {})
        if cur.pop(name, None) is None:
            return False
        self._bump(type_url)
        return True

    def _bump(self, type_url: str) -> None:
        res = self._resources.get(type_url, {})
        self._type_version[type_url] = version_of(
            ((r.name, r.version) for r in res.values()), self.server_id
        )
        self._generation += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def resources(self, type_url: str) -> Mapping[str, CachedResource]:
        """Current resources of a type by name (read-only view; do not mutate)."""
        return self._resources.get(type_url, {})

    def type_version(self, type_url: str) -> str:
        """Version of the whole set of a type ("" when never set)."""
        return self._type_version.get(type_url, "")

    def changed_event(self) -> asyncio.Event:
        """An event set at the next content change (a new event is handed out after each change)."""
        return self._changed
