"""Non-streaming requests and pass-through, for the relay (:mod:`.server` owns streams).

- A non-streaming request that can be continued is re-issued (as it was: nothing reached the
  client) on a reset or a 5xx, and at once when the node it waits on is ejected: the first good
  answer wins, the others are cancelled. Its node is unknown until its answer arrives (Envoy
  names it in the response headers, which come with the body), so while the routing feed lists
  routable nodes the relay pins each attempt to one (``x-sentinel-pin``, drawn by the published
  weights; Envoy's stateful-session filter honours it) and re-issues only the requests on the
  ejected node, pinned elsewhere: one generation per request reaches a survivor. Without the
  feed's list the node is unknown and every waiting request is re-issued on an ejection.
- Everything else (refused requests, other paths, other methods) is forwarded unchanged, a cut
  included, with ``x-sentinel-relay: passthrough; reason=...``.
"""
from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from .config import RelayConfig
from .metrics import RelayMetrics
from .plan import Plan

__all__ = ["HOP_HEADERS", "PIN_HEADER", "RELAY_HEADER", "UnaryRequests", "out_headers", "pin_value", "reply"]

RELAY_HEADER = "x-sentinel-relay"
#: Request header naming the endpoint an attempt must go to (Envoy's stateful-session filter,
#: xds_server/envoy/envoy.yaml); Envoy also puts it on responses: never passed to the client.
PIN_HEADER = "x-sentinel-pin"
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
                         "trailer", "upgrade", "host", "content-length"})


def out_headers(h: Any, extra: str | None = None) -> dict[str, str]:
    """Response headers for the client: the upstream's, less hop-by-hop, plus the relay's note."""
    out = {k: v for k, v in h.items() if k.lower() not in HOP_HEADERS and k.lower() != PIN_HEADER}
    if extra:
        out[RELAY_HEADER] = extra
    return out


def pin_value(address: str) -> str:
    """The ``x-sentinel-pin`` value for an endpoint ``ip:port`` (base64, as Envoy reads it)."""
    return base64.b64encode(address.encode()).decode()


def reply(status: int, reason: str | None, headers: Any, body: bytes, note: str = "rescue") -> web.Response:
    return web.Response(status=status, reason=reason, body=body, headers=out_headers(headers, note))


class _Unary:
    """One armed non-streaming request in flight: its attempts and their answers."""

    __slots__ = ("args", "hedges", "live", "nodes", "pending", "results", "tasks")

    def __init__(self, *args: Any) -> None:
        self.args = args  # url, body, headers
        self.results: asyncio.Queue = asyncio.Queue()
        self.pending = 0  # attempts started whose answer is not yet in ``results``
        self.tasks: set[asyncio.Task] = set()
        self.hedges = 0
        self.nodes: list[str | None] = []  # the node each attempt was pinned to (None: Envoy's pick)
        self.live: list[str | None] = []   # the same, of the attempts not answered yet



class UnaryRequests:
    """The relay's non-streaming side; ``inflight``: armed requests waiting for an answer."""

    def __init__(self, cfg: RelayConfig, metrics: RelayMetrics, session: aiohttp.ClientSession,
                 pin: Callable[[set[str]], str | None] = lambda exclude: None) -> None:
        self.cfg, self.metrics, self._session = cfg, metrics, session
        self.pin = pin  # exclude -> a routable node to pin to, or None (Envoy picks)
        self.inflight: set[_Unary] = set()
        self._context_lens: dict[str | None, int] = {}

    async def context_len(self, model: str | None) -> int | None:
        """The served model's context length (``max_model_len`` of ``GET /v1/models``, as vLLM
        and the simulator list it), through Envoy; None when it cannot be learned within 2 s.
        Learned once per model name."""
        if model in self._context_lens:
            return self._context_lens[model]
        try:
            async with self._session.get(self.cfg.upstream + "/v1/models",
                                         timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                cards = (await r.json(content_type=None)).get("data") or []
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None
        for card in cards:
            n = card.get("max_model_len") if isinstance(card, dict) else None
            if isinstance(n, int) and (model is None or card.get("id") == model or len(cards) == 1):
                self._context_lens[model] = n
                return n
        return None

    def on_ejection(self, address: str) -> int:
        """The node at ``address`` was ejected: re-issue each waiting request that may run there
        (pinned to it, or unpinned: unknown), within ``max_rescues``, pinned elsewhere."""
        n = 0
        for u in list(self.inflight):
            if u.hedges < self.cfg.max_rescues and (address in u.live or None in u.live):
                u.hedges += 1
                self.metrics.rescues.labels("health", "hedged").inc()
                self._spawn_unary_attempt(u, {address})
                n += 1
        return n

    async def passthrough(self, request: web.BaseRequest, raw: bytes, note: str) -> web.StreamResponse:
        assert self._session is not None
        url = self.cfg.upstream + request.path_qs
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            up = await self._session.request(request.method, url, data=raw or None, headers=headers)
        except aiohttp.ClientError as e:
            return web.json_response({"error": {"message": f"upstream: {e}", "code": 502}},
                                     status=502, headers={RELAY_HEADER: note})
        try:
            resp = web.StreamResponse(status=up.status, reason=up.reason,
                                      headers=out_headers(up.headers, note))
            await resp.prepare(request)
            try:
                async for data in up.content.iter_any():
                    await resp.write(data)
            except (aiohttp.ClientError, OSError):
                if request.transport is not None:  # pass the cut on, as it was
                    request.transport.abort()
                return resp
            await resp.write_eof()
            return resp
        finally:
            up.close()

    def _spawn_unary_attempt(self, u: _Unary, exclude: set[str] | None = None) -> None:
        url, body, headers = u.args
        node = self.pin({a for a in u.nodes if a} | (exclude or set()))
        u.nodes.append(node)
        u.live.append(node)
        if node is not None:
            headers = {**headers, PIN_HEADER: pin_value(node)}

        async def attempt() -> None:
            assert self._session is not None
            try:
                async with self._session.post(url, data=body, headers=headers) as up:
                    data = await up.read()
                    res: Any = (up.status, up.reason, up.headers, data)
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, OSError) as e:
                res = e
            u.pending -= 1
            u.live.remove(node)
            u.results.put_nowait(res)
        u.pending += 1
        t = asyncio.get_running_loop().create_task(attempt())
        u.tasks.add(t)
        t.add_done_callback(u.tasks.discard)

    async def handle(self, request: web.BaseRequest, plan: Plan, headers: dict[str, str]) -> web.StreamResponse:
        url = self.cfg.upstream + request.path_qs
        u = _Unary(url, plan.upstream_body, headers)
        self.inflight.add(u)
        retries = 0
        last: Any = None
        try:
            self._spawn_unary_attempt(u)
            while True:
                res = await u.results.get()
                if isinstance(res, tuple) and res[0] < 500:
                    if retries or u.hedges:
                        self.metrics.rescues.labels("health" if u.hedges else "error", "resumed").inc()
                    return reply(*res)
                last = res
                if u.pending or not u.results.empty():
                    continue  # another attempt (a re-issue on an ejection) is still running
                retries += 1
                trig = "error" if isinstance(res, tuple) else "reset"
                if retries + u.hedges > self.cfg.max_rescues:
                    self.metrics.rescues.labels(trig, "failed").inc()
                    break
                self._spawn_unary_attempt(u)
            if isinstance(last, tuple):
                return reply(*last)
            return web.json_response({"error": {"message": f"upstream failed: {last}", "code": 502}},
                                     status=502, headers={RELAY_HEADER: "rescue"})
        finally:
            self.inflight.discard(u)
            for t in list(u.tasks):
                t.cancel()


