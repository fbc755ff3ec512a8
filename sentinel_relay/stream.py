"""Stream bookkeeping for one relayed SSE response, without I/O.

A :class:`StreamBook` takes the upstream's raw SSE events (from :class:`~sentinel_relay.sse.SSESplitter`),
one attempt after another, and returns the bytes the client must receive, so that across any
number of attempts the client sees one response id, one model name, its deltas in order, exactly
one ``finish_reason``, usage computed here (prompt tokens once, completion tokens = tokens
delivered) and one ``data: [DONE]``; or, when the last attempt fails, one in-band error event and
no ``[DONE]``.

First attempt: events are forwarded byte for byte (no JSON re-encoding), except the token ids the
relay asked for (``return_token_ids``): unless the client asked for them too, each
``"token_ids":[...]`` and ``"prompt_token_ids":[...]`` goes out as ``null``, what the engine
sends without them. A plain token chunk in compact JSON (vLLM's) is not even decoded: the JSON
of its text and token ids is kept as bytes and decoded only when a rescue (or the relay's usage)
needs it (:attr:`StreamBook.rx`). Later attempts: each chunk is rewritten (id, model, created of
the first; the repeated chat ``role`` delta, the continuation's ``prompt_token_ids`` and the
engine's usage numbers dropped; the tokens and text the client already has skipped; a chat
stream continued on ``/v1/completions`` re-wrapped as chat chunks, key for key).

A data event that is not JSON (an engine's or a proxy's bug) is not a failed node: it is passed
through as Envoy alone would, and the stream is no longer rescued (the relay cannot know what it
carried): a later fault sends the error event with reason ``garbled_event``.

States and inputs are a table (:data:`TRANSITIONS`); an input the table does not allow in a
state raises :class:`BookError` (a bug in the caller, never upstream data: every upstream input is
allowed in every state).
"""
from __future__ import annotations

import enum
import json
from typing import Any

from .chunks import chat_choice, error_event, fast_fields, strip_ids
from .chunks import dumps as _dumps
from .plan import Received, Refused, continuation_body
from .sse import event_data

__all__ = ["DONE", "PING", "TRANSITIONS", "BookError", "In", "St", "StreamBook", "error_event"]

PING = b": ping\n\n"
DONE = b"data: [DONE]\n\n"


class St(enum.Enum):
    OPEN = "open"            # an attempt is streaming, no finish_reason yet
    FINISHED = "finished"    # finish_reason delivered; waiting for usage / [DONE]
    FAULTED = "faulted"      # the attempt failed before finishing; a rescue may follow
    COMPLETE = "complete"    # [DONE] delivered (terminal)
    FAILED = "failed"        # error event delivered (terminal)


class In(enum.Enum):
    CHUNK = "chunk"          # a data chunk without finish_reason
    FINISH = "finish"        # a data chunk with finish_reason
    USAGE = "usage"          # a usage-only chunk (choices empty)
    DONE = "done"            # data: [DONE]
    ERROR = "error"          # an in-band error event (or undecodable data)
    COMMENT = "comment"      # a comment-only event (an engine's keep-alive)
    EOF = "eof"              # the upstream response ended
    FAULT = "fault"          # the shell's verdict: health signal, stall, reset
    RESUME = "resume"        # a new attempt starts
    GIVE_UP = "give_up"      # no further attempt


_UPSTREAM = (In.CHUNK, In.FINISH, In.USAGE, In.DONE, In.ERROR, In.COMMENT, In.EOF, In.FAULT)

TRANSITIONS: dict[tuple[St, In], St] = {
    **{(St.OPEN, i): St.OPEN for i in (In.CHUNK, In.USAGE, In.COMMENT)},
    (St.OPEN, In.FINISH): St.FINISHED,
    **{(St.OPEN, i): St.FAULTED for i in (In.DONE, In.ERROR, In.EOF, In.FAULT)},
    **{(St.FINISHED, i): St.FINISHED for i in (In.CHUNK, In.FINISH, In.USAGE, In.COMMENT)},
    # finish_reason was delivered: whatever happens next, the generation is whole.
    **{(St.FINISHED, i): St.COMPLETE for i in (In.DONE, In.ERROR, In.EOF, In.FAULT)},
    **{(St.FAULTED, i): St.FAULTED for i in _UPSTREAM},   # leftovers of a dead attempt
    (St.FAULTED, In.RESUME): St.OPEN,
    (St.FAULTED, In.GIVE_UP): St.FAILED,
    **{(St.COMPLETE, i): St.COMPLETE for i in _UPSTREAM},
    **{(St.FAILED, i): St.FAILED for i in _UPSTREAM},
}


class BookError(RuntimeError):
    """An input the state table does not allow (a caller's bug)."""


class StreamBook:
    """One streamed response across attempts. ``kind``: "completions" or "chat"; ``body``: the
    client's request (parsed); ``include_usage``: the client asked for a usage chunk.

    Read-only facts for the shell: ``state``, ``attempt`` (1-based), ``rx`` (what the client has
    received), ``fault`` (the reason the current attempt failed, or None), ``resent_tokens``
    (generated tokens re-sent as context in the current attempt), ``upstream_kind`` (the path
    kind of the current attempt: a chat stream continues on "completions" from token ids),
    ``garbled`` (a data event that was not JSON passed through: no rescue from then on).
    """

    def __init__(self, kind: str, body: dict[str, Any], include_usage: bool = False) -> None:
        self.kind = kind
        self.body = body
        self.include_usage = include_usage
        self.client_ids = body.get("return_token_ids") is True
        self.state = St.OPEN
        self.attempt = 1
        self.upstream_kind = kind
        self._rx = Received()
        # Fast path (first attempt, compact vLLM-style chunks): the JSON of each chunk's text and
        # token ids is kept as bytes, comma-joined, and decoded only when needed (see ``rx``).
        self._fast_text = bytearray()
        self._fast_ids = bytearray()
        self._fast_n = 0
        self.fault: str | None = None
        self.garbled = False
        self.resent_tokens = 0
        self._skip_ids = 0    # regenerated ids the client already has: not delivered twice
        self._skip_chars = 0  # regenerated text the client already has
        self._identity: tuple[Any, Any, Any, Any] | None = None  # id, object, created, model
        self._identity_attempt = 0
        self._engine_usage: dict[str, Any] | None = None
        self._engine_usage_attempt = 0
        self._usage_sent = False
        self._tool_or_reasoning: str | None = None

    @property
    def rx(self) -> Received:
        """What the client has received (decodes the fast path's pending bytes first)."""
        if self._fast_n:
            rx = self._rx
            texts = json.loads(b"[" + self._fast_text + b"]")
            ids = json.loads(b"[" + self._fast_ids + b"]")
            for t, i in zip(texts, ids, strict=True):
                rx.add(t, i)
            self._fast_text.clear()
            self._fast_ids.clear()
            self._fast_n = 0
        return self._rx

    def _fast(self, data: bytes) -> bool:
        """Record a plain token chunk without decoding its JSON; False when it needs the full
        parse (first chunk, finish_reason, errors, usage, tool calls, reasoning, non-compact
        JSON, ids whose text is held back)."""
        f = fast_fields(data, self.kind == "chat")
        if f is None:
            return False
        text, ids = f
        if text == b'""':
            return ids in (b"null", b"[]")  # neither text nor ids: not a content chunk
        ft, fi = self._fast_text, self._fast_ids
        if self._fast_n:
            ft += b","
            fi += b","
        ft += text
        fi += b"[]" if ids == b"null" else ids
        self._fast_n += 1
        return True

    # -- transitions -------------------------------------------------------------------------
    def _go(self, inp: In) -> St:
        try:
            nxt = TRANSITIONS[(self.state, inp)]
        except KeyError:
            raise BookError(f"input {inp.value} not allowed in state {self.state.value}") from None
        self.state = nxt
        return nxt

    @property
    def rewriting(self) -> bool:
        """Chunks are rewritten: the client already has the identity of an earlier attempt."""
        return self._identity is not None and self._identity_attempt != self.attempt

    def _out(self, raw: bytes) -> bytes:
        """A first-attempt event as the client gets it (ids it did not ask for: null)."""
        return raw if self.client_ids else strip_ids(raw)

    def feed(self, events: list[bytes]) -> bytes:
        """Upstream events of the current attempt -> the bytes to send to the client (may be
        empty). After it, ``state`` says whether the attempt faulted (``FAULTED``, reason in
        ``fault``) or the response is whole (``COMPLETE``)."""
        out: list[bytes] = []
        for raw in events:
            if self.state in (St.FAULTED, St.COMPLETE, St.FAILED):
                break
            data = event_data(raw)
            if data is None:
                self._go(In.COMMENT)
                out.append(raw)
                continue
            if data == b"[DONE]":
                before = self.state
                if self._go(In.DONE) is St.COMPLETE:
                    out.append(self._closing(raw if (not self.rewriting and before is St.FINISHED) else None))
                else:
                    self.fault = "truncated"
                continue
            if self.state is St.OPEN and self._identity is not None and not self.rewriting \
                    and self._fast(data):
                out.append(self._out(raw))
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                # garbled: as Envoy alone would, the client gets it; no rescue from now on
                self.garbled = True
                self._go(In.COMMENT)
                out.append(raw)
                continue
            if "error" in obj or obj.get("object") == "error":
                if self._go(In.ERROR) is St.FAULTED:
                    self.fault = "error"
                else:
                    out.append(self._closing(None))
                continue
            out.append(self._chunk(raw, obj))
        return b"".join(out)

    def _rewrite_identity(self, obj: dict[str, Any]) -> None:
        assert self._identity is not None
        cid, cobj, created, model = self._identity
        obj["id"], obj["created"], obj["model"] = cid, created, model
        if cobj is not None:
            obj["object"] = cobj

    def _chunk(self, raw: bytes, obj: dict[str, Any]) -> bytes:
        choices = obj.get("choices") or []
        usage = obj.get("usage")
        if usage is not None and self._engine_usage_attempt != self.attempt:
            self._engine_usage = usage
            self._engine_usage_attempt = self.attempt
        if not choices:
            self._go(In.USAGE)
            if self.state is not St.FINISHED or self._usage_sent:
                return b""  # the relay sends its own usage at the end
            self._usage_sent = usage is not None
            if not self.rewriting:
                return self._out(raw)
            if usage is None:
                return b""
            self._rewrite_identity(obj)  # the engine's usage chunk, with the relay's numbers
            obj["usage"] = self.usage()
            return _dumps(obj)
        if self._identity is None:
            self._identity = (obj.get("id"), obj.get("object"), obj.get("created"), obj.get("model"))
            self._identity_attempt = self.attempt
        ch = choices[0]
        if self.kind == "chat" and self.upstream_kind == "completions":
            ch = choices[0] = chat_choice(ch)
            obj.pop("prompt_token_ids", None)
        finish = ch.get("finish_reason")
        if self.state is St.FINISHED:
            return b""  # a second finish or a late chunk: exactly one finish_reason reaches the client
        if self.kind == "chat":
            delta = ch.get("delta") or {}
            text = delta.get("content")
            if delta.get("tool_calls"):
                self._tool_or_reasoning = "tool_call"
            elif delta.get("reasoning_content") or delta.get("reasoning"):
                self._tool_or_reasoning = "reasoning"
        else:
            delta = None
            text = ch.get("text")
        ids = ch.get("token_ids")
        rx = self.rx  # decodes the fast path's pending chunks first: order is kept
        if rx.prompt_token_ids is None and self.resent_tokens == 0:  # this attempt's prompt is the original
            pids = ch.get("prompt_token_ids") or obj.get("prompt_token_ids")
            if isinstance(pids, list):
                rx.prompt_token_ids = pids
        if self._skip_ids or self._skip_chars:
            if isinstance(ids, list) and ids and self._skip_ids:
                drop = min(self._skip_ids, len(ids))
                self._skip_ids -= drop
                ids = ch["token_ids"] = ids[drop:]
            if isinstance(text, str) and text and self._skip_chars:
                drop = min(self._skip_chars, len(text))
                self._skip_chars -= drop
                text = text[drop:]
                if delta is not None:
                    delta["content"] = text
                else:
                    ch["text"] = text
            if not ids and not text and finish is None:
                return b""  # a regenerated token the client already has
        rx.add(text if isinstance(text, str) else None, ids if isinstance(ids, list) else None)
        self._go(In.FINISH if finish is not None else In.CHUNK)
        if not self.rewriting:
            return self._out(raw)
        if delta is not None and "role" in delta:
            if not text and finish is None and not delta.get("tool_calls"):
                return b""  # the continuation's opening role chunk: the client has its own
            ch["delta"] = {k: v for k, v in delta.items() if k != "role"}
        self._rewrite_identity(obj)
        if "prompt_token_ids" in obj:
            obj["prompt_token_ids"] = None
        if "prompt_token_ids" in ch:
            ch["prompt_token_ids"] = None
        if "token_ids" in ch and not self.client_ids:
            ch["token_ids"] = None
        if usage is not None:
            obj["usage"] = self.usage()
        return _dumps(obj)

    def _closing(self, done_raw: bytes | None) -> bytes:
        """Usage chunk (if asked and not yet sent) and [DONE]."""
        parts = []
        if self.include_usage and not self._usage_sent and self._identity is not None:
            cid, cobj, created, model = self._identity
            parts.append(_dumps({"id": cid, "object": cobj, "created": created, "model": model,
                                 "choices": [], "usage": self.usage()}))
            self._usage_sent = True
        parts.append(done_raw if done_raw is not None else DONE)
        return b"".join(parts)

    def usage(self) -> dict[str, int]:
        """Usage as the relay counts it: prompt tokens of the original prompt, completion tokens
        = tokens delivered to the client (ids when the engine returned them, else chunks)."""
        if self.rx.prompt_token_ids is not None:
            prompt = len(self.rx.prompt_token_ids)
        elif self._engine_usage is not None:
            prompt = int(self._engine_usage.get("prompt_tokens") or 0)
            if self._engine_usage_attempt > 1:
                prompt = max(0, prompt - self.resent_tokens)
        else:
            prompt = 0
        comp = self.rx.tokens
        return {"prompt_tokens": prompt, "total_tokens": prompt + comp, "completion_tokens": comp}

    # -- the shell's verdicts ------------------------------------------------------------------
    def eof(self) -> bytes:
        """The upstream response ended (cleanly or not). Returns bytes to send (the closing
        usage and [DONE] when finish_reason was already delivered)."""
        before = self.state
        if before in (St.FAULTED, St.COMPLETE, St.FAILED):
            return b""
        self._go(In.EOF)
        if self.state is St.COMPLETE:
            return self._closing(None)
        self.fault = "truncated"
        return b""

    def set_fault(self, reason: str) -> bytes:
        """The shell declares the current attempt failed (``reason``: health, stall, reset, ...)."""
        if self.state in (St.FAULTED, St.COMPLETE, St.FAILED):
            return b""
        if self._go(In.FAULT) is St.COMPLETE:
            return self._closing(None)
        self.fault = reason
        return b""

    def next_request(self, max_resume_tokens: int, context_len: int | None = None) -> dict[str, Any] | None:
        """The body of the next attempt and the move to it (``attempt`` += 1, state OPEN; the
        path kind in ``upstream_kind``; ``context_len``: see :func:`~.plan.continuation_body`).

        Returns None when ``max_tokens`` was already all delivered: the book then finished the
        response itself (call :meth:`finish_length`). Raises :class:`Refused` when a tool call or
        reasoning block was in progress, a garbled event went through, or the context is too
        long (then call :meth:`give_up`).
        """
        if self.state is not St.FAULTED:
            raise BookError(f"next_request in state {self.state.value}")
        if self._tool_or_reasoning:
            raise Refused(f"{self._tool_or_reasoning}_in_progress")
        if self.garbled:
            raise Refused("garbled_event")
        nxt = continuation_body(self.kind, self.body, self.rx, max_resume_tokens, context_len)
        if nxt is None:
            return None
        self._go(In.RESUME)
        self.attempt += 1
        self.fault = None
        self.upstream_kind = nxt.kind
        self.resent_tokens = nxt.resent
        self._skip_ids, self._skip_chars = nxt.skip_ids, nxt.skip_chars
        return nxt.body

    def finish_length(self) -> bytes:
        """Close a response whose ``max_tokens`` was all delivered but whose finish chunk was
        lost: one chunk with ``finish_reason: "length"``, usage, [DONE]."""
        if self.state is not St.FAULTED or self._identity is None:
            raise BookError("finish_length needs a faulted stream that delivered chunks")
        self._go(In.RESUME)
        self._go(In.FINISH)
        cid, cobj, created, model = self._identity
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
        chunk = _dumps({"id": cid, "object": cobj, "created": created, "model": model, "choices": [choice]})
        self._go(In.DONE)
        return chunk + self._closing(None)

    def give_up(self, message: str) -> bytes:
        """No further attempt: the one in-band error event (no [DONE])."""
        self._go(In.GIVE_UP)
        return error_event(message)
