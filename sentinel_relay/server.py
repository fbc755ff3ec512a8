"""The relay's HTTP shell: client -> relay -> Envoy -> engines.

:class:`Relay` serves HTTP (aiohttp's low-level server: no router, no middlewares) and forwards
every request to Envoy. A streaming completion or chat request that can be continued ("armed")
is relayed event by event through a :class:`~sentinel_relay.stream.StreamBook`; when its attempt
fails it is continued on whatever node Envoy routes the continuation to. Triggers:

- health: the routing feed says the node (Envoy's ``x-sentinel-upstream-host``) is UNHEALTHY
  (DRAINING is left alone: a drain lets requests finish);
- reset: the upstream connection broke, or ended without finish_reason;
- error: an in-band error event, or a 5xx status before the first byte;
- stall: no byte for ``stall_gap_s`` (``first_chunk_timeout_s`` before an attempt's first chunk).

Non-streaming requests and pass-through (refused requests, other paths): :mod:`.unary`.
With ``sample_prompts`` > 0 a drawn completion or chat request answered 200 hands its parsed
body to :mod:`.prompts` (off: ``Relay.sampler`` is None and nothing more is done per request).
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from .config import RelayConfig
from .connections import bounded_runner
from .flight import LOW_WATER, StreamCtx
from .http1 import build_request
from .metrics import RelayMetrics
from .plan import PATHS, Plan, Refused, choose_pin, plan_request
from .prompts import PromptSampler
from .sse import SSESplitter
from .stream import PING, St, StreamBook
from .unary import HOP_HEADERS, PIN_HEADER, RELAY_HEADER, UnaryRequests, pin_value
from .unary import out_headers as _out_headers
from .unary import reply as _reply
from .upstream import UpstreamExchange, open_exchange

__all__ = ["RELAY_HEADER", "Relay"]

log = logging.getLogger("sentinel_relay")

class Relay:
    """``await Relay(cfg).start()`` serves until ``await stop()``. ``metrics``: its registry.
    ``sock``: an already bound socket to serve on (worker mode), else ``cfg.listen``."""

    def __init__(self, cfg: RelayConfig, metrics: RelayMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or RelayMetrics()
        self.by_node: dict[str, set[StreamCtx]] = {}
        self.streams: set[StreamCtx] = set()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.ServerRunner | None = None
        self._tasks: list[asyncio.Task] = []
        self._node_state: dict[str, str] = {}  # node id -> last state heard on the routing feed
        self.routes: dict[str, tuple[bool, int]] = {}  # address -> (routable, weight) from the feed
        self.clusters: dict[str, str] = {}  # address -> cluster from the feed (sampled prompts' cluster)
        # --sample-prompts (off: None, one test per request, nothing parsed beyond plan_request)
        self.sampler = PromptSampler(cfg, self.metrics) if cfg.sample_prompts > 0 else None
        self.port: int | None = None
        u = urlsplit(cfg.upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream: streams are relayed over plain HTTP/1.1 to Envoy; got {cfg.upstream!r}")
        self._up_host, self._up_port = u.hostname, u.port or 80
        self._up_hostport = u.netloc

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self, reuse_port: bool = False) -> Relay:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"))
        self.unary = UnaryRequests(self.cfg, self.metrics, self._session, self.pin)
        # no access log: the relay logs what matters (rescues) itself; connection bounds: connections.py
        self._runner = bounded_runner(self._handle, self.cfg, self.metrics.registry)
        await self._runner.setup()
        host, _, port = self.cfg.listen.rpartition(":")
        site = web.TCPSite(self._runner, host, int(port), reuse_port=reuse_port, backlog=self.cfg.listen_backlog)
        await site.start()
        self.port = self._runner.addresses[0][1]
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._watchdog(), name="relay-watchdog"))
        log.info("relay listening on %s:%s -> %s", host, self.port, self.cfg.upstream)
        return self

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner:
            await self._runner.cleanup()
        if self._session:
            await self._session.close()

    # -- the health signal ---------------------------------------------------------------------
    def on_node(self, node: Any, snapshot: bool = False) -> int:
        """A routing update (``NodeRouting``-shaped: ``node_id``, ``address``, ``state``).

        UNHEALTHY: rescue every stream on ``address`` (always: they run on an ejected node), and,
        on a *change* to UNHEALTHY outside a snapshot, re-issue the non-streaming requests
        waiting for an answer (a reconnect's snapshot repeats old ejections). DRAINING and the
        other states: nothing. Returns how many requests it acted on."""
        prev = self._node_state.get(node.node_id)
        self._node_state[node.node_id] = node.state
        self.routes[node.address] = (bool(getattr(node, "routable", node.state not in ("UNHEALTHY", "DRAINING"))),
                                     int(getattr(node, "weight", 1) or 1))
        self.clusters[node.address] = str(getattr(node, "cluster", "") or "")
        if node.state != "UNHEALTHY":
            return 0
        n = 0
        for ctx in list(self.by_node.get(node.address, ())):
            ctx.kill("health")
            n += 1
        if self.cfg.hedge_unary_on_ejection and not snapshot and prev != "UNHEALTHY":
            n += self.unary.on_ejection(node.address)
        if n:
            log.info("node %s (%s) ejected: rescuing %d requests (%s)", node.node_id,
                     node.address, n, getattr(node, "reason", ""))
        return n

    async def _watchdog(self) -> None:
        """Stall detection and pings: one timer per process, not one per chunk."""
        tick = min(self.cfg.ping_interval_s, self.cfg.stall_gap_s / 4, 0.1)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            for ctx in list(self.streams):
                gap = self.cfg.stall_gap_s if ctx.first_chunk else self.cfg.first_chunk_timeout_s
                if ctx.paused:
                    if ctx.transport is None or ctx.transport.get_write_buffer_size() < LOW_WATER:
                        ctx.paused = False
                        if ctx.up is not None:
                            ctx.up.resume()
                    ctx.last_rx = now  # a slow client is not a stalled engine
                if ctx.up is not None and now - ctx.last_rx > gap:
                    ctx.kill("stall")
                if ctx.rescuing and ctx.transport is not None and now - ctx.last_tx >= self.cfg.ping_interval_s:
                    ctx.last_tx = now
                    ctx.send(PING)
                if ctx.transport is not None and (ctx.client_gone or ctx.transport.is_closing()):
                    # the client left (seen at the latest by a ping's write): the upstream
                    # request goes at once, not at the next body write or Envoy's idle timeout
                    ctx.client_gone = True
                    ctx.kill("client")

    def pin(self, exclude: set[str]) -> str | None:
        """A routable node from the feed, not in ``exclude``, drawn by weight (None: Envoy picks)."""
        return choose_pin(self.routes, exclude, random.random())

    # -- HTTP ------------------------------------------------------------------------------------
    def _upstream_headers(self, request: web.BaseRequest, armed: bool) -> dict[str, str]:
        # a client's own pin is dropped: only the relay chooses endpoints
        h = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS and k.lower() != PIN_HEADER}
        if armed:
            h.pop("Accept-Encoding", None)
            h.pop("accept-encoding", None)
        return h

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        raw = await request.read()
        plan = plan_request(request.path, raw) if request.method == "POST" else \
            Plan("other", None, False, "method", raw)
        self.metrics.requests.labels("passthrough" if plan.refusal else "rescue").inc()
        sampler = self.sampler
        if sampler is None or plan.body is None or plan.kind == "other" or not sampler.draw():
            return await self._forward(request, plan, raw)
        resp = await self._forward(request, plan, raw)
        if resp.status == 200:  # a prompt the engine took; its node's cluster when the feed names it
            node = resp.headers.get(self.cfg.upstream_host_header, "")
            sampler.offer(plan.kind, plan.body, self.clusters.get(node, ""))
        return resp

    async def _forward(self, request: web.BaseRequest, plan: Plan, raw: bytes) -> web.StreamResponse:
        if plan.refusal is not None:
            return await self.unary.passthrough(request, raw, f"passthrough; reason={plan.refusal}")
        headers = self._upstream_headers(request, armed=True)
        if plan.stream:
            return await self._stream(request, plan, headers)
        return await self.unary.handle(request, plan, headers)

    async def _stream(self, request: web.BaseRequest, plan: Plan, headers: dict[str, str]) -> web.StreamResponse:
        assert plan.body is not None
        loop = asyncio.get_running_loop()
        hdrs = [(k, v) for k, v in headers.items() if k.lower() != "accept-encoding"]
        book = StreamBook(plan.kind, plan.body, plan.include_usage)
        ctx = StreamCtx(loop.time())
        body = plan.upstream_body
        client: web.StreamResponse | None = None
        last_error: tuple[int, str | None, Any, bytes] | None = None
        rescues = 0
        trigger: str | None = None
        failed: set[str] = set()  # nodes that failed this stream: a rescue never goes back to them
        self.streams.add(ctx)
        try:
            while True:
                ctx.kill_reason, ctx.first_chunk, ctx.last_rx = None, False, loop.time()
                reason: str | None = None
                head = None
                target = request.path_qs
                if book.upstream_kind != plan.kind:  # a chat stream continued from token ids
                    target = PATHS[book.upstream_kind] + (f"?{request.query_string}" if request.query_string else "")
                pin = self.pin(failed) if failed else None
                attempt_hdrs = hdrs if pin is None else [*hdrs, (PIN_HEADER, pin_value(pin))]
                try:
                    ex = await open_exchange(self._up_host, self._up_port, build_request(
                        "POST", target, self._up_hostport, attempt_hdrs, body))
                    ctx.up = ex
                    head = await ex.head
                except (TimeoutError, OSError):
                    reason = ctx.kill_reason or "reset"
                if ctx.client_gone:  # left while this attempt connected or prefilled
                    return client or web.Response(status=499)
                if head is not None and head.status != 200:
                    err = await _collect(ex)
                    ctx.up = None
                    hh = CIMultiDict(head.headers)
                    if hh.get(self.cfg.upstream_host_header):
                        failed.add(hh[self.cfg.upstream_host_header])
                    if client is None and head.status < 500:
                        return _reply(head.status, head.reason, hh, err)
                    last_error, head, reason = (head.status, head.reason, hh, err), None, "error"
                if head is not None:
                    if client is None:
                        client = web.StreamResponse(status=200,
                                                    headers=_out_headers(CIMultiDict(head.headers), "rescue"))
                        await client.prepare(request)
                        writer = client._payload_writer
                        if writer is not None and hasattr(writer, "send_headers"):
                            writer.send_headers()
                        ctx.bind_client(client, request.transport)
                    node = head.header(self.cfg.upstream_host_header)
                    reason = await self._relay_attempt(ctx, ex, head, book)
                    if reason is not None and node:
                        failed.add(node)
                    if ctx.client_gone:
                        return client
                    if reason is None:
                        if trigger is not None:
                            self.metrics.rescues.labels(trigger, "resumed").inc()
                        await client.write_eof()
                        return client
                else:
                    book.set_fault(reason or "reset")
                trigger = _trigger(reason or "reset")
                rescues += 1
                if not ctx.rescuing:
                    ctx.rescuing, ctx.fault_tx = True, ctx.last_tx
                refusal = None
                nxt = None
                if rescues > self.cfg.max_rescues:
                    refusal = f"attempts exhausted ({rescues} failed)"
                else:
                    limit = plan.body.get("max_tokens") or plan.body.get("max_completion_tokens")
                    ctx_len = await self.unary.context_len(plan.body.get("model")) \
                        if plan.kind == "chat" and limit is None else None
                    try:
                        nxt = book.next_request(self.cfg.max_resume_tokens, ctx_len)
                    except Refused as e:
                        refusal = str(e)
                    if nxt is None and refusal is None and client is not None:
                        ctx.send(book.finish_length())
                        await client.write_eof()
                        return client
                if refusal is not None:
                    outcome = "refused" if rescues <= self.cfg.max_rescues else "failed"
                    self.metrics.rescues.labels(trigger, outcome).inc()
                    log.warning("stream not rescued (%s after %s)", refusal, reason)
                    if client is None:
                        if last_error is not None:
                            return _reply(*last_error)
                        return web.json_response({"error": {"message": f"upstream failed: {reason}", "code": 502}},
                                                 status=502, headers={RELAY_HEADER: "rescue"})
                    ctx.send(book.give_up(f"the serving node failed ({reason}); {refusal}"))
                    await client.write_eof()
                    return client
                self.metrics.wasted.labels("prefill").inc(book.usage()["prompt_tokens"] + book.resent_tokens)
                log.info("rescuing stream (trigger %s, attempt %d, %d tokens delivered)",
                         reason, book.attempt, book.rx.tokens)
                body = json.dumps(nxt, separators=(",", ":")).encode()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            return client or web.Response(status=499)
        finally:
            self.streams.discard(ctx)
            self._detach(ctx)
            if ctx.up is not None:
                ctx.up.abort("handler")

    async def _relay_attempt(self, ctx: StreamCtx, ex: UpstreamExchange, head: Any, book: StreamBook) -> str | None:
        """Relay one attempt's body; the hot path runs in ``on_body`` (no await per chunk).
        Returns None when the response is whole, else the fault reason."""
        loop = asyncio.get_running_loop()
        self._attach(ctx, ex, head.header(self.cfg.upstream_host_header))
        sp = SSESplitter()
        feed, split, send, pause = book.feed, sp.feed, ctx.send, self.metrics.pause

        def on_body(data: bytes) -> None:
            now = ctx.last_rx = loop.time()
            out = feed(split(data))
            if out:
                ctx.first_chunk = True
                if ctx.rescuing:
                    pause.observe(now - ctx.fault_tx)
                    ctx.rescuing = False
                ctx.last_tx = now
                send(out)
                if ctx.client_gone:
                    ex.abort("client")
            st = book.state
            if st is not St.OPEN and st is not St.FINISHED:
                ex.abort("book")  # whole ([DONE]) or faulted (in-band error): this attempt is over

        ex.consume(on_body)
        reason = await ex.done
        if ctx.kill_reason is not None:
            tail = book.set_fault(ctx.kill_reason)
        elif reason in (None, "book"):
            tail = book.eof()
        else:
            tail = book.set_fault("reset")
        if tail:
            ctx.send(tail)
        self._detach(ctx)
        ctx.up = None
        if book.state is St.COMPLETE:
            return None
        return ctx.kill_reason or book.fault or "reset"

    def _attach(self, ctx: StreamCtx, up: UpstreamExchange, node: str | None) -> None:
        ctx.up, ctx.node = up, node
        if node:
            self.by_node.setdefault(node, set()).add(ctx)
            self.metrics.in_flight.labels(node).inc()

    def _detach(self, ctx: StreamCtx) -> None:
        if ctx.node:
            s = self.by_node.get(ctx.node)
            if s is not None and ctx in s:
                s.discard(ctx)
                self.metrics.in_flight.labels(ctx.node).dec()
        ctx.node = None

def _trigger(reason: str) -> str:
    """Metric label for a fault reason: health, reset, stall or error."""
    if reason in ("health", "stall", "error"):
        return reason
    return "reset"  # reset, truncated


async def _collect(ex: UpstreamExchange) -> bytes:
    """The whole (error) body of an exchange."""
    parts: list[bytes] = []
    ex.consume(parts.append)
    await ex.done
    return b"".join(parts)


