"""Live prompt sampling, the pure part: which text of a request is its prompt, and the bounded
buffer sampled prompts wait in (the I/O side, sending them: :mod:`.prompts`).

- :func:`extract_prompt`: a ``/v1/completions`` request's ``prompt`` when it is one string; a
  chat request's last ``user`` message when its content is text (a string, or a list of
  ``{"type": "text", "text": ...}`` parts, joined; a message with any other part, an image
  say, gives nothing: its text alone is not the prompt). Token-id and batched prompts give
  nothing. Never raises, whatever the body holds.
- :class:`PromptBuffer`: at most ``size`` ``(cluster, prompt)`` pairs; one more drops the
  oldest (:meth:`PromptBuffer.add` says so, for the count).
"""
from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["PromptBuffer", "extract_prompt"]


def extract_prompt(kind: str, body: Any) -> str | None:
    """The prompt text of a request of ``kind`` ("completions" or "chat"; anything else: None)
    whose parsed JSON body is ``body``; None when it has none in text (see the module docstring)
    or it is empty."""
    if not isinstance(body, dict):
        return None
    if kind == "completions":
        p = body.get("prompt")
        return p if isinstance(p, str) and p else None
    if kind != "chat":
        return None
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return None
    for m in reversed(msgs):
        if isinstance(m, dict) and m.get("role") == "user":
            return _text(m.get("content"))
    return None


def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content or None
    if not isinstance(content, list):
        return None
    parts: list[str] = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            return None  # an image, audio, a file: the text alone is not the prompt
        parts.append(part["text"])
    return "\n".join(parts) or None


class PromptBuffer:
    """Sampled prompts waiting to be sent: ``(cluster, prompt)``, oldest first, at most ``size``
    (>= 1, else ValueError)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("PromptBuffer size must be >= 1")
        self._q: deque[tuple[str, str]] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._q)

    def add(self, cluster: str, prompt: str) -> bool:
        """Queue one prompt; True when the oldest was dropped to make room."""
        full = len(self._q) == self._q.maxlen
        self._q.append((cluster, prompt))
        return full

    def take(self) -> list[tuple[str, str]]:
        """Every waiting prompt, oldest first; the buffer is empty after."""
        out = list(self._q)
        self._q.clear()
        return out
