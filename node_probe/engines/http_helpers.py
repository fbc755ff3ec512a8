"""HTTP helpers for talking to an engine: bounded body reads, :func:`get_text` with failure
classification (:class:`EngineRequestError`), and the engine-fatal text check.

Body caps (bytes): error bodies :data:`ERROR_BODY_MAX`, JSON answers :data:`JSON_BODY_MAX`,
``/metrics`` pages :data:`METRICS_BODY_MAX`; details in errors are cut to :data:`DETAIL_MAX`
characters.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp

from node_probe.proto import probe_pb2

__all__ = [
    "DETAIL_MAX",
    "ENGINE_FATAL_PATTERN",
    "ERROR_BODY_MAX",
    "JSON_BODY_MAX",
    "METRICS_BODY_MAX",
    "EngineRequestError",
    "exc_text",
    "fetch_metrics_text",
    "get_text",
    "is_engine_fatal_text",
    "read_capped",
    "truncate",
]

#: Text that marks an unrecoverable engine error, in a response body or an SSE error chunk.
ENGINE_FATAL_PATTERN = re.compile(
    r"cuda error|cudaerror|illegal memory access|out of memory|enginecore encountered an issue"
    r"|engine[ _]?dead|enginecore died|nccl error|cublas_status|device-side assert"
    r"|uncorrectable ecc",
    re.IGNORECASE,
)


#: Longest detail kept in an error or probe outcome, in characters.
DETAIL_MAX = 300
#: Bytes read of a non-200 body (enough to find a fatal-error text).
ERROR_BODY_MAX = 64 * 1024
#: Bytes read of a ``/metrics`` page.
METRICS_BODY_MAX = 16 * 1024 * 1024
#: Bytes read of a JSON answer (model lists, a non-streaming completion).
JSON_BODY_MAX = 1024 * 1024


def truncate(text: str, limit: int = DETAIL_MAX) -> str:
    """``text`` with runs of whitespace collapsed, cut to ``limit`` characters (``...`` marks a cut)."""
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
    """``"TypeName: message"`` of an exception (just the type name when the message is empty)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class EngineRequestError(Exception):
    """A request to the engine failed.

    Attributes:
        kind: ``probe_pb2.FailureKind`` value (CONNECT, TIMEOUT, HTTP_STATUS, ENGINE_FATAL,
            BAD_OUTPUT).
        http_status: HTTP status if a response arrived, else 0.
        detail: human-readable cause.
    """

    def __init__(self, kind: probe_pb2.FailureKind, detail: str, http_status: int = 0) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.http_status = http_status

    @property
    def answered(self) -> bool:
        """True if the engine sent an HTTP response (the process is up and serving HTTP)."""
        return self.http_status != 0


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most ``limit`` bytes of the body (the rest is left unread)."""
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
