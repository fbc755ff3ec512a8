"""HTTP/1.1 response framing without I/O, for the relay's upstream reads (the hot path).

The parsing is ``httptools`` (llhttp, the parser behind uvicorn and Node.js, fuzzed by its
authors; benchmarks/RESULTS.md: 2-5x faster than the hand-written parser it replaced). This module
keeps the relay's small interface on top of it:

:class:`ResponseReader`: ``feed(bytes) -> list[bytes]`` of body pieces (de-chunked), after
parsing the status line and headers (``status``, ``reason``, ``headers`` once ``head_done``).
Framing: ``Transfer-Encoding: chunked``, ``Content-Length``, or until the connection closes
(:meth:`ResponseReader.eof` says whether the body ended cleanly there). ``complete`` is True once
the whole body was read; bytes after it are ignored. Errors: :class:`HTTPFramingError` on a
malformed head, chunk or length, or a head over 64 KiB (the caller treats it like a reset).
"""
from __future__ import annotations

import httptools

__all__ = ["HTTPFramingError", "ResponseReader", "build_request"]

# The most bytes of a response head (status line and headers), bytes: Envoy's own default
# (max_request_headers_kb 60) plus room; a longer head is refused rather than buffered.
_MAX_HEAD = 64 << 10


class HTTPFramingError(ValueError):
    """The upstream's bytes are not valid HTTP/1.1 response framing."""


class _AfterComplete(Exception):
    """Raised from the parser's callback to stop at the first byte after the response."""


def build_request(method: str, target: str, host: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    """One HTTP/1.1 request with ``Content-Length``; ``headers`` exclude Host/Content-Length."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class ResponseReader:
    """One upstream response, fed the connection's reads in order (the callbacks are llhttp's)."""

    __slots__ = (
        "_out",
        "_parser",
        "_reason",
        "_seen",
        "_until_close",
        "complete",
        "head_done",
        "headers",
        "reason",
        "status",
    )

    def __init__(self) -> None:
        self.head_done = False
        self.status = 0
        self.reason = ""
        self.headers: list[tuple[str, str]] = []
        self.complete = False
        self._reason = b""          # the reason phrase, which llhttp may hand over in pieces
        self._seen = 0              # bytes fed before the head was done
        self._until_close = False   # no length and not chunked: the body ends with the connection
        self._out: list[bytes] = []
        self._parser = httptools.HttpResponseParser(self)

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def feed(self, data: bytes) -> list[bytes]:
        if self.complete:
            return []
        out: list[bytes] = []
        self._out = out
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise HTTPFramingError(f"protocol upgrade (status {self.status}) where a response was due") from None
        except httptools.HttpParserError as e:
            if not self.complete:  # after the response (a second one, data after close): ignored
                why = e.__context__ if isinstance(e, httptools.HttpParserCallbackError) and e.__context__ else e
                raise HTTPFramingError(f"bad response{'' if self.head_done else ' head'}: {why}") from None
        if not self.head_done:
            self._seen += len(data)
            if self._seen > _MAX_HEAD:
                raise HTTPFramingError(f"response head over {_MAX_HEAD} bytes")
        return out

    def eof(self) -> bool:
        """The connection closed: True when the body ended cleanly (read whole, or framed by the
        close itself), False when it was cut (mid-head, mid-chunk, short of its length)."""
        if not self.complete and self.head_done and self._until_close:
            self.complete = True
        return self.complete

    # -- llhttp's callbacks (httptools calls them by name) -------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second response on the same bytes: not ours to read
            raise _AfterComplete

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:  # trailers (after a chunked body) are not kept
            self.headers.append((name.decode("latin-1").strip(), value.decode("latin-1").strip()))

    def on_headers_complete(self) -> None:
        self.status = status = self._parser.get_status_code()
        self.reason = self._reason.decode("latin-1").strip()
        self.head_done = True
        te, cl = self.header("transfer-encoding"), self.header("content-length")
        self._until_close = (cl is None and (te is None or "chunked" not in te.lower())
                             and status not in (204, 304) and not 100 <= status < 200)

    def on_body(self, body: bytes) -> None:
        self._out.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
