"""A memo bounded by entry count and by bytes, least recently used out first.

The cache keeps data derived from a type's content here (encoded response bodies, versions of
subscription sets), so that many streams asking for the same thing compute it once. Keys and
values can come from clients (a subscription of 20,000 names), so both bounds are enforced: a
closed stream's leftovers can never hold more than ``max_bytes``.

Shape::

    memo = BoundedMemo(max_entries=1024, max_bytes=8 << 20)
    memo.get(key)                  # -> value or None (marks it recently used)
    memo.put(key, value, nbytes)   # False (not stored) when nbytes alone exceeds max_bytes // 4
    memo.clear()
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["BoundedMemo", "size_of_names"]

NAME_OVERHEAD_BYTES = 64
"""Approximate bytes a name costs in a Python set or tuple besides its characters (str header
~49 B + slot): a size estimate, not an exact count."""

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


def size_of_names(names: Iterable[str]) -> int:
    """Approximate memory of a collection of names, bytes (characters + per-name overhead)."""
    return sum(len(n) + NAME_OVERHEAD_BYTES for n in names)


class BoundedMemo(Generic[_K, _V]):
    """LRU memo bounded by ``max_entries`` (>= 1) and ``max_bytes`` (>= 1, as estimated by the
    caller for each entry). One entry larger than ``max_bytes // 4`` is not stored, so a single
    huge value cannot evict everything else. Raises ValueError for bounds < 1."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"bounds must be >= 1, got {max_entries} entries, {max_bytes} bytes")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[_K, tuple[_V, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: _K) -> _V | None:
        """The value stored for ``key`` (now most recently used), or None."""
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: _K, value: _V, nbytes: int) -> bool:
        """Store ``value`` (``nbytes``: its size with its key), evicting the least recently used
        entries beyond the bounds. Returns False, storing nothing, when ``nbytes`` is over a
        quarter of ``max_bytes``."""
        if nbytes > self.max_bytes // 4:
            return False
        old = self._items.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        self._items[key] = (value, nbytes)
        self.nbytes += nbytes
        while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
            _, (_, n) = self._items.popitem(last=False)
            self.nbytes -= n
        return True

    def clear(self) -> None:
        """Forget everything."""
        self._items.clear()
        self.nbytes = 0
