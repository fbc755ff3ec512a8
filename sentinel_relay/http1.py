"""HTTP/1.1 response framing without I/O, for the relay's upstream reads (the hot path).

:class:`ResponseReader`: ``feed(bytes) -> list[bytes]`` of body pieces (de-chunked), after
parsing the status line and headers (``status``, ``reason``, ``headers`` once ``head_done``).
Framing: ``Transfer-Encoding: chunked``, ``Content-Length``, or until the connection closes.
``complete`` is True once the whole body was read. Errors: :class:`HTTPFramingError` on a
malformed head or chunk size line (the caller treats it like a reset).
"""
from __future__ import annotations

__all__ = ["HTTPFramingError", "ResponseReader", "build_request"]

_MAX_HEAD = 64 << 10


class HTTPFramingError(ValueError):
    """The upstream's bytes are not valid HTTP/1.1 response framing."""


def build_request(method: str, target: str, host: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    """One HTTP/1.1 request with ``Content-Length``; ``headers`` exclude Host/Content-Length."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class ResponseReader:
    __slots__ = (
        "_buf",
        "_left",
        "_mode",
        "_need",
        "complete",
        "head_done",
        "headers",
        "reason",
        "status",
    )

    def __init__(self) -> None:
        self._buf = b""
        self.head_done = False
        self.status = 0
        self.reason = ""
        self.headers: list[tuple[str, str]] = []
        self._mode = ""      # "chunked", "length" or "close"
        self._left = 0       # bytes left in the current chunk / body
        self._need = "size"  # chunked: "size", "data", "crlf", "trailer"
        self.complete = False

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def feed(self, data: bytes) -> list[bytes]:
        if not self.head_done:
            self._buf += data
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    raise HTTPFramingError("response head over 64 KiB")
                return []
            head, data = self._buf[:end], self._buf[end + 4:]
            self._buf = b""
            self._parse_head(head)
            if self.complete:
                return []
        if self._mode == "chunked":
            return self._chunked(data)
        if self._mode == "length":
            if not data:
                return []
            take = data[:self._left]
            self._left -= len(take)
            if self._left == 0:
                self.complete = True
            return [take] if take else []
        return [data] if data else []

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HTTPFramingError(f"bad status line {lines[0][:80]!r}")
        self.status, self.reason = int(parts[1]), parts[2] if len(parts) > 2 else ""
        for ln in lines[1:]:
            k, sep, v = ln.partition(":")
            if not sep:
                raise HTTPFramingError(f"bad header line {ln[:80]!r}")
            self.headers.append((k.strip(), v.strip()))
        self.head_done = True
        te, cl = self.header("transfer-encoding"), self.header("content-length")
        if te is not None and "chunked" in te.lower():
            self._mode = "chunked"
        elif cl is not None:
            if not cl.isdigit():
                raise HTTPFramingError(f"bad content-length {cl!r}")
            self._mode, self._left = "length", int(cl)
            self.complete = self._left == 0
        elif self.status in (204, 304) or 100 <= self.status < 200:
            self._mode, self.complete = "length", True
        else:
            self._mode = "close"

    def _chunked(self, data: bytes) -> list[bytes]:
        if self._need == "size" and not self._buf:
            # The common read: exactly one whole chunk ("<hex>\r\n<data>\r\n").
            j = data.find(b"\r\n", 0, 18)
            if j > 0:
                try:
                    size = int(data[:j], 16)
                except ValueError:
                    size = -1
                if size > 0 and len(data) == j + size + 4 and data.endswith(b"\r\n"):
                    return [data[j + 2:j + 2 + size]]
        out: list[bytes] = []
        buf = self._buf + data if self._buf else data
        self._buf = b""
        i, n = 0, len(buf)
        while i < n and not self.complete:
            if self._need == "data":
                take = min(self._left, n - i)
                out.append(buf[i:i + take])
                i += take
                self._left -= take
                if self._left == 0:
                    self._need = "crlf"
            elif self._need == "crlf":
                if n - i < 2:
                    break
                if buf[i:i + 2] != b"\r\n":
                    raise HTTPFramingError("missing CRLF after a chunk")
                i += 2
                self._need = "size"
            else:  # "size" or "trailer": a line
                j = buf.find(b"\r\n", i)
                if j < 0:
                    if n - i > 4096:
                        raise HTTPFramingError("chunk size line too long")
                    break
                line = buf[i:j]
                i = j + 2
                if self._need == "trailer":
                    if not line:
                        self.complete = True
                    continue
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise HTTPFramingError(f"bad chunk size {line[:40]!r}") from None
                if size == 0:
                    self._need = "trailer"
                else:
                    self._left, self._need = size, "data"
        self._buf = buf[i:] if not self.complete else b""
        return out
