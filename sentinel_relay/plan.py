"""What the relay may do with one request, and the continuation request, without I/O.

- :func:`plan_request`: path + body bytes -> :class:`Plan`: the kind (completions or chat),
  streaming or not, the body to send upstream on the first attempt, and a refusal reason when the
  request cannot be continued (it is then passed through unchanged).
- :func:`continuation_body`: the original request + what the client has received -> the
  :class:`Continuation` (path kind and body) of the next attempt. Whenever the engine returned
  token ids (it does for every armed stream: ``return_token_ids``), the continuation is
  ``/v1/completions`` with ``prompt`` = prompt token ids + a prefix of the generated ids, for
  chat too (the chat template's prompt ids, the chunks re-wrapped as chat chunks by the stream
  book): text is never re-tokenized, because a byte-level BPE does not give the same ids back
  (a lone-byte token seen as U+FFFD, a token cut by the stop-string hold-back). Without ids:
  completions continue from prompt text + received text, chat from a trailing assistant
  message (``continue_final_message``). ``max_tokens`` reduced, ``min_tokens`` rebased. Never an
  added instruction or turn.

Errors: :class:`Refused` (a reason string) when a continuation cannot be built faithfully.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHAT_ONLY_FIELDS",
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "PATHS",
    "Continuation",
    "Plan",
    "Received",
    "Refused",
    "choose_pin",
    "continuation_body",
    "plan_request",
    "static_refusal",
    "stop_holdback",
    "stop_lookback",
]

# OpenAI's and vLLM's default for /v1/completions when max_tokens is absent (chat has none).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
#: The path of each kind.
PATHS = {v: k for k, v in _PATHS.items()}

# Request fields that constrain decoding to a grammar: a continuation would restart the grammar
# at the beginning of the partial output, so these are never continued.
_GUIDED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
                  "regex", "json_schema", "ebnf")


# Chat request fields with no meaning (or another one) on /v1/completions: dropped when a chat
# stream continues there from token ids (the prompt ids already hold the rendered template).
CHAT_ONLY_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                    "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls", "documents",
                    "functions", "function_call", "max_completion_tokens", "logprobs", "top_logprobs",
                    "reasoning_effort", "include_reasoning", "mm_processor_kwargs", "media_io_kwargs",
                    "add_special_tokens", "return_tokens_as_token_ids", "audio", "modalities",
                    "prediction", "web_search_options")


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
    (None: all of them). ``marks``: ``(ids, characters)`` delivered after each chunk that
    carried text, in order (where a continuation from ids may start). ``chars``: characters of
    text delivered (code points, as the engine counts them).
    """

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    chunks: int = 0
    ids_with_text: int | None = None
    marks: list[tuple[int, int]] = field(default_factory=list)
    chars: int = 0

    def add(self, text: str | None, ids: list[int] | None) -> None:
        """Record one delivered chunk's text and token ids."""
        if ids:
            self.token_ids.extend(ids)
        if text:
            self.text.append(text)
            self.chars += len(text)
            self.ids_with_text = len(self.token_ids)
            self.marks.append((len(self.token_ids), self.chars))
        if text or ids:
            self.chunks += 1

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


@dataclass(frozen=True, slots=True)
class Continuation:
    """The next attempt: ``kind`` ("completions" or "chat": the path it goes to), ``body``, and
    what the stream book drops from its output because the client already has it:
    ``skip_ids`` regenerated token ids and ``skip_chars`` characters of regenerated text.
    ``resent``: generated tokens re-sent as context (the re-prefill)."""

    kind: str
    body: dict[str, Any]
    skip_ids: int = 0
    skip_chars: int = 0
    resent: int = 0


def stop_holdback(body: dict[str, Any]) -> int:
    """Characters the engine holds back while a stop string may still match (vLLM's stop
    buffer: the longest stop string's length - 1; 0 with ``include_stop_str_in_output``)."""
    return 0 if body.get("include_stop_str_in_output") is True else stop_lookback(body)


def stop_lookback(body: dict[str, Any]) -> int:
    """Characters a continuation must regenerate before the delivered end so that a stop string
    spanning the cut is still matched: the longest stop string's length - 1, whether or not the
    engine holds that text back (with ``include_stop_str_in_output`` it releases it at once, but
    its stop check still spans tokens)."""
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        return 0
    return max((len(s) - 1 for s in stop if isinstance(s, str) and s), default=0)


def _resume_point(rx: Received, holdback: int, lookback: int) -> tuple[int, int]:
    """``(ids, chars)``: the longest prefix of the generated ids to continue from, and the
    characters of text those ids decode to.

    After a chunk that carried text the engine had decoded ``chars + holdback`` characters (it
    releases all but the hold-back; text is released only when the last token completed a
    character, so no partial UTF-8 sequence is pending there). A continuation from that prefix
    sees every stop string that can still end after the text delivered if it starts no later
    than ``delivered - lookback`` (:func:`stop_lookback`); the engine's release then meets the
    delivered text exactly at the last delivered token. Falls back to ``(0, 0)``: the whole
    generation is regenerated."""
    limit = rx.chars - lookback
    for ids, chars in reversed(rx.marks):
        if chars + holdback <= limit and ids <= len(rx.token_ids):
            return ids, chars + holdback
    return 0, 0


def continuation_body(kind: str, body: dict[str, Any], rx: Received,
                      max_resume_tokens: int, context_len: int | None = None) -> Continuation | None:
    """The next attempt, or None when the generation is already complete (``max_tokens`` all
    delivered: the caller finishes with ``length``).

    With the prompt's and the generated token ids (see the module docstring): a
    ``/v1/completions`` request from prompt ids + the ids of :func:`_resume_point`; the tokens
    after it are regenerated and dropped by the caller (``skip_ids``, ``skip_chars``), so a stop
    string whose match spans the cut, or began in the last delivered token, is still found, and
    tokens whose text was held back are never delivered twice. Without ids: prompt text +
    received text (completions), or a trailing assistant message (chat).

    ``max_resume_tokens``: the most generated tokens re-sent as context (bounds the re-prefill).
    ``context_len``: the model's context length (``max_model_len``), for a chat request without
    a token limit: chat's default is the rest of the context, ``/v1/completions``' is 16, so such a
    stream continues there with ``max_tokens`` = the rest; unknown (None): from text.
    Raises :class:`Refused` when it cannot be built faithfully.
    """
    delivered = rx.tokens
    new = dict(body)
    new["stream"] = True
    new["return_token_ids"] = True
    if delivered == 0 and not rx.text:
        return Continuation(kind, new)  # nothing reached the client: the original request, as it was
    mt_key = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        mt_key = "max_completion_tokens"
    max_tokens = body.get(mt_key)
    if kind == "completions" and max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if isinstance(max_tokens, int) and max_tokens - delivered <= 0:
        return None
    pids = rx.prompt_token_ids
    if pids is None and kind == "completions" and isinstance(body.get("prompt"), list):
        pids = list(body["prompt"])  # a token-id prompt (static_refusal checked its shape)
    # chat logprobs have another shape on /v1/completions: such a stream continues from text
    by_ids = pids is not None and rx.token_ids and not (kind == "chat" and body.get("logprobs"))
    if by_ids and kind == "chat" and not isinstance(max_tokens, int):
        by_ids = context_len is not None
    if by_ids:
        assert pids is not None
        kept, at = _resume_point(rx, stop_holdback(body), stop_lookback(body))
        if kept > max_resume_tokens:
            raise Refused(f"resume_too_long ({kept} > {max_resume_tokens} tokens)")
        out = {k: v for k, v in new.items() if k not in CHAT_ONLY_FIELDS} if kind == "chat" else new
        out["prompt"] = pids + rx.token_ids[:kept]
        if isinstance(max_tokens, int):
            out["max_tokens"] = max_tokens - kept
        elif context_len is not None:  # chat without a limit: the rest of the context, as chat's default
            if context_len - len(pids) - len(rx.token_ids) <= 0:
                return None
            out["max_tokens"] = context_len - len(out["prompt"])
        _rebase_min(out, body, kept)
        return Continuation("completions", out, len(rx.token_ids) - kept, rx.chars - at, kept)
    # No ids from the engine: continue from text (exact only where text re-tokenizes to the
    # same ids); the tokens whose text was held back are regenerated.
    kept = delivered - rx.held_back
    if kept > max_resume_tokens:
        raise Refused(f"resume_too_long ({kept} > {max_resume_tokens} tokens)")
    if isinstance(max_tokens, int):
        new[mt_key] = max_tokens - kept
    _rebase_min(new, body, kept)
    text = "".join(rx.text)
    if kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            new["prompt"] = prompt + text
        else:
            raise Refused("no_token_ids")
        return Continuation(kind, new, rx.held_back, 0, kept)
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
    return Continuation(kind, new, rx.held_back, 0, kept)


def _rebase_min(new: dict[str, Any], body: dict[str, Any], kept: int) -> None:
    mn = body.get("min_tokens")
    if isinstance(mn, int) and mn > 0:
        new["min_tokens"] = max(0, mn - kept)


def choose_pin(nodes: dict[str, tuple[bool, int]], exclude: set[str], r: float) -> str | None:
    """The endpoint a request is pinned to (``x-sentinel-pin``), or None to let Envoy pick.

    ``nodes``: address -> (routable, published weight) from the routing feed; ``exclude``: the
    addresses that failed this request; ``r``: a uniform draw in [0, 1). A routable node not
    excluded, drawn by weight (the shares Envoy gives them); None when there is none.
    """
    choices = sorted((a, max(1, w)) for a, (ok, w) in nodes.items() if ok and a not in exclude)
    total = sum(w for _, w in choices)
    x = r * total
    for addr, w in choices:
        if x < w:
            return addr
        x -= w
    return choices[-1][0] if choices else None
