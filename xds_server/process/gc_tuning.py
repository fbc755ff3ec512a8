"""The garbage collector's thresholds for a long-running control-plane process.

CPython's defaults (700, 10, 10) run a young collection every 700 net allocations of tracked
objects. A control plane replaces a node's health record at each heartbeat and keeps each one for
about a second, so records outlive several young collections and are promoted; after every
~25 % of the live objects' count in promotions, a full collection walks all of them with the event
loop stopped. Measured with 2,000 dial-in nodes (~500,000 tracked objects; benchmarks/RESULTS.md,
"Agents dial in"): 3 full collections a minute of ~430 ms each (max 476 ms), 0.06 cores in all,
and frozen hosts detected after p99 232 ms. With :data:`THRESHOLDS` the same minute ran 3 young
collections (max 88 ms) and no full one: p99 184 ms, 3 % less CPU. Garbage without cycles is
freed at once by reference counting either way; only cycles wait longer (memory bounded by the
young threshold's allocations).

Applied by ``xds-server serve`` and every probe worker (:func:`tune`), not on import, so tests
and embedders keep their own settings.
"""
from __future__ import annotations

import gc

__all__ = ["THRESHOLDS", "tune"]

THRESHOLDS: tuple[int, int, int] = (50_000, 20, 10)
"""(young, middle, old) as :func:`gc.set_threshold` takes them: a young collection every 50,000
net allocations, a middle one every 20 young, a full one every 10 middle (and then only when the
promotions since the last reach 25 % of the long-lived objects, CPython's own rule). Ours, measured
above."""


def tune() -> tuple[int, int, int]:
    """Set :data:`THRESHOLDS` for this process; returns the thresholds it had."""
    before = gc.get_threshold()
    gc.set_threshold(*THRESHOLDS)
    return before
