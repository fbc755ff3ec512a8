"""The streaming micro-probe: :func:`run_probe` sends one greedy completion through an adapter
and times its first token (Server-Sent Events, or a whole JSON answer from an engine that
ignores ``stream``), classifying every failure into a :class:`ProbeOutcome`.

Facts it follows (checked against real vLLM 0.32.0 responses, ``tests/fixtures/vllm-0.32.0-cpu``):
a frozen engine still sends its 200 headers at once and then nothing; a chat stream's first chunk
carries only the role; a dead engine answers 500 with "EngineCore encountered an issue".
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from node_probe.engines.base import ChunkError, ChunkToken, EngineAdapter
from node_probe.engines.http_helpers import (
    ERROR_BODY_MAX,
    JSON_BODY_MAX,
    exc_text,
    is_engine_fatal_text,
    read_capped,
    truncate,
)
from node_probe.proto import probe_pb2

__all__ = ["PROBE_HEADER", "PROBE_HEADER_VALUE", "ProbeOutcome", "run_probe"]

#: Header sent with every micro-probe (value :data:`PROBE_HEADER_VALUE`) so engines and gateways
#: can exclude probes from their statistics; the simulated engine (``node_probe.sim``) counts
#: requests carrying it separately. The one home of this name.
PROBE_HEADER = "x-sentinel-probe"
PROBE_HEADER_VALUE = "1"


@dataclass(frozen=True)
class ProbeOutcome:
    """Result of one micro-probe.

    Attributes:
        ok: a token arrived within the deadline (and, for a deep check, the answer was right).
        ttft_ms: ms from sending the request to the first stream chunk carrying generated
            content (``None`` unless a token arrived).
        failure: ``probe_pb2.FailureKind`` value; ``FAILURE_KIND_UNSPECIFIED`` when ok.
        http_status: HTTP status of the response, 0 if none arrived.
        detail: human-readable explanation (empty when ok on a normal stream).
        headers_ms: ms to the response headers, ``None`` if none arrived.
        text: generated text read (the first token; the whole answer for a deep check).
    """

    ok: bool
    ttft_ms: float | None
    failure: probe_pb2.FailureKind
    http_status: int
    detail: str
    headers_ms: float | None = None
    text: str = ""

    @property
    def answered(self) -> bool:
        """True if the engine sent an HTTP response (its HTTP server is up)."""
        return self.http_status != 0


def fail(kind: probe_pb2.FailureKind, status: int, detail: str, headers_ms: float | None = None) -> ProbeOutcome:
    """A failed :class:`ProbeOutcome` (no token) with ``detail`` truncated."""
    return ProbeOutcome(False, None, kind, status, truncate(detail), headers_ms)


def _classify(adapter: EngineAdapter, data: str, status: int,
              headers_ms: float | None) -> ChunkToken | ProbeOutcome | None:
    if data.strip() == "[DONE]":
        return fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, "stream ended ([DONE]) with no token",
                    headers_ms)
    try:
        doc = json.loads(data)
    except ValueError:
        if is_engine_fatal_text(data):
            return fail(probe_pb2.FAILURE_KIND_ENGINE_FATAL, status, f"fatal error in stream: {data}",
                        headers_ms)
        return fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"unparseable SSE data: {data}",
                    headers_ms)
    verdict = adapter.read_chunk(doc)
    if isinstance(verdict, ChunkToken):
        return verdict
    if isinstance(verdict, ChunkError):
        kind = (probe_pb2.FAILURE_KIND_ENGINE_FATAL if is_engine_fatal_text(verdict.message)
                else probe_pb2.FAILURE_KIND_BAD_OUTPUT)
        label = "fatal error in stream" if kind == probe_pb2.FAILURE_KIND_ENGINE_FATAL else "error chunk"
        return fail(kind, status, f"{label}: {verdict.message}", headers_ms)
    if not isinstance(doc, dict):
        return fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"unexpected SSE data: {data}",
                    headers_ms)
    return None


async def _read_sse(adapter: EngineAdapter, resp: aiohttp.ClientResponse, t0: float,
                    headers_ms: float, whole: bool) -> ProbeOutcome:
    status = resp.status
    data_lines: list[str] = []
    ttft_ms: float | None = None
    texts: list[str] = []

    def dispatch() -> ProbeOutcome | bool | None:
        """An outcome to stop with, True to stop with success, None to go on."""
        nonlocal ttft_ms
        data = "\n".join(data_lines)
        data_lines.clear()
        if ttft_ms is not None and data.strip() == "[DONE]":
            return True
        verdict = _classify(adapter, data, status, headers_ms)
        if isinstance(verdict, ChunkToken):
            if ttft_ms is None:
                ttft_ms = (time.monotonic() - t0) * 1000.0
            texts.append(verdict.text)
            return True if (not whole or verdict.final) else None
        if isinstance(verdict, ProbeOutcome) and ttft_ms is not None:
            # An error after the first token: report it with the TTFT we measured.
            return ProbeOutcome(False, ttft_ms, verdict.failure, status, verdict.detail, headers_ms,
                                "".join(texts))
        return verdict

    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data_lines and (result := dispatch()) is not None:
                break
            continue
        if line.startswith(":"):
            continue  # SSE comment / keep-alive
        field_, _, value = line.partition(":")
        if field_ == "data":
            data_lines.append(value[1:] if value.startswith(" ") else value)
    else:
        result = dispatch() if data_lines else None
        if result is None and ttft_ms is not None:
            result = True
    if isinstance(result, ProbeOutcome):
        return result
    if result is True and ttft_ms is not None:
        return ProbeOutcome(True, ttft_ms, probe_pb2.FAILURE_KIND_UNSPECIFIED, status, "",
                            headers_ms, "".join(texts))
    return fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, "stream closed with no token", headers_ms)


async def _read_json_answer(adapter: EngineAdapter, resp: aiohttp.ClientResponse, t0: float,
                            headers_ms: float) -> ProbeOutcome:
    """A 200 that is not an event stream (the engine ignored ``stream: true``)."""
    status = resp.status
    body = (await read_capped(resp, JSON_BODY_MAX)).decode("utf-8", "replace")
    elapsed_ms = (time.monotonic() - t0) * 1000.0
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    text = adapter.read_full_answer(doc) if doc is not None else None
    if text is not None:
        return ProbeOutcome(True, elapsed_ms, probe_pb2.FAILURE_KIND_UNSPECIFIED, status,
                            "non-streaming answer", headers_ms, text)
    if is_engine_fatal_text(body):
        return fail(probe_pb2.FAILURE_KIND_ENGINE_FATAL, status, f"fatal error in body: {body}",
                    headers_ms)
    return fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"200 without a token: {body}", headers_ms)


async def run_probe(
    session: aiohttp.ClientSession,
    adapter: EngineAdapter,
    base_url: str,
    model: str | None,
    timeout_s: float,
    *,
    deep_prompt: str | None = None,
    max_tokens: int = 1,
) -> ProbeOutcome:
    """Send one greedy streaming completion through ``adapter`` and time its first token.

    The request carries the probe header (:data:`PROBE_HEADER`), a fresh cache salt or random
    prompt prefix (:meth:`EngineAdapter.prompt_and_salt`) and ``max_tokens`` (1 for a regular
    probe). TTFT is measured on ``time.monotonic()`` from just before the request is sent to the
    first stream chunk that carries generated content (a role-only or empty chunk is not a
    token). A regular probe closes the response right after that token (the engine frees the
    slot); a deep check (``deep_prompt`` given) reads the whole answer into ``text``.

    Args:
        timeout_s: deadline for the whole probe, in seconds (connect, headers and tokens).

    Returns:
        A :class:`ProbeOutcome`. Failure kinds: TIMEOUT (no token by the deadline, also when
        200 headers arrived and then nothing, as a frozen vLLM does), CONNECT (refused, reset
        or DNS failure before a response), HTTP_STATUS (non-200, status kept; a 429 is load,
        not death), ENGINE_FATAL (a body or stream chunk names a fatal engine error; wins over
        HTTP_STATUS), BAD_OUTPUT (200 but no token before the stream ended, or unparseable).

    Never raises for engine behaviour; only ``asyncio.CancelledError`` propagates.
    """
    prompt, salt = adapter.prompt_and_salt(deep_prompt)
    req = adapter.probe_request(model, prompt, salt, max_tokens)
    url = base_url.rstrip("/") + req.path
    headers = {PROBE_HEADER: PROBE_HEADER_VALUE}
    status = 0
    headers_ms: float | None = None
    t0 = time.monotonic()
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            async with session.post(
                url, json=req.body, headers=headers, timeout=aiohttp.ClientTimeout(total=None)
            ) as resp:
                status = resp.status
                headers_ms = (time.monotonic() - t0) * 1000.0
                try:
                    if status != 200:
                        text = (await read_capped(resp, ERROR_BODY_MAX)).decode("utf-8", "replace")
                        kind = (probe_pb2.FAILURE_KIND_ENGINE_FATAL if is_engine_fatal_text(text)
                                else probe_pb2.FAILURE_KIND_HTTP_STATUS)
                        what = " (engine overloaded: load, not death)" if status == 429 else ""
                        return fail(kind, status, f"HTTP {status}{what}: {text}", headers_ms)
                    ctype = resp.headers.get("content-type", "text/event-stream")
                    if "text/event-stream" not in ctype:
                        return await _read_json_answer(adapter, resp, t0, headers_ms)
                    return await _read_sse(adapter, resp, t0, headers_ms, deep_prompt is not None)
                finally:
                    # Abort the request at once (the engine frees the slot); never reuse it.
                    resp.close()
    except TimeoutError:
        limit_ms = timeout_s * 1000
        if not deadline.expired():
            # A timeout raised by the transport, not by our deadline.
            if status == 0:
                return fail(probe_pb2.FAILURE_KIND_CONNECT, 0, f"POST {url}: transport timeout")
            return fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"POST {url}: transport timeout",
                        headers_ms)
        if status == 0:
            return fail(probe_pb2.FAILURE_KIND_TIMEOUT, 0, f"no response headers within {limit_ms:.0f} ms")
        if status != 200:
            return fail(probe_pb2.FAILURE_KIND_HTTP_STATUS, status,
                        f"HTTP {status}: body not read in time", headers_ms)
        return fail(
            probe_pb2.FAILURE_KIND_TIMEOUT,
            status,
            f"200 headers after {headers_ms:.0f} ms, no token within {limit_ms:.0f} ms",
            headers_ms,
        )
    except (aiohttp.ClientError, OSError) as exc:
        if status == 0:
            return fail(probe_pb2.FAILURE_KIND_CONNECT, 0, f"POST {url}: {exc_text(exc)}")
        if status != 200:
            return fail(probe_pb2.FAILURE_KIND_HTTP_STATUS, status, f"HTTP {status}: {exc_text(exc)}",
                        headers_ms)
        return fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"stream broken: {exc_text(exc)}",
                    headers_ms)
    except (ValueError, UnicodeError) as exc:  # e.g. an over-long SSE line
        return fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"bad stream: {exc_text(exc)}", headers_ms)
