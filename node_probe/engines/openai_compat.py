"""Adapter for OpenAI-compatible inference servers (vLLM first; SGLang's load gauges too).

Three things the agent needs from an engine live here:

* :func:`parse_metrics` turns the engine's Prometheus ``/metrics`` text into an
  :class:`EngineLoadReading` (requests waiting/running, KV-cache usage, prefix-cache hit ratio,
  generated-token counter). Unknown values are ``None``, never 0.
* :func:`micro_probe` sends one 1-token streaming completion and measures the time to the first
  SSE chunk that carries generated text (TTFT). Every engine behaviour (refusal, hang, error
  status, fatal engine error, malformed stream) becomes a classified :class:`ProbeOutcome`; the
  function does not raise for anything the engine does.
* :func:`fetch_models` / :func:`fetch_metrics` do the plain GETs and raise
  :class:`EngineRequestError` (with the same failure classification) when they fail.

Facts these follow (checked against real vLLM 0.32.0 responses, see
``shared/fixtures/vllm-0.32.0-cpu``): a frozen engine still sends its 200 headers at once and
then nothing; a chat stream's first chunk carries only the role; a dead engine answers 500 with
"EngineCore encountered an issue"; the KV gauge was renamed from ``vllm:gpu_cache_usage_perc`` to
``vllm:kv_cache_usage_perc``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
import string
import time
from dataclasses import dataclass
from typing import Any, Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from node_probe.proto import probe_pb2

__all__ = [
    "ENGINE_FATAL_PATTERN",
    "PROBE_HEADER",
    "EngineLoadReading",
    "EngineRequestError",
    "ProbeOutcome",
    "fetch_metrics",
    "fetch_models",
    "is_engine_fatal_text",
    "micro_probe",
    "parse_metrics",
]

#: Header sent with every micro-probe so engines/proxies can tell probes from user traffic.
PROBE_HEADER = ("x-sentinel-probe", "1")

#: Text that marks an unrecoverable engine error, in a response body or an SSE error chunk.
ENGINE_FATAL_PATTERN = re.compile(
    r"cuda error|illegal memory access|out of memory|enginecore encountered an issue"
    r"|engine[ _]?dead",
    re.IGNORECASE,
)

_DETAIL_MAX = 300
_ERROR_BODY_MAX = 64 * 1024
_METRICS_BODY_MAX = 16 * 1024 * 1024
_JSON_BODY_MAX = 1024 * 1024

# Metric names, in order of preference within each group (the first name that has samples wins;
# the others are never added to it, so a renamed metric exposed under both names counts once).
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_GEN_TOKENS = ("vllm:generation_tokens_total",)
_PREFIX_PAIRS = (
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
    ("vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total"),
)
_PREFIX_RATIO_GAUGES = ("sglang:cache_hit_rate",)

_WANTED = frozenset(
    _RUNNING
    + _WAITING
    + _KV_USAGE
    + _GEN_TOKENS
    + tuple(n for pair in _PREFIX_PAIRS for n in pair)
    + _PREFIX_RATIO_GAUGES
)


def _truncate(text: str, limit: int = _DETAIL_MAX) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_engine_fatal_text(text: str) -> bool:
    """Return True if ``text`` names an unrecoverable engine error.

    Matches (case-insensitive) "CUDA error", "illegal memory access", "out of memory",
    "EngineCore encountered an issue", "engine dead" and "EngineDeadError".
    """
    return bool(ENGINE_FATAL_PATTERN.search(text))


# --------------------------------------------------------------------------------------------
# /metrics


@dataclass(frozen=True)
class EngineLoadReading:
    """Engine load read from one ``/metrics`` scrape. ``None`` means unknown (never 0).

    Attributes:
        requests_waiting: requests queued in the engine (summed over ``engine`` label values).
        requests_running: requests being decoded (summed over ``engine`` label values).
        kv_cache_usage_ratio: KV-cache usage, 0..1 (max over ``engine`` label values).
        prefix_cache_hit_ratio: prefix-cache hits / queries since engine start, 0..1; ``None``
            while there were no queries or the engine does not expose the counters.
        generation_tokens_total: cumulative generated tokens (counter; proves decode progress).
        kv_cache_metric: name of the metric the KV value came from, ``""`` if none.
    """

    requests_waiting: float | None = None
    requests_running: float | None = None
    kv_cache_usage_ratio: float | None = None
    prefix_cache_hit_ratio: float | None = None
    generation_tokens_total: float | None = None
    kv_cache_metric: str = ""


def _prefilter(text: str) -> str:
    """Keep only the sample lines we read; parsing a full vLLM /metrics page (~57 KB, 92
    families) costs ~9 ms of event-loop time, the filtered page well under 1 ms."""
    kept = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head = line.split("{", 1)[0].split(None, 1)
        if head and head[0] in _WANTED:
            kept.append(line)
    kept.append("")
    return "\n".join(kept)


def _collect_samples(text: str) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(_prefilter(text)):
        for sample in family.samples:
            if sample.name not in _WANTED:
                continue
            value = float(sample.value)
            if math.isfinite(value):
                values.setdefault(sample.name, []).append(value)
    return values


def _first(values: dict[str, list[float]], names: Iterable[str]) -> tuple[str, list[float]] | None:
    for name in names:
        if values.get(name):
            return name, values[name]
    return None


def parse_metrics(text: str) -> EngineLoadReading:
    """Parse Prometheus exposition text from an engine's ``/metrics`` into a reading.

    Supports vLLM V1 names (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_{queries,hits}_total``,
    ``vllm:generation_tokens_total``), the older ``vllm:gpu_cache_usage_perc`` and
    ``vllm:gpu_prefix_cache_*`` names (used only when the new name is absent, so a metric exposed
    under both names counts once), and SGLang's ``sglang:num_running_reqs``,
    ``sglang:num_queue_reqs``, ``sglang:token_usage``, ``sglang:cache_hit_rate``. With several
    ``engine`` (data-parallel) label values, running/waiting/token counts are summed and KV usage
    is the maximum. NaN/Inf samples are ignored. Missing metrics give ``None``. Only the lines
    of the metrics above are parsed (the rest of a vLLM page is skipped for speed and is not
    validated).

    Raises:
        ValueError: the text is not valid Prometheus exposition format.
    """
    values = _collect_samples(text)

    def summed(names: Iterable[str]) -> float | None:
        found = _first(values, names)
        return None if found is None else float(sum(found[1]))

    kv_ratio: float | None = None
    kv_name = ""
    found = _first(values, _KV_USAGE)
    if found is not None:
        kv_name = found[0]
        kv_ratio = min(1.0, max(0.0, max(found[1])))

    prefix_ratio: float | None = None
    for queries_name, hits_name in _PREFIX_PAIRS:
        if values.get(queries_name):
            queries = sum(values[queries_name])
            hits = values.get(hits_name)
            if queries > 0 and hits:
                prefix_ratio = min(1.0, max(0.0, sum(hits) / queries))
            break
    else:
        gauge = _first(values, _PREFIX_RATIO_GAUGES)
        if gauge is not None:
            prefix_ratio = min(1.0, max(0.0, sum(gauge[1]) / len(gauge[1])))

    return EngineLoadReading(
        requests_waiting=summed(_WAITING),
        requests_running=summed(_RUNNING),
        kv_cache_usage_ratio=kv_ratio,
        prefix_cache_hit_ratio=prefix_ratio,
        generation_tokens_total=summed(_GEN_TOKENS),
        kv_cache_metric=kv_name,
    )


# --------------------------------------------------------------------------------------------
# Plain GETs


class EngineRequestError(Exception):
    """A request to the engine failed.

    Attributes:
        kind: ``probe_pb2.FailureKind`` value (CONNECT, TIMEOUT, HTTP_STATUS, ENGINE_FATAL,
            BAD_OUTPUT).
        http_status: HTTP status if a response arrived, else 0.
        detail: human-readable cause.
    """

    def __init__(self, kind: int, detail: str, http_status: int = 0) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.http_status = http_status

    @property
    def answered(self) -> bool:
        """True if the engine sent an HTTP response (the process is up and serving HTTP)."""
        return self.http_status != 0


def _exc_text(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total < limit:
        chunk = await resp.content.read(min(65536, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


async def _get_text(
    session: aiohttp.ClientSession, url: str, timeout_s: float, limit: int
) -> str:
    status = 0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=None)) as resp:
                status = resp.status
                body = (await _read_capped(resp, limit)).decode("utf-8", "replace")
    except TimeoutError as exc:
        raise EngineRequestError(
            probe_pb2.FAILURE_KIND_TIMEOUT,
            f"GET {url}: no complete answer within {timeout_s * 1000:.0f} ms",
            status,
        ) from exc
    except (aiohttp.ClientError, OSError) as exc:
        kind = probe_pb2.FAILURE_KIND_CONNECT if status == 0 else probe_pb2.FAILURE_KIND_BAD_OUTPUT
        raise EngineRequestError(kind, f"GET {url}: {_exc_text(exc)}", status) from exc
    if status != 200:
        kind = (
            probe_pb2.FAILURE_KIND_ENGINE_FATAL
            if is_engine_fatal_text(body)
            else probe_pb2.FAILURE_KIND_HTTP_STATUS
        )
        raise EngineRequestError(kind, f"GET {url}: HTTP {status}: {_truncate(body)}", status)
    return body


async def fetch_metrics(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float
) -> EngineLoadReading:
    """GET ``{base_url}/metrics`` and parse it with :func:`parse_metrics`.

    Args:
        timeout_s: deadline for the whole request, in seconds.

    Raises:
        EngineRequestError: CONNECT (refused/reset/DNS), TIMEOUT, HTTP_STATUS (non-200),
            ENGINE_FATAL (non-200 whose body names a fatal error) or BAD_OUTPUT (unparseable).
    """
    url = base_url.rstrip("/") + "/metrics"
    text = await _get_text(session, url, timeout_s, _METRICS_BODY_MAX)
    try:
        return parse_metrics(text)
    except ValueError as exc:
        raise EngineRequestError(
            probe_pb2.FAILURE_KIND_BAD_OUTPUT, f"GET {url}: unparseable metrics: {exc}", 200
        ) from exc


async def fetch_models(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float
) -> list[str]:
    """GET ``{base_url}/v1/models`` and return the served model ids, in the engine's order.

    The first id is the one to probe when no model is configured. The list may be empty.

    Args:
        timeout_s: deadline for the whole request, in seconds.

    Raises:
        EngineRequestError: CONNECT, TIMEOUT, HTTP_STATUS/ENGINE_FATAL (non-200) or BAD_OUTPUT
            (not an OpenAI model list).
    """
    url = base_url.rstrip("/") + "/v1/models"
    text = await _get_text(session, url, timeout_s, _JSON_BODY_MAX)
    try:
        doc = json.loads(text)
        return [str(item["id"]) for item in doc["data"] if isinstance(item, dict) and "id" in item]
    except (ValueError, KeyError, TypeError) as exc:
        raise EngineRequestError(
            probe_pb2.FAILURE_KIND_BAD_OUTPUT,
            f"GET {url}: not a model list: {_truncate(text)}",
            200,
        ) from exc


# --------------------------------------------------------------------------------------------
# Micro-inference probe


@dataclass(frozen=True)
class ProbeOutcome:
    """Result of one :func:`micro_probe`.

    Attributes:
        ok: a token arrived within the deadline.
        ttft_ms: ms from sending the request to the first SSE chunk carrying generated text
            (``None`` unless ok).
        failure: ``probe_pb2.FailureKind`` value; ``FAILURE_KIND_UNSPECIFIED`` when ok.
        http_status: HTTP status of the response, 0 if none arrived.
        detail: human-readable explanation (empty when ok on a normal stream).
    """

    ok: bool
    ttft_ms: float | None
    failure: int
    http_status: int
    detail: str

    @property
    def answered(self) -> bool:
        """True if the engine sent an HTTP response (its HTTP server is up)."""
        return self.http_status != 0


def _fail(kind: int, status: int, detail: str) -> ProbeOutcome:
    return ProbeOutcome(False, None, kind, status, _truncate(detail))


def _random_prompt() -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(4)) + ": hi"


def _choice_has_text(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    text = choice.get("text")
    if isinstance(text, str) and text:
        return True
    for key in ("delta", "message"):
        part = choice.get(key)
        if isinstance(part, dict):
            for field in ("content", "reasoning_content", "reasoning"):
                value = part.get(field)
                if isinstance(value, str) and value:
                    return True
    return False


def _has_token(doc: Any) -> bool:
    choices = doc.get("choices") if isinstance(doc, dict) else None
    return isinstance(choices, list) and any(_choice_has_text(c) for c in choices)


def _error_message(doc: dict[str, Any]) -> str:
    err = doc.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def _classify_event(data: str, status: int) -> ProbeOutcome | bool | None:
    """Return True for a token, an outcome to stop with, or None to keep reading."""
    if data.strip() == "[DONE]":
        return _fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, "stream ended ([DONE]) with no token")
    try:
        doc = json.loads(data)
    except ValueError:
        if is_engine_fatal_text(data):
            return _fail(probe_pb2.FAILURE_KIND_ENGINE_FATAL, status, f"fatal error in stream: {data}")
        return _fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"unparseable SSE data: {data}")
    if _has_token(doc):
        return True
    if is_engine_fatal_text(data):
        return _fail(probe_pb2.FAILURE_KIND_ENGINE_FATAL, status, f"fatal error in stream: {data}")
    if not isinstance(doc, dict):
        return _fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"unexpected SSE data: {data}")
    if "error" in doc:
        return _fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"error chunk: {_error_message(doc)}")
    return None  # role-only / empty / usage chunk: not a token


async def _read_sse(resp: aiohttp.ClientResponse, t0: float) -> ProbeOutcome:
    status = resp.status
    data_lines: list[str] = []

    def dispatch() -> ProbeOutcome | None:
        data = "\n".join(data_lines)
        data_lines.clear()
        verdict = _classify_event(data, status)
        if verdict is True:
            ttft_ms = (time.monotonic() - t0) * 1000.0
            return ProbeOutcome(True, ttft_ms, probe_pb2.FAILURE_KIND_UNSPECIFIED, status, "")
        return verdict or None

    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data_lines and (result := dispatch()) is not None:
                return result
            continue
        if line.startswith(":"):
            continue  # SSE comment / keep-alive
        field, _, value = line.partition(":")
        if field == "data":
            data_lines.append(value[1:] if value.startswith(" ") else value)
    if data_lines and (result := dispatch()) is not None:
        return result
    return _fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, "stream closed with no token")


async def _read_json_answer(resp: aiohttp.ClientResponse, t0: float) -> ProbeOutcome:
    """A 200 that is not an event stream (engine ignored ``stream: true``)."""
    status = resp.status
    body = (await _read_capped(resp, _JSON_BODY_MAX)).decode("utf-8", "replace")
    elapsed_ms = (time.monotonic() - t0) * 1000.0
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if doc is not None and _has_token(doc):
        return ProbeOutcome(
            True, elapsed_ms, probe_pb2.FAILURE_KIND_UNSPECIFIED, status, "non-streaming answer"
        )
    if is_engine_fatal_text(body):
        return _fail(probe_pb2.FAILURE_KIND_ENGINE_FATAL, status, f"fatal error in body: {body}")
    return _fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"200 without a token: {body}")


async def micro_probe(
    session: aiohttp.ClientSession, base_url: str, model: str, timeout_s: float
) -> ProbeOutcome:
    """Send one 1-token streaming completion and time its first generated token.

    POSTs ``{base_url}/v1/completions`` with ``max_tokens: 1``, ``temperature: 0``,
    ``stream: true``, a short random prompt and a random ``cache_salt`` (so neither the prefix
    cache nor a response cache can answer it), and the header ``x-sentinel-probe: 1``. TTFT is
    measured on ``time.monotonic()`` from just before the request is sent to the first SSE
    chunk whose choices carry non-empty text (completions ``text`` or chat ``delta.content``;
    role-only or empty chunks do not count). The response is closed right after that token.

    Args:
        session: shared aiohttp session.
        base_url: engine root, e.g. ``http://127.0.0.1:8000``.
        model: model id to put in the request.
        timeout_s: deadline for the first token, in seconds (covers connect, headers and stream).

    Returns:
        A :class:`ProbeOutcome`. Failure kinds: TIMEOUT (no token by the deadline, also when
        200 headers arrived and then nothing, as a frozen vLLM does), CONNECT (refused, reset
        or DNS failure before a response), HTTP_STATUS (non-200, status kept), ENGINE_FATAL (a
        body or SSE chunk names a fatal engine error; wins over HTTP_STATUS), BAD_OUTPUT (200
        but no token before the stream ended, or unparseable data).

    Never raises for engine behaviour; only ``asyncio.CancelledError`` propagates.
    """
    url = base_url.rstrip("/") + "/v1/completions"
    body = {
        "model": model,
        "prompt": _random_prompt(),
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "cache_salt": secrets.token_hex(8),
    }
    headers = {PROBE_HEADER[0]: PROBE_HEADER[1]}
    status = 0
    headers_ms: float | None = None
    t0 = time.monotonic()
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            async with session.post(
                url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=None)
            ) as resp:
                status = resp.status
                headers_ms = (time.monotonic() - t0) * 1000.0
                try:
                    if status != 200:
                        text = (await _read_capped(resp, _ERROR_BODY_MAX)).decode("utf-8", "replace")
                        if is_engine_fatal_text(text):
                            return _fail(
                                probe_pb2.FAILURE_KIND_ENGINE_FATAL, status, f"HTTP {status}: {text}"
                            )
                        return _fail(probe_pb2.FAILURE_KIND_HTTP_STATUS, status, f"HTTP {status}: {text}")
                    if "text/event-stream" not in resp.headers.get("content-type", "text/event-stream"):
                        return await _read_json_answer(resp, t0)
                    return await _read_sse(resp, t0)
                finally:
                    # Abort the request at once (the engine frees the slot); never reuse it.
                    resp.close()
    except TimeoutError:
        if not deadline.expired():
            # A timeout raised by the transport, not by our deadline.
            if status == 0:
                return _fail(probe_pb2.FAILURE_KIND_CONNECT, 0, f"POST {url}: transport timeout")
            return _fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"POST {url}: transport timeout")
        if status == 0:
            return _fail(
                probe_pb2.FAILURE_KIND_TIMEOUT, 0, f"no response headers within {timeout_s * 1000:.0f} ms"
            )
        if status != 200:
            return _fail(probe_pb2.FAILURE_KIND_HTTP_STATUS, status, f"HTTP {status}: body not read in time")
        return _fail(
            probe_pb2.FAILURE_KIND_TIMEOUT,
            status,
            f"200 headers after {headers_ms:.0f} ms, no token within {timeout_s * 1000:.0f} ms",
        )
    except (aiohttp.ClientError, OSError) as exc:
        if status == 0:
            return _fail(probe_pb2.FAILURE_KIND_CONNECT, 0, f"POST {url}: {_exc_text(exc)}")
        if status != 200:
            return _fail(probe_pb2.FAILURE_KIND_HTTP_STATUS, status, f"HTTP {status}: {_exc_text(exc)}")
        return _fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"stream broken: {_exc_text(exc)}")
    except (ValueError, UnicodeError) as exc:  # e.g. an over-long SSE line
        return _fail(probe_pb2.FAILURE_KIND_BAD_OUTPUT, status, f"bad stream: {_exc_text(exc)}")
