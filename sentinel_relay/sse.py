"""Server-sent events framing, without I/O: bytes in any chunking -> whole raw events.

An event ends at a blank line (``\\n\\n``; ``\\r\\n\\r\\n`` and ``\\r\\r`` are accepted too, as the
SSE spec allows). :class:`SSESplitter` returns each event's raw bytes *including* its terminator,
so a relay can forward an event byte for byte; :func:`event_data` extracts the joined ``data:``
field. Shapes: bytes in, ``list[bytes]`` out. Errors: none raised; a partial event waits in the
buffer until its terminator arrives (bounded by ``max_event_bytes``, see :class:`SSEOverflow`).
"""
from __future__ import annotations

import re

__all__ = ["SSEOverflow", "SSESplitter", "event_data", "is_comment_only"]

_TERMINATOR = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class SSEOverflow(ValueError):
    """One event grew past ``max_event_bytes`` without a terminator (a broken upstream)."""


class SSESplitter:
    """Incremental splitter. ``feed(data)`` returns the events completed by ``data``, in order.

    ``max_event_bytes``: the largest partial event held (default 16 MiB: a first chunk carrying
    the prompt's token ids of a 1M-token context is ~8 MB of JSON).
    """

    __slots__ = ("_buf", "max_event_bytes")

    def __init__(self, max_event_bytes: int = 16 << 20) -> None:
        self._buf = b""
        self.max_event_bytes = max_event_bytes

    def feed(self, data: bytes) -> list[bytes]:
        if not self._buf and data.endswith(b"\n\n") and data.find(b"\n\n") == len(data) - 2 \
                and b"\r" not in data:
            return [data]  # the common read: exactly one event
        buf = self._buf + data if self._buf else data
        if b"\n\n" in buf and b"\r" not in buf:  # the common case (vLLM, SGLang): split cheaply
            parts = buf.split(b"\n\n")
            self._buf = parts.pop()
            events = [p + b"\n\n" for p in parts]
        else:
            events = []
            start = 0
            for m in _TERMINATOR.finditer(buf):
                events.append(buf[start:m.end()])
                start = m.end()
            self._buf = buf[start:]
        if len(self._buf) > self.max_event_bytes:
            self._buf = b""
            raise SSEOverflow(f"an SSE event exceeded {self.max_event_bytes} bytes without an end")
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet terminated (a truncated upstream leaves them here)."""
        return self._buf


def event_data(raw: bytes) -> bytes | None:
    """The event's ``data`` field (several ``data:`` lines joined by ``\\n``), or None if it has
    no data line (a comment such as ``: ping``, or only other fields)."""
    if raw.startswith(b"data: ") and raw.count(b"\n") <= 2 and b"\r" not in raw:
        return raw[6:].rstrip(b"\n")  # the common one-line event
    out: list[bytes] = []
    for line in raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"):
        if line.startswith(b"data:"):
            v = line[5:]
            out.append(v[1:] if v.startswith(b" ") else v)
    return b"\n".join(out) if out else None


def is_comment_only(raw: bytes) -> bool:
    """True when every non-empty line of the event is a comment (starts with ``:``)."""
    return all(not ln or ln.startswith(b":") for ln in raw.replace(b"\r", b"\n").split(b"\n"))
