"""Prompts sampled from live traffic for switch-back validation (``health.validation.live_prompts``).

:class:`LivePromptPool` keeps what relays submit (``RoutingFeed/SubmitPrompts``,
:mod:`xds_server.feed.service`): one ring of at most ``max_prompts`` per cluster, and one shared
ring (cluster ``""``) for prompts whose cluster the relay could not tell; the oldest is replaced
first, and a prompt already held moves to the newest place instead of being held twice. Memory
only: never logged, never written to the state file; admin and metrics see counts
(:meth:`LivePromptPool.counts`).

:func:`draw_prompts` (pure) picks one validation's prompts: ``round(share x sample)`` from the
live pool when it holds at least that many, the rest from the configured pool (the prompts file
or the built-in set).
"""
from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Container, Sequence

from xds_server.config.validation import LivePromptsConfig

__all__ = ["MAX_PROMPTS_PER_CALL", "REFUSALS", "SHARED", "LivePromptPool", "draw_prompts"]

#: The shared pool's key: prompts submitted without a cluster.
SHARED = ""
#: Most prompts one SubmitPrompts call may carry (routing.proto); the rest are refused.
MAX_PROMPTS_PER_CALL = 64
#: Why a submitted prompt is refused (metric label values, besides "accepted").
REFUSALS = ("off", "denied", "over_call_limit", "empty", "too_long", "invalid_utf8", "unknown_cluster")


class LivePromptPool:
    """Bounded rings of live prompts by cluster (see the module docstring)."""

    def __init__(self) -> None:
        self._rings: dict[str, deque[str]] = {}

    def offer(self, cluster: str, prompt: str, cfg: LivePromptsConfig, known: Container[str]) -> str | None:
        """Keep ``prompt`` for ``cluster`` ("" = the shared pool); None when kept, else why not
        (one of :data:`REFUSALS`): empty or blank, longer than ``cfg.max_chars`` characters, not
        encodable as UTF-8 (a lone surrogate), or a cluster not in ``known``."""
        if not prompt or prompt.isspace():
            return "empty"
        if len(prompt) > cfg.max_chars:
            return "too_long"
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            return "invalid_utf8"
        if cluster != SHARED and cluster not in known:
            return "unknown_cluster"
        ring = self._rings.get(cluster)
        if ring is None or ring.maxlen != cfg.max_prompts:  # new, or max_prompts reloaded
            ring = self._rings[cluster] = deque(ring or (), maxlen=cfg.max_prompts)
        try:
            ring.remove(prompt)  # held already: now the newest, not twice
        except ValueError:
            pass
        ring.append(prompt)
        return None

    def prompts(self, cluster: str) -> list[str]:
        """The live prompts a validation in ``cluster`` may draw: its own, then the shared pool's
        (each once)."""
        own = self._rings.get(cluster, ())
        return list(dict.fromkeys([*own, *self._rings.get(SHARED, ())]))

    def counts(self) -> dict[str, int]:
        """Prompts held per cluster ("" = the shared pool); never the text."""
        return {c: len(r) for c, r in sorted(self._rings.items())}

    def forget(self, known: Container[str]) -> None:
        """Drop the rings of clusters no longer served (after a reload)."""
        for c in [c for c in self._rings if c != SHARED and c not in known]:
            del self._rings[c]


def draw_prompts(pool: Sequence[str], live: Sequence[str], sample: int, share: float,
                 rng: random.Random) -> tuple[list[str], int]:
    """One validation's prompts and how many of them are live.

    ``k = round(share x sample)`` (half up) are drawn from ``live`` when it holds at least ``k``
    (else none: a validation is either the configured mix or the configured pool alone); the
    other ``sample - k`` (or all ``sample``) from ``pool``, at most ``len(pool)``, never
    repeating a live one. Shuffled together. ``share`` 0 or an empty ``live``: exactly
    ``rng.sample(pool, min(sample, len(pool)))``, as without live prompts.
    """
    k = math.floor(share * sample + 0.5)
    if k <= 0 or len(live) < k:
        return rng.sample(list(pool), min(sample, len(pool))), 0
    chosen = rng.sample(list(live), k)
    taken = set(chosen)
    rest = [p for p in pool if p not in taken]
    out = chosen + rng.sample(rest, min(sample - k, len(rest)))
    rng.shuffle(out)
    return out, k
