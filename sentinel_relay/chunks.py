"""Rewrites of single stream chunks for the stream book, without I/O.

- :func:`strip_ids`: a raw SSE event with each ``"token_ids":[...]`` and
  ``"prompt_token_ids":[...]`` as ``null`` (what vLLM sends when ``return_token_ids`` was not
  asked; the relay asks for it, the client did not).
- :func:`fast_fields`: the JSON of a plain token chunk's text and token ids, found without
  decoding it (compact JSON, vLLM's pydantic output), or None when it needs the full parse.
- :func:`chat_choice`: a ``/v1/completions`` stream choice as the chat stream choice the engine
  would have sent for the same token: ``text`` becomes ``delta.content``, the other keys keep
  their order, ``prompt_token_ids`` goes (chat carries it on the role chunk), and
  ``stop_reason`` stays only with a ``finish_reason`` (vLLM 0.32's chat and completions chunk
  shapes, tests/fixtures/vllm-0.32.0-cpu 05b and 07b).
"""
from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["chat_choice", "dumps", "error_event", "fast_fields", "strip_ids"]

# Compact JSON: the string value of a key, the token id list.
_STR = rb'("(?:[^"\\]|\\.)*")'
_TEXT = re.compile(rb'"text":' + _STR)
_CONTENT = re.compile(rb'"delta":\{(?:"role":"assistant",)?"content":' + _STR)
_IDS = re.compile(rb'"token_ids":(\[[0-9,]*\]|null)')

# "token_ids":[...] and "prompt_token_ids":[...] (a quote inside a JSON string is escaped, so
# the text of a token cannot match)
_IDS_LIST = re.compile(rb'token_ids":\[[0-9,]*\]')
_NULL_IDS = b'token_ids":null'


def strip_ids(raw: bytes) -> bytes:
    """``raw`` with its token id lists as ``null``."""
    return _IDS_LIST.sub(_NULL_IDS, raw)


def chat_choice(ch: dict[str, Any]) -> dict[str, Any]:
    """A completions stream choice -> the chat stream choice for the same token."""
    out: dict[str, Any] = {}
    for k, v in ch.items():
        if k == "text":
            out["delta"] = {"content": v}
        elif k == "prompt_token_ids" or (k == "stop_reason" and ch.get("finish_reason") is None):
            continue
        else:
            out[k] = v
    return out


def fast_fields(data: bytes, chat: bool) -> tuple[bytes, bytes] | None:
    """``(text JSON, ids JSON)`` of a plain token chunk, or None (finish_reason, usage, errors,
    tool calls, reasoning, another JSON layout)."""
    # An error event carries no "finish_reason":null; logprobs cannot match the patterns.
    if b'"finish_reason":null' not in data or b'"usage"' in data:
        return None
    if chat:
        if b'"tool_calls"' in data or b'"reasoning' in data:
            return None
        m = _CONTENT.search(data)
    else:
        m = _TEXT.search(data)
    i = _IDS.search(data)
    if m is None or i is None:
        return None
    return m.group(1), i.group(1)


def dumps(obj: Any) -> bytes:
    """One SSE data event of ``obj`` in compact JSON, UTF-8 as is (vLLM's encoding)."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def error_event(message: str, code: int = 502, type_: str = "relay_rescue_failed") -> bytes:
    """The one in-band error event sent when the last attempt failed (OpenAI error shape)."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
