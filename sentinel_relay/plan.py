"""What the relay may do with one request, and the continuation request, without I/O.

- :func:`plan_request`: path + body bytes -> :class:`Plan`: the kind (completions or chat),
  streaming or not, the body to send upstream on the first attempt, and a refusal reason when the
  request cannot be continued (it is then passed through unchanged).
- :func:`continuation_body`: the original request + what the client has received -> the body of
  the next attempt. Completions: ``prompt`` = prompt token ids + generated token ids (or prompt
  text + received text where stop strings can hold text back behind the ids), ``max_tokens``
  reduced, ``min_tokens`` rebased. Chat: a trailing assistant message holding the text received,
  ``continue_final_message: true``, ``add_generation_prompt: false`` (vLLM and SGLang). Never an
  added instruction or turn.

Errors: :class:`Refused` (a reason string) when a continuation cannot be built faithfully.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "Plan",
    "Received",
    "Refused",
    "continuation_body",
    "plan_request",
    "static_refusal",
]

# OpenAI's and vLLM's default for /v1/completions when max_tokens is absent (chat has none).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}

# Request fields that constrain decoding to a grammar: a continuation would restart the grammar
# at the beginning of the partial output, so these are never continued.
_GUIDED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
                  "regex", "json_schema", "ebnf")


class Refused(Exception):
    """The request (or its current stream) cannot be continued; ``str(exc)`` is the reason."""


@dataclass(frozen=True, slots=True)
class Plan:
    """One request as the relay sees it.

    ``kind``: "completions", "chat" or "other" (any other path: forwarded as is).
    ``body``: the parsed JSON body (None if not a JSON object). ``stream``: SSE requested.
    ``refusal``: why the relay passes it through without rescue (None: rescue armed).
    ``upstream_body``: bytes to send on the first attempt (the client's bytes, plus
    ``return_token_ids: true`` for an armed stream). ``include_usage``: the client asked for a
    usage chunk (``stream_options.include_usage``).
    """

    kind: str
    body: dict[str, Any] | None
    stream: bool
    refusal: str | None
    upstream_body: bytes
    include_usage: bool = False


@dataclass(slots=True)
class Received:
    """What the client has received of one choice, as the stream book keeps it.

    ``text``: the text (completions ``text`` / chat ``delta.content``) in order. ``token_ids``: ids
    of the tokens delivered (when the engine returns them). ``prompt_token_ids``: from the first
    attempt's first chunk (None if the engine did not send them). ``chunks``: content chunks sent.
    ``ids_with_text``: how many of ``token_ids`` were delivered up to the last chunk with text
    (None: all of them).
    """

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    chunks: int = 0
    ids_with_text: int | None = None

    @property
    def held_back(self) -> int:
        """Ids delivered after the last chunk that carried text: tokens whose text the engine
        still held back (an incomplete UTF-8 sequence). A continuation regenerates them."""
        return 0 if self.ids_with_text is None else len(self.token_ids) - self.ids_with_text

    @property
    def tokens(self) -> int:
        """Tokens delivered: the ids when known, else one per content chunk (engines send one)."""
        return len(self.token_ids) if self.token_ids else self.chunks


def static_refusal(kind: str, body: dict[str, Any]) -> str | None:
    """Why a request cannot be continued, judged before it starts (None: it can be)."""
    if kind == "other":
        return "path"
    for key in ("n", "best_of"):
        v = body.get(key)
        if v is not None and v != 1:
            return f"{key}>1"
    if body.get("echo"):
        return "echo"
    if kind == "completions" and body.get("suffix"):
        return "suffix"
    if body.get("prompt_logprobs"):
        return "prompt_logprobs"
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        return "response_format"
    for key in _GUIDED_FIELDS:
        if body.get(key) is not None:
            return key
    if kind == "completions":
        p = body.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return "batched_prompt"
        if not isinstance(p, (str, list)):
            return "prompt"
    else:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "messages"
    return None


def plan_request(path: str, raw: bytes) -> Plan:
    """Judge one request. Never raises: a body the engine will reject is passed through."""
    kind = _PATHS.get(path, "other")
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict):
        return Plan(kind, None, False, "body" if kind != "other" else "path", raw)
    stream = body.get("stream") is True
    so = body.get("stream_options")
    include_usage = stream and isinstance(so, dict) and so.get("include_usage") is True
    refusal = static_refusal(kind, body)
    upstream = raw
    if refusal is None and stream and body.get("return_token_ids") is not True:
        upstream = json.dumps({**body, "return_token_ids": True}, separators=(",", ":")).encode()
    return Plan(kind, body, stream, refusal, upstream, include_usage)


def _text_continuation(body: dict[str, Any]) -> bool:
    """Stop strings let the engine hold text back while it has sent the ids: continue from text."""
    stop = body.get("stop")
    if not stop:
        return False
    return isinstance(stop, str) or any(isinstance(s, str) and s for s in stop)


def continuation_body(kind: str, body: dict[str, Any], rx: Received,
                      max_resume_tokens: int) -> dict[str, Any] | None:
    """The next attempt's request body, or None when the generation is already complete
    (``max_tokens`` all delivered: the caller finishes with ``length``).

    Completions continue from token ids, except with stop strings and a text prompt (the engine
    may hold text back behind the ids it sent): then prompt text + the text received. A token-id
    prompt with stop strings still continues from ids (no text prompt to extend). Ids delivered
    with empty text (held back inside an incomplete UTF-8 sequence: ``rx.held_back``) are not
    resent: continuing from them makes vLLM's detokenizer emit the whole context as text (seen
    on vLLM 0.32); they are regenerated, and the caller drops their ids the second time.

    ``max_resume_tokens``: the most generated tokens re-sent as context (bounds the re-prefill).
    Raises :class:`Refused` when it cannot be built faithfully.
    """
    delivered = rx.tokens
    if delivered > max_resume_tokens:
        raise Refused(f"resume_too_long ({delivered} > {max_resume_tokens} tokens)")
    new = dict(body)
    new["stream"] = True
    new["return_token_ids"] = True
    if delivered == 0 and not rx.text:
        return new  # nothing reached the client: the original request, as it was
    mt_key = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        mt_key = "max_completion_tokens"
    max_tokens = body.get(mt_key)
    if kind == "completions" and max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    # Tokens whose text was held back are regenerated (the caller skips their ids again), so
    # the continuation starts after the last token the client saw text for.
    kept = delivered - rx.held_back
    if isinstance(max_tokens, int):
        if max_tokens - delivered <= 0:
            return None
        new[mt_key] = max_tokens - kept
    mn = body.get("min_tokens")
    if isinstance(mn, int) and mn > 0:
        new["min_tokens"] = max(0, mn - kept)
    text = "".join(rx.text)
    seen_ids = rx.token_ids[:len(rx.token_ids) - rx.held_back]
    if kind == "completions":
        prompt = body.get("prompt")
        if _text_continuation(body) and isinstance(prompt, str):
            new["prompt"] = prompt + text
        elif rx.prompt_token_ids is not None and rx.token_ids:
            new["prompt"] = rx.prompt_token_ids + seen_ids
        elif isinstance(prompt, list) and rx.token_ids:
            new["prompt"] = list(prompt) + seen_ids
        elif isinstance(prompt, str):
            new["prompt"] = prompt + text
        else:
            raise Refused("no_token_ids")
        return new
    msgs = list(body["messages"])
    last = msgs[-1] if msgs else None
    if (body.get("continue_final_message") and isinstance(last, dict)
            and last.get("role") == "assistant" and isinstance(last.get("content"), str)):
        msgs[-1] = {**last, "content": last["content"] + text}  # the client's own prefill
    else:
        msgs.append({"role": "assistant", "content": text})
    new["messages"] = msgs
    new["continue_final_message"] = True
    new["add_generation_prompt"] = False
    return new
