"""The relay's pure core against the deterministic simulator and its byte-level tokenizer
(lone-byte tokens held back or shown as U+FFFD; pieces cut by the stop-string hold-back): for any
cut position and any stop list, completions and chat, usage asked or not, token ids asked or not,
the client's bytes through the stream book equal, but for the response id and created time, the
engine's bytes for the same request sent straight."""
from __future__ import annotations

import json
import re
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_wire import CFG, same_but_identity, sim_sse

from node_probe.sim import model as sim_model
from sentinel_relay.plan import plan_request
from sentinel_relay.sse import SSESplitter
from sentinel_relay.stream import St, StreamBook

_FP = re.compile(rb',"system_fingerprint":"[^"]*"\}\n\n(?=data: \[DONE\])')
CFG_WORDS = replace(CFG, byte_token_rate=0.0)  # words only: the prompt's generation is known
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Stop strings the simulator's words make likely: inside a word, across words, a whole word, a
# single character, U+FFFD (a lone byte's text), a non-ASCII word.
STOPS = ["he", " fox", "o", "e ", "\ufffd", " 東京", "ea", "n", " the lazy", "y d", "!", "é"]


def body_for(kind, prompt, max_tokens, stop, usage, ask_ids, include_stop):
    body = {"max_tokens": max_tokens, "stream": True}
    if kind == "completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if stop is not None:
        body["stop"] = stop
    if include_stop:
        body["include_stop_str_in_output"] = True
    if usage:
        body["stream_options"] = {"include_usage": True}
    if ask_ids:
        body["return_token_ids"] = True
    return body


def through_relay(kind, body, cuts, cfg=CFG):
    """The client's bytes when attempt i is cut after ``cuts[i]`` events."""
    plan = plan_request(PATHS[kind], json.dumps(body).encode())
    assert plan.refusal is None
    book = StreamBook(kind, plan.body, plan.include_usage)
    req = json.loads(plan.upstream_body)
    out, attempts = [], []
    for cut in [*cuts, None]:
        attempts.append((book.upstream_kind, req))
        events = SSESplitter().feed(sim_sse(book.upstream_kind, req, cfg))
        if cut is not None and any(b'"finish_reason":"' in e for e in events[:cut]) and \
                not any(b'"choices":[]' in e for e in events[:cut]):
            # cut between the finish and the engine's usage chunk: the relay writes its own, which
            # cannot carry the engine's system_fingerprint (no earlier chunk names it)
            book.synthesized_usage = True
        out.append(book.feed(events if cut is None else events[:cut]))
        out.append(book.eof())
        if book.state is St.COMPLETE:
            break
        assert book.state is St.FAULTED
        req = book.next_request(10_000)
        if req is None:
            out.append(book.finish_length())
            break
    return b"".join(out), book, attempts


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["completions", "chat"]),
       prompt=st.sampled_from(["The fox", "Tell the story", "naïve café", "x"]),
       max_tokens=st.integers(1, 24),
       stop=st.one_of(st.none(), st.sampled_from(STOPS), st.lists(st.sampled_from(STOPS), min_size=1, max_size=3)),
       usage=st.booleans(), ask_ids=st.booleans(), include_stop=st.booleans(),
       cuts=st.lists(st.integers(0, 30), max_size=3))
def test_any_cut_any_stop_list_client_bytes_equal_the_direct_stream(kind, prompt, max_tokens, stop, usage,
                                                                    ask_ids, include_stop, cuts):
    body = body_for(kind, prompt, max_tokens, stop, usage, ask_ids, include_stop)
    direct = sim_sse(kind, body)
    got, book, _ = through_relay(kind, body, cuts)
    assert_same(got, direct, book)
    assert book.state is St.COMPLETE


def assert_same(got, direct, book, *why):
    if getattr(book, "synthesized_usage", False) and b'"choices":[],"usage"' in direct:
        direct = _FP.sub(b"}\n\n", direct)
    assert same_but_identity(got) == same_but_identity(direct), why


def _held_back_window(kind, body):
    """Event positions around the first token whose text the engine held back (a stop string's
    hold-back or an incomplete byte sequence): every cut from 2 before to 3 after it."""
    events = SSESplitter().feed(sim_sse(kind, {**body, "return_token_ids": True}))
    first = 1 if kind == "chat" else 0  # chat opens with the role chunk
    for i, ev in enumerate(events[first:], first):
        if b'"content":""' in ev or b'"text":""' in ev:
            return range(max(0, i - 2), min(len(events), i + 4))
    return range(first, min(len(events), first + 4))


def test_stop_string_beginning_in_the_last_delivered_token_is_found_after_the_cut():
    # A stop string that begins inside the last token the client received (its last characters
    # held back) and ends in the next: the continuation still stops there, with the direct
    # stream's text, finish and usage; every cut position of the stream.
    for kind in ("completions", "chat"):
        pids = sim_model.tokenize("The fox") if kind == "completions" else sim_model.chat_prompt_ids(
            [("user", "The fox")], add_generation_prompt=True, continue_final_message=False)[0]
        probe = sim_model.Decoder(pids, 40, byte_rate=0.0)
        texts = [probe.step().text for _ in range(40)]
        m = next(i for i in range(4, 38) if len(texts[i].strip()) >= 3 and len(texts[i + 1].strip()) >= 3)
        stop = texts[m][-2:] + texts[m + 1][:2]
        # include_stop_str_in_output: the engine holds nothing back, but its stop check still spans
        # the tokens, so the continuation must regenerate from before the stop's start all the same
        for usage, include_stop in ((False, False), (True, False), (False, True), (True, True)):
            body = body_for(kind, "The fox", 40, [stop, "zz"], usage, False, include_stop)
            direct = sim_sse(kind, body, CFG_WORDS)
            assert b'"finish_reason":"stop"' in direct
            n = len(SSESplitter().feed(direct))
            for cut in range(n):
                got, book, _ = through_relay(kind, body, [cut], CFG_WORDS)
                assert_same(got, direct, book, kind, stop, cut, include_stop)


def test_window_around_held_back_token_every_cut_twice():
    for kind in ("completions", "chat"):
        for stop in (None, ["e "], [" the lazy", "o"]):
            for usage in (False, True):
                body = body_for(kind, "naïve café", 30, stop, usage, False, False)
                direct = sim_sse(kind, body)
                for cut in _held_back_window(kind, body):
                    for second in (None, 1, 3):
                        got, book, attempts = through_relay(kind, body, [cut] if second is None else [cut, second])
                        assert_same(got, direct, book, kind, stop, cut, second)
                        # a later attempt is the request as it was (nothing delivered yet) or, chat
                        # too, /v1/completions from token ids: never re-tokenized text
                        for k, b in attempts[1:]:
                            assert (k, b) == attempts[0] or (k == "completions" and isinstance(b["prompt"], list))


def test_simulator_tokenizer_disagrees_with_itself_like_a_byte_level_bpe():
    # A lone byte shown as U+FFFD re-tokenizes into another id; a piece cut inside a word too.
    lone = sim_model.FIRST_BYTE_ID + 0x80
    text = sim_model.detokenize([lone, sim_model.FIRST_WORD_ID + 1])  # 0x80, " quick"
    assert text == "\ufffd quick"
    assert sim_model.tokenize(text) != [lone, sim_model.FIRST_WORD_ID + 1]
    held = sim_model.detokenize([sim_model.FIRST_BYTE_ID + 0xC3])
    assert held == ""  # a lead byte is held back while the character may still complete
    assert sim_model.detokenize([sim_model.FIRST_BYTE_ID + 0xC3, sim_model.FIRST_BYTE_ID + 0xA9]) == "é"
    cut_word = " T"  # " The" held back after its first letter
    assert sim_model.tokenize(cut_word) != [sim_model.FIRST_WORD_ID]
    # and the chat template heals nothing: a partial final assistant piece stays a hashed id
    ids, heal = sim_model.chat_prompt_ids([("user", "hi"), ("assistant", " T")], add_generation_prompt=False,
                                          continue_final_message=True)
    assert heal == "" and ids[-1] == sim_model.tokenize(" T")[0]
