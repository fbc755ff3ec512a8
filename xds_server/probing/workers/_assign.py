"""Which probe worker owns a node: a stable hash of its id, the same in every process and run.

Shape::

    worker_for("gpu-a", 2) -> 0 or 1

``zlib.crc32`` of the UTF-8 id, modulo the worker count: Python's ``hash()`` is salted per
process, so it cannot be shared between the main process and a restarted worker.
"""
from __future__ import annotations

import zlib

__all__ = ["worker_for"]


def worker_for(node_id: str, workers: int) -> int:
    """Index 0..workers-1 of the worker that owns ``node_id``. ValueError when ``workers`` < 1."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return zlib.crc32(node_id.encode("utf-8", "surrogatepass")) % workers
