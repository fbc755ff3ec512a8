"""A steady request load through Envoy (:class:`LoadGenerator`) that counts requests per serving
replica (``x-served-by``) and every failure, per phase (:class:`LoadStats`)."""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

import aiohttp

__all__ = ["LoadGenerator", "LoadStats"]


@dataclass
class LoadStats:
    """Counts for one phase of load."""

    ok_by_node: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def ok(self) -> int:
        """Requests answered 200, over all replicas."""
        return sum(self.ok_by_node.values())

    @property
    def failed(self) -> int:
        """Requests failed, over all causes."""
        return sum(self.failures.values())


class LoadGenerator:
    """``concurrency`` workers sending non-streaming completions through Envoy in a loop.

    Counts go to the current phase (:meth:`phase`). A request fails if Envoy answers non-200 or
    the connection breaks; the status or exception name is counted. Bounded: stops at
    :meth:`stop` or after ``max_duration_s``. ``headers`` go on every request (e.g. the
    header that picks a cluster when Envoy routes to several); ``prompt_words`` lengthens each
    prompt by that many words (a long prompt, for faults keyed on prompt length).
    """

    def __init__(self, url: str, concurrency: int = 4, max_tokens: int = 4, pause_s: float = 0.0,
                 max_duration_s: float = 300.0, request_timeout_s: float = 30.0,
                 headers: dict[str, str] | None = None, prompt_words: int = 0) -> None:
        self.url = url.rstrip("/") + "/v1/completions"
        self.prompt_words = prompt_words
        self.headers = dict(headers or {})
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.pause_s = pause_s
        self.max_duration_s = max_duration_s
        self.request_timeout_s = request_timeout_s
        self.phases: dict[str, LoadStats] = {}
        self.current = "start"
        self.phases[self.current] = LoadStats()
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None

    def phase(self, name: str) -> LoadStats:
        """Start counting into a new phase; returns its stats object."""
        self.current = name
        self.phases.setdefault(name, LoadStats())
        return self.phases[name]

    async def start(self) -> None:
        """Start the workers."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            connector=aiohttp.TCPConnector(limit=self.concurrency * 2),
        )
        self._t0 = time.monotonic()
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.concurrency)]

    async def _worker(self, i: int) -> None:
        assert self._session is not None
        body = {"model": "sim-model", "prompt": f"load {i}" + " word" * self.prompt_words,
                "max_tokens": self.max_tokens, "temperature": 0, "stream": False}
        while not self._stop.is_set() and time.monotonic() - self._t0 < self.max_duration_s:
            phase = self.phases[self.current]
            t = time.monotonic()
            try:
                async with self._session.post(self.url, json=body, headers=self.headers) as r:
                    await r.read()
                    if r.status == 200:
                        phase.ok_by_node[r.headers.get("x-served-by", "?")] += 1
                        phase.latencies_ms.append((time.monotonic() - t) * 1000.0)
                    else:
                        phase.failures[f"HTTP {r.status}"] += 1
            except (TimeoutError, aiohttp.ClientError) as e:
                phase.failures[type(e).__name__] += 1
            if self.pause_s:
                await asyncio.sleep(self.pause_s)

    async def stop(self) -> None:
        """Stop the workers, wait for in-flight requests, close the session."""
        self._stop.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def totals(self) -> LoadStats:
        """All phases summed."""
        t = LoadStats()
        for s in self.phases.values():
            t.ok_by_node.update(s.ok_by_node)
            t.failures.update(s.failures)
            t.latencies_ms.extend(s.latencies_ms)
        return t
