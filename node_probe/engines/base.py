"""What every engine adapter shares: the load reading, failure classification, HTTP helpers,
Prometheus sample selection and the streaming micro-probe.

An adapter (:class:`EngineAdapter` subclass, one module per engine family) only declares what
differs between engines: the completion endpoint and body of a 1-token probe, how a stream chunk
carries a token or an error, the readiness endpoint, the ``/metrics`` names of its load signals
(:class:`MetricSpec`) and how it defeats prefix caching (a cache-salt field or a random prefix).
The probe itself (:func:`run_probe`) and the metric parsing (:func:`parse_with_spec`) are common.

Facts these follow (checked against real vLLM 0.32.0 responses, ``shared/fixtures/vllm-0.32.0-cpu``):
a frozen engine still sends its 200 headers at once and then nothing; a chat stream's first chunk
carries only the role; a dead engine answers 500 with "EngineCore encountered an issue".
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
import string
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import aiohttp

from node_probe.proto import probe_pb2

__all__ = [
    "ENGINE_FATAL_PATTERN",
    "PROBE_HEADER",
    "EngineAdapter",
    "EngineLoadReading",
    "EngineRequestError",
    "GroupLoad",
    "MetricSpec",
    "ProbeOutcome",
    "ProbeRequest",
    "Sel",
    "fetch_metrics_text",
    "get_text",
    "is_engine_fatal_text",
    "parse_with_spec",
    "run_probe",
]

#: Header sent with every micro-probe so engines and gateways can exclude probes from their
#: statistics (the simulated engine counts them separately).
PROBE_HEADER = ("x-sentinel-probe", "1")

#: Text that marks an unrecoverable engine error, in a response body or an SSE error chunk.
ENGINE_FATAL_PATTERN = re.compile(
    r"cuda error|cudaerror|illegal memory access|out of memory|enginecore encountered an issue"
    r"|engine[ _]?dead|enginecore died|nccl error|cublas_status|device-side assert"
    r"|uncorrectable ecc",
    re.IGNORECASE,
)

DETAIL_MAX = 300
ERROR_BODY_MAX = 64 * 1024
METRICS_BODY_MAX = 16 * 1024 * 1024
JSON_BODY_MAX = 1024 * 1024


def truncate(text: str, limit: int = DETAIL_MAX) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_engine_fatal_text(text: str) -> bool:
    """Return True if ``text`` names an unrecoverable engine error.

    Matches (case-insensitive) "CUDA error", "illegal memory access", "out of memory",
    "EngineCore encountered an issue", "engine dead", "EngineDeadError", "NCCL error",
    "CUBLAS_STATUS_...", "device-side assert" and "uncorrectable ECC".
    """
    return bool(ENGINE_FATAL_PATTERN.search(text))


def exc_text(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------------------------
# Load reading


@dataclass(frozen=True)
class GroupLoad:
    """Load of one engine instance behind the endpoint (one value of the adapter's group label,
    e.g. vLLM's ``engine`` label under data parallelism; ``""`` when there is no such label).

    Attributes:
        running: requests being processed by this instance (``None``: unknown).
        waiting: requests queued at this instance (``None``: unknown).
        progress: a counter that advances with every engine step (vLLM generated + prompt
            tokens, TGI successful batch forwards, TensorRT-LLM iterations); ``None`` when the
            engine exposes none, which disables stall detection for this instance.
    """

    running: float | None = None
    waiting: float | None = None
    progress: float | None = None


@dataclass(frozen=True)
class EngineLoadReading:
    """Engine load read from one ``/metrics`` scrape. ``None`` means unknown (never 0).

    Attributes:
        requests_waiting: requests queued in the engine (summed over instances).
        requests_running: requests being decoded (summed over instances).
        kv_cache_usage_ratio: KV-cache usage, 0..1 (max over instances).
        prefix_cache_hit_ratio: prefix-cache hits / queries since engine start, 0..1; ``None``
            while there were no queries or the engine does not expose them.
        generation_tokens_total: cumulative generated tokens (counter).
        kv_cache_metric: name of the metric the KV value came from, ``""`` if none.
        groups: per-instance running/waiting/progress, keyed by the group label's value.
        progress_metric: name(s) of the metric(s) ``GroupLoad.progress`` comes from, ``""``
            when the engine exposes no per-step progress counter.
    """

    requests_waiting: float | None = None
    requests_running: float | None = None
    kv_cache_usage_ratio: float | None = None
    prefix_cache_hit_ratio: float | None = None
    generation_tokens_total: float | None = None
    kv_cache_metric: str = ""
    groups: Mapping[str, GroupLoad] = field(default_factory=dict, compare=False)
    progress_metric: str = field(default="", compare=False)

    @property
    def stall_capable(self) -> bool:
        """True if at least one instance exposes a progress counter (stall detection works)."""
        return any(g.progress is not None for g in self.groups.values())


@dataclass(frozen=True)
class Sel:
    """Selects the samples of metric ``name`` whose labels include every ``labels`` pair."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.labels)

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        inner = ",".join(f'{k}="{v}"' for k, v in self.labels)
        return f"{self.name}{{{inner}}}"


def sel(name: str, **labels: str) -> Sel:
    return Sel(name, tuple(sorted(labels.items())))


@dataclass(frozen=True)
class MetricSpec:
    """Where an engine family keeps its load signals in ``/metrics``.

    Each field is a tuple of alternatives in order of preference: the first alternative that has
    samples wins and the others are never added to it (so a metric renamed between versions and
    exposed under both names counts once).

    Attributes:
        running, waiting: gauges; per instance the max over duplicate series (e.g. one per
            tensor-parallel rank), then summed over instances.
        kv_usage: ratio gauges 0..1 (max over all series).
        kv_used_total: ``(used, total)`` gauge pairs giving the ratio when no ratio gauge exists.
        prefix_pairs: ``(queries, hits)`` counter pairs (summed) giving the hit ratio.
        prefix_gauges: hit-ratio gauges 0..1, used when no counter pair exists.
        generation_tokens: generated-token counters (summed).
        progress: alternatives for the per-step progress counter; each alternative is a tuple of
            selectors whose samples are all summed (e.g. generated + prompt tokens).
        group_label: label whose values identify engine instances (``None``: one instance).
    """

    running: tuple[Sel, ...] = ()
    waiting: tuple[Sel, ...] = ()
    kv_usage: tuple[Sel, ...] = ()
    kv_used_total: tuple[tuple[Sel, Sel], ...] = ()
    prefix_pairs: tuple[tuple[Sel, Sel], ...] = ()
    prefix_gauges: tuple[Sel, ...] = ()
    generation_tokens: tuple[Sel, ...] = ()
    progress: tuple[tuple[Sel, ...], ...] = ()
    group_label: str | None = None

    def names(self) -> frozenset[str]:
        sels: list[Sel] = [*self.running, *self.waiting, *self.kv_usage, *self.prefix_gauges,
                           *self.generation_tokens]
        for pair in (*self.kv_used_total, *self.prefix_pairs):
            sels.extend(pair)
        for alt in self.progress:
            sels.extend(alt)
        return frozenset(s.name for s in sels)


@dataclass(frozen=True)
class _Sample:
    name: str
    labels: Mapping[str, str]
    value: float


_SAMPLE_RE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_wanted_prefixes: dict[frozenset[str], tuple[str, ...]] = {}


def _prefixes(wanted: frozenset[str]) -> tuple[str, ...]:
    found = _wanted_prefixes.get(wanted)
    if found is None:
        found = tuple(n + sep for n in sorted(wanted) for sep in ("{", " ", "\t"))
        _wanted_prefixes[wanted] = found
    return found


def _parse_labels(inner: str, line: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    inner = inner.rstrip()
    while pos < len(inner):
        m = _LABEL_RE.match(inner, pos)
        if m is None:
            raise ValueError(f"invalid labels in metric line: {line!r}")
        value = m.group(2)
        if "\\" in value:
            value = re.sub(r"\\[\\\"n]", lambda x: _UNESCAPE[x.group(0)], value)
        labels[m.group(1)] = value
        pos = m.end()
    return labels


def _samples(text: str, wanted: frozenset[str]) -> dict[str, list[_Sample]]:
    """Samples of the ``wanted`` metric names only. A vLLM page is ~57 KB and 92 families: a
    full Prometheus parse costs milliseconds of event-loop time at every scrape, this one
    (prefix pick of the wanted lines, then a strict parse of those) ~0.1 ms."""
    out: dict[str, list[_Sample]] = {}
    prefixes = _prefixes(wanted)
    for line in text.splitlines():
        if not line.startswith(prefixes):
            continue
        sm = _SAMPLE_RE.fullmatch(line)
        if sm is None:
            raise ValueError(f"invalid metric line: {line!r}")
        name, inner, raw = sm.group(1), sm.group(2), sm.group(3)
        if name not in wanted:
            continue
        value = float(raw)  # ValueError for garbage; "NaN", "+Inf" parse and are dropped below
        if not math.isfinite(value):
            continue
        labels = _parse_labels(inner, line) if inner else {}
        out.setdefault(name, []).append(_Sample(name, labels, value))
    return out


def _select(samples: dict[str, list[_Sample]], sel_: Sel) -> list[_Sample]:
    return [s for s in samples.get(sel_.name, ()) if sel_.matches(s.labels)]


def _first(samples: dict[str, list[_Sample]], alts: Iterable[Sel]) -> tuple[Sel, list[_Sample]] | None:
    for alt in alts:
        found = _select(samples, alt)
        if found:
            return alt, found
    return None


def parse_with_spec(text: str, spec: MetricSpec) -> EngineLoadReading:
    """Parse Prometheus exposition text into a reading, following ``spec``.

    NaN/Inf samples are ignored; missing metrics give ``None``. Only the lines of the metrics
    named in ``spec`` are parsed (the rest of the page is skipped for speed, not validated).

    Raises:
        ValueError: the selected lines are not valid Prometheus exposition format.
    """
    samples = _samples(text, spec.names())
    glabel = spec.group_label

    def group_of(s: _Sample) -> str:
        return s.labels.get(glabel, "") if glabel else ""

    def per_group_max(alts: tuple[Sel, ...]) -> dict[str, float] | None:
        found = _first(samples, alts)
        if found is None:
            return None
        out: dict[str, float] = {}
        for s in found[1]:
            g = group_of(s)
            out[g] = max(out.get(g, s.value), s.value)
        return out

    running = per_group_max(spec.running)
    waiting = per_group_max(spec.waiting)

    progress: dict[str, float] | None = None
    progress_metric = ""
    for alt in spec.progress:
        found_any = False
        acc: dict[str, float] = {}
        for sel_ in alt:
            for s in _select(samples, sel_):
                found_any = True
                g = group_of(s)
                acc[g] = acc.get(g, 0.0) + s.value
        if found_any:
            progress = acc
            progress_metric = "+".join(str(s) for s in alt if _select(samples, s))
            break

    groups: dict[str, GroupLoad] = {}
    for g in set(running or ()) | set(waiting or ()) | set(progress or ()):
        groups[g] = GroupLoad(
            running=None if running is None else running.get(g),
            waiting=None if waiting is None else waiting.get(g),
            progress=None if progress is None else progress.get(g),
        )

    kv_ratio: float | None = None
    kv_name = ""
    found = _first(samples, spec.kv_usage)
    if found is not None:
        kv_name = str(found[0])
        kv_ratio = min(1.0, max(0.0, max(s.value for s in found[1])))
    else:
        for used_sel, total_sel in spec.kv_used_total:
            used = _select(samples, used_sel)
            total = _select(samples, total_sel)
            if used and total:
                tot = sum(s.value for s in total)
                if tot > 0:
                    kv_ratio = min(1.0, max(0.0, sum(s.value for s in used) / tot))
                    kv_name = f"{used_sel}/{total_sel}"
                break

    prefix_ratio: float | None = None
    for queries_sel, hits_sel in spec.prefix_pairs:
        queries = _select(samples, queries_sel)
        if queries:
            q = sum(s.value for s in queries)
            hits = _select(samples, hits_sel)
            if q > 0 and hits:
                prefix_ratio = min(1.0, max(0.0, sum(s.value for s in hits) / q))
            break
    else:
        gauge = _first(samples, spec.prefix_gauges)
        if gauge is not None:
            vals = [s.value for s in gauge[1]]
            prefix_ratio = min(1.0, max(0.0, sum(vals) / len(vals)))

    gen = _first(samples, spec.generation_tokens)
    return EngineLoadReading(
        requests_waiting=None if waiting is None else float(sum(waiting.values())),
        requests_running=None if running is None else float(sum(running.values())),
        kv_cache_usage_ratio=kv_ratio,
        prefix_cache_hit_ratio=prefix_ratio,
        generation_tokens_total=None if gen is None else float(sum(s.value for s in gen[1])),
        kv_cache_metric=kv_name,
        groups=groups,
        progress_metric=progress_metric,
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


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total < limit:
        chunk = await resp.content.read(min(65536, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


async def get_text(
    session: aiohttp.ClientSession,
    url: str,
    timeout_s: float,
    limit: int = JSON_BODY_MAX,
    *,
    method: str = "GET",
    ok_statuses: tuple[int, ...] = (200,),
) -> tuple[int, str]:
    """Request ``url`` and return ``(status, body)``; raises :class:`EngineRequestError` for
    CONNECT, TIMEOUT and, for a status not in ``ok_statuses``, HTTP_STATUS or ENGINE_FATAL."""
    status = 0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.request(
                method, url, timeout=aiohttp.ClientTimeout(total=None)
            ) as resp:
                status = resp.status
                body = (await read_capped(resp, limit)).decode("utf-8", "replace")
    except TimeoutError as exc:
        raise EngineRequestError(
            probe_pb2.FAILURE_KIND_TIMEOUT,
            f"{method} {url}: no complete answer within {timeout_s * 1000:.0f} ms",
            status,
        ) from exc
    except (aiohttp.ClientError, OSError) as exc:
        kind = probe_pb2.FAILURE_KIND_CONNECT if status == 0 else probe_pb2.FAILURE_KIND_BAD_OUTPUT
        raise EngineRequestError(kind, f"{method} {url}: {exc_text(exc)}", status) from exc
    if status not in ok_statuses:
        kind = (
            probe_pb2.FAILURE_KIND_ENGINE_FATAL
            if is_engine_fatal_text(body)
            else probe_pb2.FAILURE_KIND_HTTP_STATUS
        )
        raise EngineRequestError(kind, f"{method} {url}: HTTP {status}: {truncate(body)}", status)
    return status, body


async def fetch_metrics_text(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str:
    """GET a ``/metrics`` page (raises :class:`EngineRequestError`)."""
    return (await get_text(session, url, timeout_s, METRICS_BODY_MAX))[1]


# --------------------------------------------------------------------------------------------
# Probe outcome and adapters


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
    failure: int
    http_status: int
    detail: str
    headers_ms: float | None = None
    text: str = ""

    @property
    def answered(self) -> bool:
        """True if the engine sent an HTTP response (its HTTP server is up)."""
        return self.http_status != 0


def fail(kind: int, status: int, detail: str, headers_ms: float | None = None) -> ProbeOutcome:
    return ProbeOutcome(False, None, kind, status, truncate(detail), headers_ms)


@dataclass(frozen=True)
class ProbeRequest:
    """One probe request: POST ``path`` with JSON ``body``."""

    path: str
    body: dict[str, Any]


#: Verdicts of :meth:`EngineAdapter.read_chunk`.
SKIP = None


@dataclass(frozen=True)
class ChunkToken:
    text: str
    final: bool = False


@dataclass(frozen=True)
class ChunkError:
    message: str


def random_word(n: int = 6) -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(n))


class EngineAdapter:
    """Base class of engine adapters. Subclasses set the class attributes and override the
    request/chunk methods; instances are stateless and shared.

    Attributes:
        kind: adapter name (``--engine-kind``).
        readiness_path: GET path that answers 200 once the engine serves (e.g. ``/health``).
        metrics_path: path of the Prometheus page on the metrics URL.
        cache_salt_field: request field that salts the prefix cache (``None``: the adapter puts
            a random prefix in front of the prompt instead).
        needs_model: the probe request names a model (discovered when not configured).
        stall_detection: the engine exposes a per-step progress counter in ``metrics_spec``.
        metrics_spec: where the load signals are (:class:`MetricSpec`).
    """

    kind = "base"
    readiness_path = "/health"
    metrics_path = "/metrics"
    cache_salt_field: str | None = None
    needs_model = True
    stall_detection = True
    metrics_spec = MetricSpec()
    #: prompt of a regular probe when the engine salts its cache (a short fixed text).
    probe_prompt = "Hi"

    # -- metrics --------------------------------------------------------------------------------

    def metrics_url(self, base_url: str, override: str | None = None) -> str:
        """URL of the engine's Prometheus page (``override`` wins when given)."""
        return override or base_url.rstrip("/") + self.metrics_path

    def parse_metrics(self, text: str) -> EngineLoadReading:
        """Parse the engine's ``/metrics`` text (raises ``ValueError`` for invalid text)."""
        return parse_with_spec(text, self.metrics_spec)

    # -- model ----------------------------------------------------------------------------------

    async def discover_model(
        self, session: aiohttp.ClientSession, base_url: str, timeout_s: float
    ) -> str | None:
        """Return the model id to probe (``None`` when the engine needs none). Raises
        :class:`EngineRequestError` when discovery fails or finds no model."""
        return None

    # -- probe ----------------------------------------------------------------------------------

    def prompt_and_salt(self, deep_prompt: str | None = None) -> tuple[str, str | None]:
        """The prompt of one probe and its cache salt (``None`` when the adapter has no salt
        field). Regular probes defeat prefix caching with a fresh salt or, without a salt
        field, a random prefix; a deep-check prompt is never altered (a prefix would change
        its answer), only salted where the engine can."""
        salt = secrets.token_hex(8) if self.cache_salt_field else None
        if deep_prompt is not None:
            return deep_prompt, salt
        if salt is not None:
            return f"{random_word(4)}: {self.probe_prompt}", salt
        # No salt field: a random prefix of several words, longer than one KV block of the
        # usual 16 tokens, so no cached block can match the prompt.
        return " ".join(random_word(6) for _ in range(8)) + ": " + self.probe_prompt, None

    def probe_request(self, model: str | None, prompt: str, salt: str | None,
                      max_tokens: int) -> ProbeRequest:
        """The completion request of one probe (greedy, streaming)."""
        raise NotImplementedError

    def read_chunk(self, doc: Any) -> ChunkToken | ChunkError | None:
        """Classify one parsed stream chunk: a token (with its text), an error, or ``None``
        for a chunk that carries no generated content (role-only, empty, usage)."""
        raise NotImplementedError

    def read_full_answer(self, doc: Any) -> str | None:
        """Text of a non-streaming answer (an engine that ignored ``stream``), ``None`` if it
        carries none."""
        return None


# --------------------------------------------------------------------------------------------
# The probe


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


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
    headers = {PROBE_HEADER[0]: PROBE_HEADER[1]}
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
