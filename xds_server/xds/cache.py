"""Versioned snapshot cache: resources encoded once per change and shared by every ADS stream.

Each resource is validated and serialized once (deterministically) into its ``Any`` when it
changes; its version is a hash of its encoded content and nothing else (no replica id, no
counter), so identical state yields identical versions after a restart and on every replica: an
Envoy failing over between two replicas that hold the same state sees no change (checklist 1.9
item 13). Different content shares a version only by a 64-bit SHA-256 prefix collision.
Streams register a wake-up callback with
:meth:`SnapshotCache.watch`; they never build or encode resources themselves, so a push to 1,000
streams costs one encode plus 1,000 small envelopes.

Coalescing happens one step earlier, where resources are built: the control plane marks a
cluster dirty on every health change and builds and stores its assignment at most once per
``xds.publish.coalesce_window`` (server.py): an isolated change at once, a burst within the window
after a publish as one encode and one push.

Data derived from a type's content (encoded response bodies, versions of subscription sets) is
memoized per type in :class:`~xds_server.xds.memo.BoundedMemo` s, emptied when the type changes
and bounded by count and bytes (``xds.limits.memo_max_entries``, ``xds.limits.memo_max_bytes`` each), so what
closed streams asked for cannot pile up.

:meth:`SnapshotCache.consistent` is the named consistency check (go-control-plane's
``Consistent()``): every assignment belongs to a cluster that refers to it, and, when asked for
completeness, every EDS cluster has its assignment.

This module knows nothing about probes or health; it stores what it is given.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf import any_pb2
from google.protobuf.message import Message

from xds_server.config import XdsConfig
from xds_server.xds.memo import BoundedMemo, size_of_names
from xds_server.xds.resources import CLA_TYPE_URL, RESOURCE_TYPES, carry_drop_change, type_label

__all__ = ["EMPTY_VERSION", "CachedResource", "InvalidResource", "SnapshotCache", "Validator", "content_version",
           "version_of"]

EMPTY_VERSION = "empty"
"""The version of a type or response with no resources (the same on every replica)."""

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")

Validator = Callable[[str, Message], list[str]]
"""``validate(name, message) -> problems``; an empty list means valid."""


class InvalidResource(ValueError):
    """A resource failed validation; nothing was changed. ``problems`` lists the reasons."""

    def __init__(self, type_url: str, name: str, problems: list[str]) -> None:
        self.type_url = type_url
        self.name = name
        self.problems = problems
        super().__init__(f"{type_label(type_url)} {name!r} rejected: " + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class CachedResource:
    """One encoded resource: ``name``, ``version`` (16 hex: :func:`content_version`) and the packed ``Any``."""

    name: str
    version: str
    any: any_pb2.Any


def content_version(data: bytes) -> str:
    """A resource's version: the first 16 hex digits of SHA-256 over its deterministic encoding."""
    return hashlib.sha256(data).hexdigest()[:16]


def version_of(parts: Iterable[tuple[str, str]]) -> str:
    """A type- or response-level version: 16 hex digits of SHA-256 over the sorted (name, version)
    pairs; :data:`EMPTY_VERSION` for none. Depends on content only, never on order or replica."""
    h = hashlib.sha256()
    n = 0
    for name, ver in sorted(parts):
        h.update(name.encode())
        h.update(b"\0")
        h.update(ver.encode())
        h.update(b"\n")
        n += 1
    return h.hexdigest()[:16] if n else EMPTY_VERSION


class SnapshotCache:
    """Holds, per type_url, the current resources by name.

    Versions come from content only (:func:`content_version`). ``validators`` maps type_url ->
    :data:`Validator`; a
    resource that fails is never stored (:class:`InvalidResource` is raised and the previous
    content stays: bad content is held back, not pushed to every Envoy to be NACKed).
    Thread-unsafe: use from one asyncio loop.

    Counters for metrics and benchmarks: ``encode_count`` (resources encoded), ``encode_s``
    (seconds spent validating, serializing and hashing), ``rejected_count``.
    ``memo_max_entries`` / ``memo_max_bytes`` bound each memo (defaults: ``XdsConfig``).
    """

    def __init__(self, validators: Mapping[str, Validator] | None = None, *,
                 memo_max_entries: int | None = None, memo_max_bytes: int | None = None) -> None:
        defaults = XdsConfig()
        self.validators: dict[str, Validator] = dict(validators or {})
        self.memo_max_entries = memo_max_entries or defaults.limits.memo_max_entries
        self.memo_max_bytes = memo_max_bytes or defaults.limits.memo_max_bytes
        self._resources: dict[str, dict[str, CachedResource]] = {}
        self._type_version: dict[str, str] = {}
        self._type_generation: dict[str, int] = {}
        self._subset_versions: dict[str, BoundedMemo[frozenset[str], str]] = {}
        self._memos: dict[str, BoundedMemo[Hashable, bytes]] = {}
        self._generation = 0  # increments on every content change of any type
        self._watchers: dict[int, Callable[[], None]] = {}
        self._watch_ids = 0
        self.encode_count = 0
        self.encode_s = 0.0
        self.rejected_count = 0

    def _encode(self, type_url: str, name: str, message: Message) -> tuple[str, bytes]:
        t0 = time.perf_counter()
        validate = self.validators.get(type_url)
        if validate is not None:
            problems = validate(name, message)
            if problems:
                self.rejected_count += 1
                self.encode_s += time.perf_counter() - t0
                raise InvalidResource(type_url, name, problems)
        data = message.SerializeToString(deterministic=True)
        ver = content_version(data)
        self.encode_s += time.perf_counter() - t0
        return ver, data

    def set_resource(self, type_url: str, name: str, message: Message) -> bool:
        """Insert or replace one resource. Returns True when its content changed.

        Raises InvalidResource (and changes nothing) when the type's validator rejects it.
        """
        ver, data = self._encode(type_url, name, message)
        cur = self._resources.setdefault(type_url, {})
        old = cur.get(name)
        if old is not None and old.version == ver:
            return False
        self.encode_count += 1
        cur[name] = CachedResource(name, ver, any_pb2.Any(type_url=type_url, value=data))
        self._bump(type_url)
        return True

    def set_resources(self, type_url: str, messages: Mapping[str, Message]) -> bool:
        """Replace the whole set of a type (names not given are removed). True when anything changed.

        All-or-nothing: if any resource is invalid, InvalidResource is raised and nothing changes.
        """
        encoded = {name: self._encode(type_url, name, msg) for name, msg in messages.items()}
        changed = False
        cur = self._resources.setdefault(type_url, {})
        for name in list(cur):
            if name not in messages:
                del cur[name]
                changed = True
        for name, (ver, data) in encoded.items():
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
        self._type_version[type_url] = version_of((r.name, r.version) for r in res.values())
        self._generation += 1
        self._type_generation[type_url] = self._generation
        self._subset_versions.pop(type_url, None)
        self._memos.pop(type_url, None)
        for cb in list(self._watchers.values()):
            cb()

    def resources(self, type_url: str) -> Mapping[str, CachedResource]:
        """Current resources of a type by name (read-only view; do not mutate)."""
        return self._resources.get(type_url, {})

    def absent(self, type_url: str, name: str) -> CachedResource | None:
        """The stand-in a SotW stream sends for a requested ``name`` that exists neither in
        ``type_url`` nor in its parent type (``ResourceType.absent``; EDS: an empty assignment),
        encoded like any resource (same version scheme); None when the type has no stand-in or
        the name is pending (its parent exists). Not stored: it costs one small encode."""
        rtype = RESOURCE_TYPES.get(type_url)
        if rtype is None or rtype.absent is None or name in self.resources(type_url):
            return None
        if rtype.parent_type_url and name in self.resources(rtype.parent_type_url):
            return None
        data = rtype.absent(name).SerializeToString(deterministic=True)
        return CachedResource(name, content_version(data), any_pb2.Any(type_url=type_url, value=data))

    def type_version(self, type_url: str) -> str:
        """Version of the whole set of a type ("" when never set)."""
        return self._type_version.get(type_url, "")

    def type_generation(self, type_url: str) -> int:
        """A counter value taken at this type's last change, increasing over all types (0: never
        set). Streams compare it to skip types that did not change since they last looked."""
        return self._type_generation.get(type_url, 0)

    def subset_version(self, type_url: str, names: frozenset[str]) -> str:
        """Version of the resources of ``names`` that exist (:func:`version_of`), memoized
        until the type changes (bounded: :class:`BoundedMemo`), so 1,000 streams asking for the
        same set hash it once. A set too large for the memo is hashed each time: it costs no
        more than the request that named it."""
        memo = self._subset_versions.get(type_url)
        if memo is None:
            memo = self._subset_versions[type_url] = self._new_memo()
        ver = memo.get(names)
        if ver is None:
            res = self._resources.get(type_url, {})
            small, large = (names, res) if len(names) <= len(res) else (res.keys(), names)
            ver = version_of((n, res[n].version) for n in small if n in large)
            memo.put(names, ver, size_of_names(names) + 128)
        return ver

    def memo(self, type_url: str) -> BoundedMemo[Hashable, bytes]:
        """A bounded scratch memo for data derived from this type's current content (the ADS
        layer keeps encoded response bodies there); emptied whenever the type changes."""
        memo = self._memos.get(type_url)
        if memo is None:
            memo = self._memos[type_url] = self._new_memo()
        return memo

    def _new_memo(self) -> BoundedMemo[_K, _V]:
        return BoundedMemo(self.memo_max_entries, self.memo_max_bytes)

    def memo_bytes(self) -> int:
        """Bytes (estimated) held by every memo of the cache."""
        return (sum(m.nbytes for m in self._memos.values())
                + sum(m.nbytes for m in self._subset_versions.values()))

    def consistent(self, *, complete: bool = False) -> list[str]:
        """Problems with how the types fit together, as readable strings ([] = consistent):
        a resource of a type with a parent type (an assignment) that no parent resource refers to
        (an assignment without its EDS cluster), and with ``complete`` a referenced resource that
        does not exist (an EDS cluster without its assignment: normal while the warm-up gate holds
        it, so only a finished snapshot is checked with ``complete=True``)."""
        problems: list[str] = []
        referenced: dict[str, set[str]] = {}
        for tu, rtype in RESOURCE_TYPES.items():
            if rtype.references is None:
                continue
            for r in self._resources.get(tu, {}).values():
                for child_tu, child in rtype.references(r.any.value):
                    referenced.setdefault(child_tu, set()).add(child)
                    if complete and child not in self._resources.get(child_tu, {}):
                        problems.append(f"{rtype.short_name} {r.name!r} refers to "
                                        f"{RESOURCE_TYPES[child_tu].short_name} {child!r}, which does not exist")
        for tu, rtype in RESOURCE_TYPES.items():
            if rtype.parent_type_url is None:
                continue
            refs = referenced.get(tu, set())
            parent = RESOURCE_TYPES[rtype.parent_type_url].short_name
            for name in sorted(self._resources.get(tu, {})):
                if name not in refs:
                    problems.append(f"{rtype.short_name} {name!r} is not referred to by any {parent}")
        return problems

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` synchronously after every content change; returns the function
        that stops it. Callbacks must be cheap and must not raise (an ADS stream sets its
        wake-up event)."""
        self._watch_ids += 1
        wid = self._watch_ids
        self._watchers[wid] = callback

        def cancel() -> None:
            self._watchers.pop(wid, None)

        return cancel

    @property
    def watcher_count(self) -> int:
        """Callbacks registered with :meth:`watch` (one per open ADS stream)."""
        return len(self._watchers)


def set_cla(cache: SnapshotCache, name: str, cla: Message) -> bool:
    """Put ``cla`` in ``cache`` under ``name`` through :func:`carry_drop_change` against the one
    published before, so a drop change alone is applied. True when the cache changed;
    InvalidResource as :meth:`SnapshotCache.set_resource`."""
    prev = cache.resources(CLA_TYPE_URL).get(name)
    return cache.set_resource(CLA_TYPE_URL, name, carry_drop_change(prev.any if prev else None, cla))
