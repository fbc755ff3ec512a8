"""Upstream HTTP/1.1 framing on the relay's hot path: ``sentinel_relay.http1.ResponseReader``
(the relay's interface on top of ``httptools``, llhttp) against ``httptools`` used bare (what the
interface costs), in one run, on the same bytes; with ``--old FILE`` also the hand-written parser
it replaced (the module as of commit e9958a2, loaded from a file).

The relay reads each SSE stream from Envoy as a chunked HTTP/1.1 response; one TCP read
usually holds exactly one HTTP chunk with one SSE event (~250 bytes, vLLM's token chunk). Cases:
one chunk per read (the common one), 8 chunks coalesced in one read (a burst after a pause), and
each chunk split over 2 reads. Reported: microseconds per HTTP chunk, median of ``--repeat``
runs, and the parsed bodies are checked equal.

    git show e9958a2:sentinel_relay/http1.py > /tmp/http1_handwritten.py   # optional
    .venv/bin/python benchmarks/relay_http1_parse.py [--chunks 20000] [--repeat 7] [--old /tmp/http1_handwritten.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import httptools

from sentinel_relay.http1 import ResponseReader

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"
        b"x-served-by: gpu-a\r\ndate: Wed, 02 Dec 2026 14:00:00 GMT\r\nserver: envoy\r\n"
        b"x-sentinel-upstream-host: 127.0.0.1:8001\r\ntransfer-encoding: chunked\r\n\r\n")
EVENT = (b'data: {"id":"cmpl-8f3a","object":"text_completion","created":1796210000,"model":"sim-model",'
         b'"choices":[{"index":0,"text":" tok%d","logprobs":null,"finish_reason":null,"stop_reason":null,'
         b'"prompt_token_ids":null,"token_ids":[%d]}]}\n\n')


def reads(n: int, shape: str) -> tuple[list[bytes], bytes]:
    """The TCP reads of one response of ``n`` events, and the body they carry."""
    chunks = [b"%x\r\n%b\r\n" % (len(e), e) for e in (EVENT % (i, 100 + i) for i in range(n))]
    body = b"".join(c.split(b"\r\n", 1)[1][:-2] for c in chunks)
    if shape == "one":
        out = chunks
    elif shape == "burst8":
        out = [b"".join(chunks[i:i + 8]) for i in range(0, n, 8)]
    else:  # split
        out = [p for c in chunks for p in (c[:len(c) // 2], c[len(c) // 2:])]
    return [HEAD, *out, b"0\r\n\r\n"], body


def make_reader(reader: Callable[[], ResponseReader]) -> Callable[[list[bytes]], bytes]:
    """Parse with the relay's interface (``feed`` returns the body pieces of each read)."""
    def run(data: list[bytes]) -> bytes:
        rr = reader()
        got: list[bytes] = []
        for d in data:
            got.extend(rr.feed(d))
        assert rr.complete and rr.status == 200
        return b"".join(got)
    return run


def load_old(path: str) -> Callable[[], ResponseReader]:
    """The hand-written ``ResponseReader`` from a file (same interface, its own module)."""
    spec = importlib.util.spec_from_file_location("http1_handwritten", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    reader: Callable[[], ResponseReader] = mod.ResponseReader
    return reader


def make_httptools() -> Callable[[list[bytes]], bytes]:
    """httptools bare: the least a parse on it costs (callbacks into one Python object)."""
    class Proto:
        __slots__ = ("body", "done", "headers")

        def __init__(self) -> None:
            self.body: list[bytes] = []
            self.headers: list[tuple[bytes, bytes]] = []
            self.done = False

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers.append((name, value))

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            self.done = True

    def run(data: list[bytes]) -> bytes:
        p = Proto()
        parser = httptools.HttpResponseParser(p)
        for d in data:
            parser.feed_data(d)
        assert p.done and parser.get_status_code() == 200
        return b"".join(p.body)
    return run


def timed(fn: Callable[[list[bytes]], bytes], data: list[bytes], n: int, repeat: int, want: bytes) -> float:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        got = fn(data)
        runs.append((time.perf_counter() - t) / n * 1e6)
        assert got == want
    return round(statistics.median(runs), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--old", metavar="FILE", help="the hand-written sentinel_relay/http1.py of e9958a2, to compare")
    args = ap.parse_args()
    runs = {"http1.py_us_per_chunk": make_reader(ResponseReader), "httptools_bare_us_per_chunk": make_httptools()}
    if args.old:
        runs["handwritten_us_per_chunk"] = make_reader(load_old(args.old))
    out: dict = {"python": sys.version.split()[0], "httptools": httptools.__version__}
    for shape in ("one", "burst8", "split"):
        data, body = reads(args.chunks, shape)
        out[shape] = {name: timed(fn, data, args.chunks, args.repeat, body) for name, fn in runs.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
