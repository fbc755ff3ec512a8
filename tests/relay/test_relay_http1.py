"""The relay's upstream HTTP/1.1 framing (``sentinel_relay.http1`` on httptools/llhttp): bodies
split at every read boundary, lengths, a connection closed mid-body, and bytes that are not HTTP
(a clear :class:`HTTPFramingError`, never another exception), the reader alone and inside
:class:`UpstreamExchange` over a real TCP connection."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sentinel_relay.http1 import HTTPFramingError, ResponseReader
from sentinel_relay.upstream import open_exchange

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"choices":[{"index":0,"text":" tok%d","token_ids":[%d]}]}\n\n' % (i, 100 + i) for i in range(3)]
CHUNKED = HEAD + b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"


def feed_all(reads: list[bytes]) -> tuple[ResponseReader, bytes]:
    rr = ResponseReader()
    return rr, b"".join(b"".join(rr.feed(d)) for d in reads)


def test_chunked_body_split_at_every_position_into_two_and_three_reads():
    for i in range(1, len(CHUNKED)):
        rr, got = feed_all([CHUNKED[:i], CHUNKED[i:]])
        assert (rr.status, rr.reason, rr.complete, got) == (200, "OK", True, b"".join(EVENTS)), i
        j = (i + len(CHUNKED)) // 2
        rr, got = feed_all([CHUNKED[:i], CHUNKED[i:j], CHUNKED[j:]])
        assert rr.complete and got == b"".join(EVENTS), (i, j)
    rr, got = feed_all([CHUNKED[k:k + 1] for k in range(len(CHUNKED))])
    assert rr.complete and got == b"".join(EVENTS) and rr.header("content-type") == "text/event-stream"


def test_head_is_ready_before_the_body_and_trailers_are_not_headers():
    rr = ResponseReader()
    assert rr.feed(HEAD) == [] and rr.head_done and not rr.complete
    assert rr.headers == [("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked")]
    assert rr.feed(b"3;ext=1\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n") == [b"abc"]
    assert rr.complete and rr.header("x-trailer") is None


def test_content_length_body_any_split_and_bytes_after_it_ignored():
    wire = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 11\r\nx-a:  padded  \r\n\r\nhello world"
    for i in range(1, len(wire) + 1):
        rr, got = feed_all([wire[:i], wire[i:] + b"HTTP/1.1 200 OK\r\n\r\nnot ours"])
        assert (rr.status, rr.reason, got, rr.complete) == (400, "Bad Request", b"hello world", True), i
        assert rr.header("X-A") == "padded" and rr.feed(b"more") == []
    rr, got = feed_all([b"HTTP/1.1 204 No Content\r\n\r\n"])
    assert rr.complete and got == b"" and rr.status == 204


def test_connection_closed_mid_chunk_or_short_of_the_length_is_not_a_clean_end():
    for cut in (len(HEAD) + 2, len(HEAD) + 10, len(CHUNKED) - 3):
        rr, got = feed_all([CHUNKED[:cut]])
        assert not rr.complete and not rr.eof(), cut
        assert b"".join(EVENTS).startswith(got)
    rr, got = feed_all([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab"])
    assert got == b"ab" and not rr.eof()
    rr, _ = feed_all([b"HTTP/1.1 200 OK\r\nContent-Le"])
    assert not rr.head_done and not rr.eof()
    # No length, not chunked: the close is the body's end.
    rr, got = feed_all([b"HTTP/1.1 200 OK\r\n\r\nab", b"cd"])
    assert got == b"abcd" and not rr.complete and rr.eof() and rr.complete


@pytest.mark.parametrize(("wire", "why"), [
    (b"garbage\r\n\r\n", "bad response head"),
    (b"\x00\xff\x16\x03\x01 tls hello", "bad response head"),
    (b"HTTP/1.1 2x0 OK\r\n\r\n", "bad response head"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad response head"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "Content-Length"),
    (HEAD + b"zz\r\nab\r\n", "chunk size"),
    (HEAD + b"3\r\nabcXX0\r\n\r\n", "bad response"),
    (HEAD + b"ffffffffffffffffffff\r\n", "bad response"),
    # Framing that a lenient parser reads one way and Envoy another: refused, not guessed.
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
     "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde", "Content-Length"),
    (HEAD + b"1_0\r\n0123456789abcdef\r\n0\r\n\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nX: a\nb\r\nContent-Length: 1\r\n\r\na", "bad response head"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * (70 << 10), "over 65536 bytes"),
])
def test_bytes_that_are_not_http_framing_are_a_clear_error(wire, why):
    rr = ResponseReader()
    with pytest.raises(HTTPFramingError, match=why):
        for k in range(0, len(wire), 4096):
            rr.feed(wire[k:k + 4096])


@given(st.lists(st.binary(max_size=200), max_size=8), st.booleans())
def test_any_bytes_give_pieces_or_a_framing_error_never_another_exception(reads, with_head):
    rr = ResponseReader()
    try:
        for d in ([HEAD] if with_head else []) + reads:
            assert all(isinstance(p, bytes) for p in rr.feed(d))
    except HTTPFramingError as e:
        assert str(e)
    assert isinstance(rr.eof(), bool)


async def _exchange(wire: list[bytes]) -> tuple[str | None, bytes, int]:
    """One exchange with a real TCP server that sends ``wire`` (read by read) and closes."""
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        for d in wire:
            w.write(d)
            await w.drain()
            await asyncio.sleep(0.01)
        w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        ex = await open_exchange("127.0.0.1", port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        got: list[bytes] = []
        ex.consume(got.append)
        reason = await asyncio.wait_for(ex.done, 10)
        if ex.head.exception() is not None:  # no head: the exchange said why in ``done``
            assert reason in ("reset", "framing")
        return reason, b"".join(got), ex.reader.status
    finally:
        server.close()
        await server.wait_closed()


async def test_exchange_over_tcp_ends_clean_cut_or_framing():
    body = b"".join(EVENTS)
    half = len(HEAD) + 20
    assert await _exchange([CHUNKED[:half], CHUNKED[half:]]) == (None, body, 200)
    # Closed mid-chunk: a reset, with the bytes that did arrive delivered.
    reason, got, status = await _exchange([CHUNKED[:half]])
    assert (reason, status) == ("reset", 200) and body.startswith(got) and got
    assert await _exchange([b"HTTP/1.1 200 OK\r\n\r\nuntil ", b"close"]) == (None, b"until close", 200)
    assert await _exchange([b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort"]) == ("reset", b"short", 200)
    assert (await _exchange([b"SSH-2.0-OpenSSH_9.6\r\n"]))[0] == "framing"
