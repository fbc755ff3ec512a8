"""Open-loop load and a watcher for the overload runs (half a cluster frozen under a
steady load the other half cannot carry), shared by tests/integration/test_overload_envoy.py and
benchmarks/overload_shed.py.

- :class:`OpenLoop`: Poisson arrivals at ``rate_rps`` (seeded), each a streamed completion through
  Envoy, never waiting for earlier ones (a closed loop would slow down with the cluster and hide
  the overload). Per request (:class:`Shot`): send time, status, TTFT (s to the first token
  event), whether Retry-After came with it, how it ended.
- :class:`Watch`: every ``period_s`` the engines' ``vllm:num_requests_waiting`` (their own
  ``/metrics``) and the control plane's commanded drop (``/clusters`` ``traffic.shed_percent``).

Times are monotonic seconds.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

__all__ = ["OpenLoop", "Shot", "Watch", "pct", "summary", "waiting_of"]


@dataclass
class Shot:
    """One request: ``t`` sent (s), ``status`` (0: no answer), ``ttft_s`` (None: no token),
    ``retry_after`` (the header's value or None), ``end``: "done" ([DONE] seen), "cut" (the
    stream ended without it), "timeout", an exception name, or "status" (non-200 answered)."""

    t: float
    status: int = 0
    ttft_s: float | None = None
    retry_after: str | None = None
    end: str = ""
    commanded: float = 0.0  # the drop the control plane published when it was sent, %
    done_t: float | None = None  # when its [DONE] arrived (s; None: it did not)


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile (0..100, nearest rank) of ``xs``; NaN when empty."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100.0 * len(s)) - 1))]


def waiting_of(text: str) -> float | None:
    """``vllm:num_requests_waiting`` from a Prometheus exposition (summed over engines)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_waiting{", "vllm:num_requests_waiting ")):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


@dataclass
class Watch:
    """Samples ``(t, {node id: waiting})``, ``(t, commanded drop %)`` and ``(t, admission limit
    per Envoy or None)`` every ``period_s``, and each new ``shed_reason``."""

    engines: dict[str, str]  # node id -> engine base URL
    admin_url: str
    period_s: float = 0.2
    waiting: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    drops: list[tuple[float, float]] = field(default_factory=list)
    commanded: float = 0.0
    limits: list[tuple[float, int | None]] = field(default_factory=list)
    limit: int | None = None  # the admission cap now (admitting by slots), per Envoy
    reasons: list[tuple[float, str]] = field(default_factory=list)  # (t, shed_reason) at each change

    async def run(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = time.monotonic()
            row: dict[str, float] = {}
            for nid, url in self.engines.items():
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                        w = waiting_of(await r.text())
                    if w is not None:
                        row[nid] = w
            self.waiting.append((t, row))
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError):
                async with http.get(f"{self.admin_url}/clusters", timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                    traffic = (await r.json())["clusters"][0]["traffic"]
                self.commanded = float(traffic["shed_percent"] or 0.0)
                self.limit = (traffic.get("admission") or {}).get("max_requests_per_envoy")
                self.limits.append((t, self.limit))
                why = traffic.get("shed_reason")
                if why and (not self.reasons or self.reasons[-1][1] != why):
                    self.reasons.append((t, why))
                self.drops.append((t, self.commanded))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, self.period_s - (time.monotonic() - t)))

    def waiting_between(self, t0: float, t1: float, nodes: list[str]) -> list[float]:
        """Every sample of the given nodes' waiting taken in [t0, t1)."""
        return [row[n] for t, row in self.waiting if t0 <= t < t1 for n in nodes if n in row]


@dataclass
class OpenLoop:
    """Poisson arrivals of streamed completions at ``rate_rps`` through ``url`` (Envoy)."""

    url: str
    rate_rps: float
    max_tokens: int = 8
    timeout_s: float = 15.0
    seed: int = 1
    watch: Watch | None = None  # stamps each shot with the drop commanded when it was sent
    shots: list[Shot] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        """Send until ``stop`` is set, then wait for the requests in flight (each bounded by
        ``timeout_s``). Its own session, with no connection limit: aiohttp's default of 100
        would queue requests in the client and turn the open loop into a closed one."""
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            await self._send(http, stop)

    async def _send(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        rng = random.Random(self.seed)
        tasks: set[asyncio.Task[None]] = set()
        nxt = time.monotonic()
        while not stop.is_set():
            nxt += rng.expovariate(self.rate_rps)
            delay = nxt - time.monotonic()
            if delay > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                if stop.is_set():
                    break
            shot = Shot(time.monotonic(), commanded=self.watch.commanded if self.watch else 0.0)
            self.shots.append(shot)
            task = asyncio.create_task(self._one(http, shot))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, http: aiohttp.ClientSession, shot: Shot) -> None:
        body = {"model": "sim-model", "prompt": "hello", "max_tokens": self.max_tokens, "stream": True}
        try:
            async with asyncio.timeout(self.timeout_s):
                async with http.post(f"{self.url}/v1/completions", json=body) as r:
                    shot.status = r.status
                    shot.retry_after = r.headers.get("Retry-After")
                    if r.status != 200:
                        await r.read()
                        shot.end = "status"
                        return
                    done = False
                    async for line in r.content:
                        if shot.ttft_s is None and line.startswith(b"data: {"):
                            shot.ttft_s = time.monotonic() - shot.t
                        if line.startswith(b"data: [DONE]"):
                            done = True
                    shot.end = "done" if done else "cut"
                    shot.done_t = time.monotonic() if done else None
        except TimeoutError:
            shot.end = "timeout"
        except (aiohttp.ClientError, ConnectionError) as exc:
            shot.end = type(exc).__name__

    def between(self, t0: float, t1: float) -> list[Shot]:
        """Shots sent in [t0, t1)."""
        return [s for s in self.shots if t0 <= s.t < t1]


def summary(shots: list[Shot]) -> dict[str, object]:
    """Counts and TTFT percentiles of ``shots``: ``n``, ``status`` (Counter of "200", "429+RA"
    (429 with Retry-After), "429", "503", other codes, or the end of an unanswered one),
    ``errors`` (200s cut or timed out), ``shed_share`` (429s over all, %), ``commanded`` (mean
    commanded drop at send time, %), ``ttft_p50_ms``/``ttft_p99_ms`` of the admitted (200 with a
    token), ``service_s``: how long an admitted request held its slot, unqueued (s: the mean from
    its first token to its [DONE], plus the 10th percentile of the time to a first token, a request
    that found a slot free; the median also holds the wait of those admitted to a spare place, and
    read 80 ms where an unqueued prefill took ~20: NaN without one)."""
    st: Counter[str] = Counter()
    errors = 0
    for s in shots:
        if s.status == 429:
            st["429+RA" if s.retry_after else "429"] += 1
        elif s.status:
            st[str(s.status)] += 1
        else:
            st[s.end or "none"] += 1
        if s.status == 200 and s.end != "done":
            errors += 1
    ttft = [s.ttft_s * 1000.0 for s in shots if s.status == 200 and s.ttft_s is not None]
    n = len(shots)
    shed = st["429+RA"] + st["429"]
    decode = [s.done_t - s.t - s.ttft_s for s in shots if s.status == 200 and s.ttft_s is not None
              and s.done_t is not None]
    service = sum(decode) / len(decode) + pct(ttft, 10) / 1000.0 if decode else math.nan
    return {"n": n, "status": st, "errors": errors, "service_s": service,
            "shed_share": 100.0 * shed / n if n else math.nan,
            "commanded": sum(s.commanded for s in shots) / n if n else math.nan,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99)}
