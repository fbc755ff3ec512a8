"""Mixed traffic for fault tests (:class:`TrafficLoad`): non-streaming and SSE streaming
completions in a loop against one URL (Envoy's listener or the relay), counting per phase
(:class:`TrafficStats`) answered and failed requests, whole and cut streams, and connections
refused before anything was sent (retried by the client: a refused connect carries no request).
"""
from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

__all__ = ["TrafficLoad", "TrafficStats"]

#: Envoy's response header naming the engine ("ip:port") that serves a request (xds_server/envoy/envoy.yaml).
UPSTREAM_HEADER = "x-sentinel-upstream-host"


@dataclass
class TrafficStats:
    """Counts for one phase. Failures and cuts are keyed by cause (``HTTP 503``, an exception
    name, ``no [DONE]``, ``in-band error``)."""

    requests_ok: int = 0
    requests_failed: collections.Counter[str] = field(default_factory=collections.Counter)
    streams_ok: int = 0
    streams_cut: collections.Counter[str] = field(default_factory=collections.Counter)
    refused: int = 0

    @property
    def failed(self) -> int:
        """Non-streaming requests that failed, over all causes."""
        return sum(self.requests_failed.values())

    @property
    def cut(self) -> int:
        """Streams that did not end whole (one ``[DONE]``, no in-band error)."""
        return sum(self.streams_cut.values())

    def add(self, other: TrafficStats) -> None:
        """Add ``other``'s counts into this one."""
        self.requests_ok += other.requests_ok
        self.requests_failed.update(other.requests_failed)
        self.streams_ok += other.streams_ok
        self.streams_cut.update(other.streams_cut)
        self.refused += other.refused


class TrafficLoad:
    """``requests`` workers sending non-streaming completions and ``streams`` workers sending SSE
    completions of ``stream_tokens`` tokens to ``url`` in a loop, until :meth:`stop`.

    A request whose connection is refused (nothing sent) is retried after ``refused_retry_s``
    seconds and counted in ``refused``, not as a failure. ``in_flight`` maps the serving engine
    (Envoy's ``x-sentinel-upstream-host``; "?" when absent) to the streams running on it now.
    Every connection is closed after its request (no keep-alive), so a restarted Envoy is never
    sent a request on a connection it already closed. ``resets_as_refused``: a connection reset
    or closed before any response byte also counts as refused and is retried: for a listener that
    closes (an Envoy restart), where a connect the kernel's backlog completed but Envoy never
    accepted is reset when the listening socket closes; nothing reached Envoy's HTTP layer.
    """

    def __init__(self, url: str, requests: int = 2, streams: int = 2, request_tokens: int = 4,
                 stream_tokens: int = 40, timeout_s: float = 20.0, refused_retry_s: float = 0.05,
                 resets_as_refused: bool = False) -> None:
        self.base = url.rstrip("/")
        self.resets_as_refused = resets_as_refused
        self.n_requests, self.n_streams = requests, streams
        self.request_tokens, self.stream_tokens = request_tokens, stream_tokens
        self.timeout_s, self.refused_retry_s = timeout_s, refused_retry_s
        self.phases: dict[str, TrafficStats] = {"start": TrafficStats()}
        self.current = "start"
        self.in_flight: collections.Counter[str] = collections.Counter()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None

    def phase(self, name: str) -> TrafficStats:
        """Count into phase ``name`` from now on (a request is counted in the phase it ends in)."""
        self.current = name
        return self.phases.setdefault(name, TrafficStats())

    def totals(self) -> TrafficStats:
        """All phases summed."""
        t = TrafficStats()
        for s in self.phases.values():
            t.add(s)
        return t

    async def start(self) -> TrafficLoad:
        """Start the workers."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(force_close=True))
        self._tasks = [asyncio.create_task(self._loop(i, False)) for i in range(self.n_requests)]
        self._tasks += [asyncio.create_task(self._loop(i, True)) for i in range(self.n_streams)]
        return self

    async def stop(self) -> None:
        """Stop the workers after their current request; close the session."""
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def wait_streams_on(self, address: str | None = None, timeout_s: float = 5.0) -> str:
        """Wait until a stream runs on ``address`` (any engine when None); returns the address.
        Raises TimeoutError."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for addr, n in self.in_flight.items():
                if n > 0 and addr != "?" and (address is None or addr == address):
                    return addr
            await asyncio.sleep(0.01)
        raise TimeoutError(f"no stream in flight on {address or 'any engine'} in {timeout_s} s")

    async def _loop(self, i: int, stream: bool) -> None:
        body = {"model": "sim-model", "prompt": f"fault matrix {'stream' if stream else 'request'} {i}",
                "max_tokens": self.stream_tokens if stream else self.request_tokens, "temperature": 0,
                "stream": stream}
        while not self._stop.is_set():
            try:
                await (self._stream(body) if stream else self._request(body))
            except (aiohttp.ClientConnectorError, _Unaccepted):
                self.phases[self.current].refused += 1
                await asyncio.sleep(self.refused_retry_s)

    def _post(self, body: dict) -> _Posting:
        """The POST's context manager; entering it raises :class:`_Unaccepted` for a reset before
        any response byte when ``resets_as_refused``."""
        assert self._session is not None
        return _Posting(self._session.post(self.base + "/v1/completions", json=body), self.resets_as_refused)

    async def _request(self, body: dict) -> None:
        assert self._session is not None
        try:
            async with self._post(body) as r:
                await r.read()
                if r.status == 200:
                    self.phases[self.current].requests_ok += 1
                else:
                    self.phases[self.current].requests_failed[f"HTTP {r.status}"] += 1
        except (aiohttp.ClientConnectorError, _Unaccepted):
            raise
        except (TimeoutError, aiohttp.ClientError) as e:
            self.phases[self.current].requests_failed[type(e).__name__] += 1

    async def _stream(self, body: dict) -> None:
        assert self._session is not None
        node, done, error = None, False, False
        try:
            async with self._post(body) as r:
                if r.status != 200:
                    await r.read()
                    self.phases[self.current].streams_cut[f"HTTP {r.status}"] += 1
                    return
                node = r.headers.get(UPSTREAM_HEADER, "?")
                self.in_flight[node] += 1
                buf = b""
                async for data in r.content.iter_any():
                    buf += data
                    *events, buf = buf.split(b"\n\n")
                    for ev in events:
                        for line in ev.split(b"\n"):
                            if line == b"data: [DONE]":
                                done = True
                            elif line.startswith(b"data: ") and b'"error"' in line and "error" in json.loads(line[6:]):
                                error = True
        except (aiohttp.ClientConnectorError, _Unaccepted):
            raise
        except (TimeoutError, aiohttp.ClientError) as e:
            self.phases[self.current].streams_cut[type(e).__name__] += 1
            return
        finally:
            if node is not None:
                self.in_flight[node] -= 1
        if error:
            self.phases[self.current].streams_cut["in-band error"] += 1
        elif not done:
            self.phases[self.current].streams_cut["no [DONE]"] += 1
        else:
            self.phases[self.current].streams_ok += 1


class _Unaccepted(Exception):
    """A connection reset or closed before any response byte (see ``resets_as_refused``)."""


class _Posting:
    """``session.post(...)`` whose entry turns a reset before the response into :class:`_Unaccepted`."""

    def __init__(self, cm: Any, resets_as_refused: bool) -> None:
        self._cm, self._on = cm, resets_as_refused

    async def __aenter__(self) -> aiohttp.ClientResponse:
        try:
            return await self._cm.__aenter__()
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            if self._on and not isinstance(e, aiohttp.ClientConnectorError):
                raise _Unaccepted(str(e)) from e
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self._cm.__aexit__(*exc)
