"""The relay's pure core: SSE framing, refusals, continuation requests and the stream book,
over any cut point and any chunking of the upstream bytes (hypothesis)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from relay_fake_engine import generate, parse_client

from sentinel_relay.plan import Received, Refused, continuation_body, plan_request, stop_holdback
from sentinel_relay.sse import SSESplitter, event_data
from sentinel_relay.stream import TRANSITIONS, BookError, In, St, StreamBook

FIXTURES = "tests/fixtures/vllm-0.32.0-cpu"


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    pts = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in pts + [len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


# -- SSE framing ------------------------------------------------------------------------------
@given(st.lists(st.binary(min_size=1, max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b),
                min_size=1, max_size=20),
       st.lists(st.integers(0, 10_000), max_size=30), st.sampled_from([b"\n\n", b"\r\n\r\n"]))
def test_splitter_returns_every_event_whole_for_any_chunking(payloads, cuts, term):
    events = [b"data: " + p + term for p in payloads]
    data = b"".join(events)
    sp = SSESplitter()
    got = []
    for piece in chunked(data, cuts):
        got.extend(sp.feed(piece))
    assert got == events
    assert sp.pending == b""
    assert [event_data(e) for e in got] == payloads


def test_event_data_multiline_and_comments():
    assert event_data(b"data: a\ndata: b\n\n") == b"a\nb"
    assert event_data(b": ping\n\n") is None
    assert event_data(b"data:x\r\n\r\n") == b"x"


def test_splitter_on_real_vllm_capture():
    body = open(f"{FIXTURES}/07b_chat_stream_3tok_usage.txt").read().split("## BODY (de-chunked)\n")[1]
    body = body.split("\n## RECV LOG")[0].strip("\n").encode() + b"\n\n"
    ev = SSESplitter().feed(body)
    assert len(ev) == 6 and event_data(ev[-1]) == b"[DONE]"
    book = StreamBook("chat", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}, True)
    out = book.feed(ev)
    assert out == body and book.state is St.COMPLETE
    assert "".join(book.rx.text) == "}hunkengine" and book.rx.chunks == 3


# -- request plans and refusals -------------------------------------------------------------
@pytest.mark.parametrize("body,reason", [
    ({"prompt": "x", "n": 2, "stream": True}, "n>1"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of>1"),
    ({"prompt": "x", "echo": True, "stream": True}, "echo"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
    ({"prompt": ["a", "b"]}, "batched_prompt"),
])
def test_refusals_pass_through_unchanged(body, reason):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    raw = json.dumps(body).encode()
    plan = plan_request(path, raw)
    assert plan.refusal == reason
    assert plan.upstream_body == raw  # byte for byte


def test_armed_stream_asks_for_token_ids_and_bad_bodies_pass():
    plan = plan_request("/v1/completions", b'{"prompt":"hi","stream":true,"stream_options":{"include_usage":true}}')
    assert plan.refusal is None and plan.include_usage
    assert json.loads(plan.upstream_body)["return_token_ids"] is True
    for raw in (b"{", b"[]", b"", b"\xff"):
        p = plan_request("/v1/completions", raw)
        assert p.refusal == "body" and p.upstream_body == raw
    assert plan_request("/v1/models", b"").refusal == "path"


def rx_of(chunks, prompt_ids=None):
    """A Received from (text, ids) chunks, as the stream book records them."""
    rx = Received(prompt_token_ids=prompt_ids)
    for text, ids in chunks:
        rx.add(text, ids)
    return rx


def test_continuation_completions_ids_and_budgets():
    rx = rx_of([("a", [5]), ("b", [6])], [1, 2, 3])
    body = {"prompt": "hey", "max_tokens": 10, "min_tokens": 3, "stream": True}
    new = continuation_body("completions", body, rx, 100)
    assert new.kind == "completions" and (new.skip_ids, new.skip_chars, new.resent) == (0, 0, 2)
    assert new.body["prompt"] == [1, 2, 3, 5, 6] and new.body["max_tokens"] == 8 and new.body["min_tokens"] == 1
    assert continuation_body("completions", {**body, "max_tokens": 2}, rx, 100) is None
    with pytest.raises(Refused):
        continuation_body("completions", body, rx, 1)


def test_continuation_with_stop_strings_backs_up_past_the_hold_back():
    # stop "xyz": the engine holds 2 characters back, so after chunk i it had decoded 2 more
    # than it released; the continuation starts where no stop string can begin before it
    rx = rx_of([("", [5]), ("ab", [6]), ("c", [7]), ("d", [8]), ("e", [9])], [1])
    body = {"prompt": "hey", "max_tokens": 10, "stop": ["xyz"], "stream": True}
    new = continuation_body("completions", body, rx, 100)
    # 5 characters delivered: a stop string still to match begins at >= 3; after "ab" (2 ids)
    # the engine had decoded 4: too late; only the start qualifies (all regenerated)
    assert new.body["prompt"] == [1] and (new.skip_ids, new.skip_chars, new.resent) == (5, 5, 0)
    assert new.body["max_tokens"] == 10
    assert stop_holdback({"stop": "abc"}) == 2 and stop_holdback({"stop": ["a", "abcd"]}) == 3
    assert stop_holdback({"stop": ["abc"], "include_stop_str_in_output": True}) == 0
    long = rx_of([(c, [i]) for i, c in enumerate("abcdefghij")], [1])
    new = continuation_body("completions", {**body, "max_tokens": 20}, long, 100)
    # after chunk i (i+1 chars) the engine had decoded i+3; it must be <= 10 - 2
    assert new.body["prompt"] == [1, *range(6)] and new.skip_chars == 10 - 8 and new.skip_ids == 4


def test_continuation_chat_from_ids_goes_to_completions_without_chat_fields():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    rx = rx_of([("Hel", [7]), ("lo", [8])], [1, 3, 9, 2])
    new = continuation_body("chat", {"messages": msgs, "max_completion_tokens": 5, "tools": [],
                                     "temperature": 0, "stop": "x"}, rx, 100)
    assert new.kind == "completions"
    assert new.body == {"prompt": [1, 3, 9, 2, 7, 8], "max_tokens": 3, "temperature": 0, "stop": "x",
                        "stream": True, "return_token_ids": True}


def test_continuation_chat_without_ids_appends_one_assistant_message_never_an_instruction():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    rx = rx_of([("Hel", None), ("lo", None)])
    new = continuation_body("chat", {"messages": msgs, "max_completion_tokens": 5}, rx, 100)
    assert new.kind == "chat"
    assert new.body["messages"] == msgs + [{"role": "assistant", "content": "Hello"}]
    assert new.body["continue_final_message"] is True and new.body["add_generation_prompt"] is False
    assert new.body["max_completion_tokens"] == 3
    # the client's own prefill is extended, not doubled
    pre = msgs + [{"role": "assistant", "content": "Sure: "}]
    new = continuation_body("chat", {"messages": pre, "continue_final_message": True,
                                     "add_generation_prompt": False}, rx, 100)
    assert new.body["messages"][-1] == {"role": "assistant", "content": "Sure: Hello"}
    assert len(new.body["messages"]) == 3


# -- the stream book: any cut, any chunking, up to three attempts -----------------------------
def relay(kind, body, cuts_per_attempt, chunkings):
    """Run the book over attempts that are each cut after ``cut`` bytes; returns client bytes."""
    plan = plan_request("/v1/completions" if kind == "completions" else "/v1/chat/completions",
                        json.dumps(body).encode())
    book = StreamBook(kind, plan.body, plan.include_usage)
    req = json.loads(plan.upstream_body)
    out = []
    for attempt, cut in enumerate(cuts_per_attempt + [None]):
        sse, _ = generate(book.upstream_kind, req, rid=f"id-{attempt}", model="m", created=100 + attempt)
        data = sse if cut is None else sse[:cut % (len(sse) + 1)]
        sp = SSESplitter()
        for piece in chunked(data, chunkings[attempt % len(chunkings)]):
            out.append(book.feed(sp.feed(piece)))
        out.append(book.eof())
        if book.state is St.COMPLETE:
            break
        assert book.state is St.FAULTED
        req = book.next_request(10_000)
        if req is None:
            out.append(book.finish_length())
            break
    return b"".join(out), book


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["completions", "chat"]), n=st.integers(1, 12),
       usage=st.booleans(), cuts=st.lists(st.integers(0, 5000), max_size=3),
       chunkings=st.lists(st.lists(st.integers(0, 5000), max_size=8), min_size=1, max_size=3),
       ask_ids=st.booleans())
def test_any_cut_any_chunking_client_sees_the_uninterrupted_generation(kind, n, usage, cuts, chunkings, ask_ids):
    body = {"max_tokens": n, "stream": True}
    if ask_ids:
        body["return_token_ids"] = True
    if kind == "completions":
        body["prompt"] = "w5 w6 hello"
    else:
        body["messages"] = [{"role": "user", "content": "w9 hi"}]
    if usage:
        body["stream_options"] = {"include_usage": True}
    whole, gen = generate(kind, {**body, "return_token_ids": True}, rid="ref")
    ref = parse_client(whole)
    got_raw, book = relay(kind, body, cuts, chunkings)
    got = parse_client(got_raw)
    assert got["text"] == ref["text"]                      # nothing lost, nothing repeated
    assert got["token_ids"] == (gen if ask_ids else [])  # ids only when the client asked
    assert got["finishes"] == ["length"]                  # exactly one finish_reason
    assert got["dones"] == 1 and not got["errors"]
    assert len(got["ids"]) == 1 and got["models"] == {"m"}
    if usage:
        assert got["usage"] == ref["usage"]               # prompt once, completion = delivered
    else:
        assert got["usage"] == []
    assert book.state is St.COMPLETE


def test_first_attempt_bytes_are_forwarded_unchanged():
    body = {"prompt": "w1", "max_tokens": 5, "stream": True, "return_token_ids": True}
    whole, _ = generate("completions", body, rid="id-0", created=100)
    got, _book = relay("completions", body, [], [[3, 50, 51, 400]])
    assert got == whole


def test_in_band_error_faults_then_give_up_sends_one_error_and_no_done():
    book = StreamBook("completions", {"prompt": "w1", "max_tokens": 4}, False)
    whole, _ = generate("completions", {"prompt": "w1", "max_tokens": 4, "return_token_ids": True}, rid="r")
    evs = SSESplitter().feed(whole)
    out = book.feed(evs[:2] + [b'data: {"error":{"message":"boom","code":500}}\n\n'] + evs[2:])
    assert book.state is St.FAULTED and book.fault == "error"
    assert out == b"".join(evs[:2]).replace(b'token_ids":[' + str(book.rx.token_ids[0]).encode() + b"]",
                                            b'token_ids":null', 1).replace(
        b'token_ids":[' + str(book.rx.token_ids[1]).encode() + b"]", b'token_ids":null', 1).replace(
        b'"prompt_token_ids":' + json.dumps(book.rx.prompt_token_ids, separators=(",", ":")).encode(),
        b'"prompt_token_ids":null')  # the ids the relay asked for go out as null
    err = book.give_up("node failed twice")
    got = parse_client(out + err)
    assert got["dones"] == 0 and len(got["errors"]) == 1
    assert book.state is St.FAILED


def test_done_without_finish_is_a_truncation():
    book = StreamBook("completions", {"prompt": "w1", "max_tokens": 4}, False)
    whole, _ = generate("completions", {"prompt": "w1", "max_tokens": 4}, rid="r")
    evs = SSESplitter().feed(whole)
    book.feed(evs[:2] + [evs[-1]])
    assert book.state is St.FAULTED and book.fault == "truncated"


def test_tool_call_in_progress_is_not_continued():
    book = StreamBook("chat", {"messages": [{"role": "user", "content": "x"}]}, False)
    book.feed([b'data: {"id":"a","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
               b'"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"{"}}]},"finish_reason":null}]}\n\n'])
    book.set_fault("health")
    with pytest.raises(Refused, match="tool_call_in_progress"):
        book.next_request(100)


def test_fault_after_finish_closes_cleanly():
    body = {"prompt": "w1", "max_tokens": 3, "stream_options": {"include_usage": True}}
    book = StreamBook("completions", body, True)
    whole, _ = generate("completions", {**body, "return_token_ids": True}, rid="r")
    evs = SSESplitter().feed(whole)
    out = book.feed(evs[:3])  # the finish chunk, not the usage nor [DONE]
    out += book.set_fault("health")
    got = parse_client(out)
    assert book.state is St.COMPLETE and got["dones"] == 1 and got["usage"][0]["completion_tokens"] == 3


@given(st.sampled_from(list(St)), st.sampled_from(list(In)))
def test_transition_table_total_for_upstream_inputs(state, inp):
    """Every upstream input is allowed in every state; RESUME/GIVE_UP only after a fault."""
    if inp in (In.RESUME, In.GIVE_UP):
        assert ((state, inp) in TRANSITIONS) == (state is St.FAULTED)
    else:
        assert (state, inp) in TRANSITIONS
    book = StreamBook("completions", {"prompt": "x"}, False)
    book.state = state
    if (state, inp) in TRANSITIONS:
        book._go(inp)
        assert book.state is TRANSITIONS[(state, inp)]
    else:
        with pytest.raises(BookError):
            book._go(inp)


@given(st.lists(st.text(max_size=6), min_size=1, max_size=8), st.sampled_from(["completions", "chat"]),
       st.booleans())
def test_fast_path_records_any_text_exactly(texts, kind, ascii_only):
    """Token chunks are recorded without a JSON decode; what a rescue sees is still exact
    (quotes, backslashes, unicode, empty deltas)."""
    book = StreamBook(kind, {"prompt": "x"} if kind == "completions"
                      else {"messages": [{"role": "user", "content": "x"}]})
    evs = []
    for i, t in enumerate(texts):
        if kind == "completions":
            ch = {"index": 0, "text": t, "logprobs": None, "finish_reason": None, "token_ids": [i]}
        else:
            ch = {"index": 0, "delta": {"content": t}, "logprobs": None, "finish_reason": None, "token_ids": [i]}
        o = {"id": "a", "object": "o", "created": 1, "model": "m", "choices": [ch]}
        evs.append(b"data: " + json.dumps(o, separators=(",", ":"), ensure_ascii=ascii_only).encode() + b"\n\n")
    book.feed(evs)
    book.set_fault("health")
    assert "".join(book.rx.text) == "".join(texts)
    assert book.rx.token_ids == list(range(len(texts)))
    assert book.rx.chunks == len(texts)


@given(st.lists(st.binary(max_size=50), min_size=1, max_size=10), st.lists(st.integers(0, 10_000), max_size=20))
def test_http1_chunked_body_any_chunking(pieces, cuts):
    from sentinel_relay.http1 import ResponseReader
    body = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"
    wire = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    rr = ResponseReader()
    got = b"".join(b"".join(rr.feed(p)) for p in chunked(wire, cuts))
    assert rr.status == 200 and rr.header("content-type") == "text/event-stream"
    assert got == b"".join(pieces) and rr.complete


def _cmpl_chunk(rid: str, text: str, ids: list[int], finish: str | None = None, prompt_ids=None) -> bytes:
    ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
          "token_ids": ids}
    if prompt_ids is not None:
        ch["prompt_token_ids"] = prompt_ids
    obj = {"id": rid, "object": "text_completion", "created": 1, "model": "m", "choices": [ch]}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def test_cut_after_held_back_utf8_resumes_before_it_and_never_delivers_its_id_twice():
    # vLLM holds a token's text back while it is an incomplete UTF-8 sequence (text "" with its
    # id); continuing from that id makes its detokenizer emit the whole context as text, so the
    # relay resumes from the last token with text and drops the regenerated id.
    book = StreamBook("completions", {"prompt": "hi", "max_tokens": 4, "stream": True, "return_token_ids": True,
                                      "stream_options": {"include_usage": True}}, True)
    first = [_cmpl_chunk("c1", "a", [5], prompt_ids=[1, 2]), _cmpl_chunk("c1", "", [6])]
    out = [book.feed(first)]
    book.set_fault("reset")
    assert book.rx.held_back == 1
    req = book.next_request(100)
    assert req["prompt"] == [1, 2, 5] and req["max_tokens"] == 3
    second = [_cmpl_chunk("c2", "", [6], prompt_ids=[1, 2, 5]), _cmpl_chunk("c2", "é", [7]),
              _cmpl_chunk("c2", "b", [8], finish="length"), b"data: [DONE]\n\n"]
    out.append(book.feed(second))
    got = parse_client(b"".join(out))
    assert got["text"] == "aéb"
    assert got["token_ids"] == [5, 6, 7, 8]
    assert got["usage"][-1]["completion_tokens"] == 4 and got["usage"][-1]["prompt_tokens"] == 2
    assert got["finishes"] == ["length"] and got["dones"] == 1 and book.state is St.COMPLETE


def test_continuation_budget_counts_held_back_tokens_as_regenerated():
    rx = rx_of([("a", [5]), ("", [6]), ("", [7])], [1])
    new = continuation_body("completions", {"prompt": "x", "max_tokens": 10, "min_tokens": 4}, rx, 100)
    assert new.body["prompt"] == [1, 5] and new.body["max_tokens"] == 9 and new.body["min_tokens"] == 3
    assert new.skip_ids == 2
    chat = continuation_body("chat", {"messages": [{"role": "user", "content": "u"}], "max_tokens": 10}, rx, 100)
    assert chat.body["prompt"] == [1, 5] and chat.body["max_tokens"] == 9


def test_chat_without_a_token_limit_continues_from_ids_only_with_the_context_length():
    # chat's default limit is the rest of the context, /v1/completions' is 16: without the
    # model's context length the continuation stays on chat (from text), never cut at 16
    rx = rx_of([("Hel", [7]), ("lo", [8])], [1, 3, 9, 2])
    body = {"messages": [{"role": "user", "content": "u"}], "stream": True}
    assert continuation_body("chat", body, rx, 100).kind == "chat"
    new = continuation_body("chat", body, rx, 100, context_len=50)
    assert new.kind == "completions" and new.body["prompt"] == [1, 3, 9, 2, 7, 8]
    assert new.body["max_tokens"] == 50 - 6
    assert continuation_body("chat", body, rx, 100, context_len=6) is None  # the context is full
