"""Text that comes from outside the process (agents, xDS clients, admin requests), made safe.

Agent strings, Envoy node ids, nonces and operator reasons are bounded before they are stored and
escaped before they reach a log line, so a client can neither grow memory through them nor forge
a log line. :class:`RateLimitedLog` keeps a flood of the same complaint from flooding the log.

Shape::

    clip("x" * 10_000, 256)        # -> at most 256 characters, "…" marks a cut
    for_log("a\\nFORGED")          # -> 'a\\\\nFORGED' (one line, control characters escaped)
    rl = RateLimitedLog(log, per_key_interval_s=10.0)
    rl.warning(now_s, "malformed", "node %s: %s", node, what)   # logged at most once per 10 s per key
"""
from __future__ import annotations

import logging

__all__ = ["RateLimitedLog", "clip", "for_log"]

_ELLIPSIS = "…"


def clip(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters (the last one "…" when cut).

    Raises ValueError if ``max_chars`` < 1.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    if len(text) <= max_chars:
        return text
    return text[: max_chars - 1] + _ELLIPSIS


def for_log(text: str, max_chars: int = 128) -> str:
    """One log-safe line: clipped to ``max_chars``, control and non-printable characters escaped
    (``\\n``, ``\\x1b``, ...), so a value cannot start a new log line or move the terminal cursor."""
    cut = clip(text, max_chars)
    if cut.isprintable():
        return cut
    return cut.encode("unicode_escape").decode("ascii")


class RateLimitedLog:
    """Log at most one line per key per ``per_key_interval_s``; count what was suppressed.

    Keys are chosen by the caller from a bounded set (a kind of complaint, never client text);
    at most ``max_keys`` are tracked (the oldest is forgotten beyond that). The next line logged
    for a key says how many were suppressed since the last one. Time is the caller's (s).
    """

    def __init__(self, logger: logging.Logger, per_key_interval_s: float = 10.0, max_keys: int = 1024) -> None:
        self.logger = logger
        self.interval_s = per_key_interval_s
        self.max_keys = max_keys
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, now_s: float, key: str, msg: str, *args: object,
            extra: dict | None = None) -> bool:
        """Log ``msg % args`` at ``level`` (structured fields in ``extra``, see
        :mod:`xds_server.process.logs`) unless ``key`` was logged within the interval.

        Returns True if the line was written.
        """
        last = self._last.get(key)
        if last is not None and now_s - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        if last is None and len(self._last) >= self.max_keys:
            oldest = next(iter(self._last))
            self._last.pop(oldest)
            self._suppressed.pop(oldest, None)
        self._last.pop(key, None)
        self._last[key] = now_s
        n = self._suppressed.pop(key, 0)
        if n:
            msg += f" ({n} similar suppressed)"
        self.logger.log(level, msg, *args, extra=extra)
        return True

    def forget(self, key: str) -> None:
        """Start ``key`` afresh: its next line is written at once (suppressed count dropped)."""
        self._last.pop(key, None)
        self._suppressed.pop(key, None)

    def warning(self, now_s: float, key: str, msg: str, *args: object, extra: dict | None = None) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, now_s, key, msg, *args, extra=extra)
