"""A pure, deterministic stand-in for a vLLM-shaped engine, for the relay's core tests.

The next token is a function of the whole context (prompt ids + generated ids for completions;
the messages and the partial assistant text for chat), so a continued stream can be compared with
an uninterrupted one token for token. Chunks have vLLM 0.32's shape (tests/fixtures/vllm-0.32.0-cpu).
"""
from __future__ import annotations

import json


def next_token(ctx: list[int]) -> int:
    h = 7
    for t in ctx:
        h = (h * 31 + t) % 1_000_003
    return 100 + h % 900


def tok_text(t: int) -> str:
    return f"w{t} "


def tokenize(text: str) -> list[int]:
    """The fake tokenizer: one id per word 'wN ' (other text: one id per character)."""
    ids = []
    for w in text.split(" "):
        if w.startswith("w") and w[1:].isdigit():
            ids.append(int(w[1:]))
        elif w:
            ids.extend(ord(c) for c in w)
    return ids


def chat_context(messages: list[dict], continue_final: bool) -> list[int]:
    ids: list[int] = []
    for i, m in enumerate(messages):
        ids.append(1 if m["role"] == "user" else 2)
        ids.extend(tokenize(m["content"]))
        if not (continue_final and i == len(messages) - 1):
            ids.append(3)  # end of turn
    if not continue_final:
        ids.append(2)      # generation prompt: assistant header
    return ids


def generate(kind: str, body: dict, rid: str, model: str = "m", created: int = 1) -> tuple[bytes, list[int]]:
    """The full SSE body an engine streams for ``body``, and the generated ids."""
    if kind == "completions":
        p = body["prompt"]
        ctx = list(p) if isinstance(p, list) else [0] + tokenize(p)
        prompt_ids = list(ctx)
    else:
        ctx = chat_context(body["messages"], bool(body.get("continue_final_message")))
        prompt_ids = list(ctx)
    n = body.get("max_tokens", 16 if kind == "completions" else 8)
    out = []
    obj = "text_completion" if kind == "completions" else "chat.completion.chunk"
    gen: list[int] = []
    if kind == "chat":
        out.append({"id": rid, "object": obj, "created": created, "model": model,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}],
                    "prompt_token_ids": prompt_ids if body.get("return_token_ids") else None})
    for i in range(n):
        t = next_token(ctx)
        ctx.append(t)
        gen.append(t)
        fin = "length" if i == n - 1 else None
        ids = [t] if body.get("return_token_ids") else None
        if kind == "completions":
            ch = {"index": 0, "text": tok_text(t), "logprobs": None, "finish_reason": fin,
                  "stop_reason": None,
                  "prompt_token_ids": prompt_ids if (i == 0 and body.get("return_token_ids")) else None,
                  "token_ids": ids}
        else:
            ch = {"index": 0, "delta": {"content": tok_text(t)}, "logprobs": None,
                  "finish_reason": fin, "token_ids": ids}
        out.append({"id": rid, "object": obj, "created": created, "model": model, "choices": [ch]})
    if (body.get("stream_options") or {}).get("include_usage"):
        out.append({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                    "usage": {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + n,
                              "completion_tokens": n}})
    sse = b"".join(b"data: " + json.dumps(o, separators=(",", ":")).encode() + b"\n\n" for o in out)
    return sse + b"data: [DONE]\n\n", gen


def parse_client(raw: bytes) -> dict:
    """What a client makes of the relayed bytes: text, ids, ids seen, finishes, usage, [DONE]s."""
    text, finishes, usage, dones, ids_, models, errors, pings, ids_tok = [], [], [], 0, set(), set(), [], 0, []
    for ev in raw.split(b"\n\n"):
        if not ev:
            continue
        if ev.startswith(b":"):
            pings += 1
            continue
        assert ev.startswith(b"data: "), ev
        d = ev[6:]
        if d == b"[DONE]":
            dones += 1
            continue
        o = json.loads(d)
        if "error" in o:
            errors.append(o)
            continue
        ids_.add(o["id"])
        models.add(o["model"])
        if o.get("usage"):
            usage.append(o["usage"])
        for ch in o["choices"]:
            t = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
            if t:
                text.append(t)
            if ch.get("token_ids"):
                ids_tok.extend(ch["token_ids"])
            if ch.get("finish_reason") is not None:
                finishes.append(ch["finish_reason"])
    return {"text": "".join(text), "finishes": finishes, "usage": usage, "dones": dones,
            "ids": ids_, "models": models, "errors": errors, "pings": pings, "token_ids": ids_tok}


def engine_handler(host_of):
    """An aiohttp handler answering completions and chat as :func:`generate` does (SSE when
    ``stream``, else one JSON answer), with ``x-sentinel-upstream-host: host_of(request)``."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        host = host_of(request)
        kind = "chat" if request.path.endswith("chat/completions") else "completions"
        sse, _ = generate(kind, body, rid="r")
        if not body.get("stream"):
            return web.json_response({"id": "r", "choices": [{"text": "x"}]},
                                     headers={"x-sentinel-upstream-host": host})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-sentinel-upstream-host": host})
        await resp.prepare(request)
        await resp.write(sse)
        return resp
    return handle
