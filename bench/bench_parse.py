"""The relay's HTTP/1.1 parsing beside httptools (llhttp), measured: CPU a message and
what each refuses (``python bench/bench_parse.py``; not part of ``make bench``).

Both sides of the relay as it parses them today (``capacity_router/wire.py``): a client's
request head (a chat completion as the ``openai`` SDK sends it) and a worker's streamed
answer (a head, then 40 SSE events, each one chunk and one read, as llama-server writes
them). httptools is driven as uvicorn drives it: one parser a connection, fed each read,
with the callbacks the relay would need (the URL, every header, the body for a request;
the status, every header and the body for an answer). CPU time of this thread
(``time.thread_time_ns``), best of five runs.

Then the worker answers ``tests/router`` refuses (a bare LF, CR, NUL or ESC in a status
line, status ``000``/``099``/``+20``, two lengths, a coding that is not chunked, bare-LF
chunk lines, a trailer that is not a field, a NUL in a chunk extension, a chunk longer
than its size): which of them each parser refuses.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capacity_router.wire import (
    BadMessage,
    ChunkedScanner,
    parse_request_head,
    parse_response_head,
)

BODY = b'{"messages":[{"role":"user","content":"hi"}],"model":"bench-model","max_tokens":40}'
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8731\r\n"
    b"Accept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\nAccept: application/json\r\n"
    b"Content-Type: application/json\r\nUser-Agent: OpenAI/Python 1.99.0\r\n"
    b"X-Stainless-Lang: python\r\nX-Stainless-Package-Version: 1.99.0\r\n"
    b"X-Stainless-OS: Linux\r\nX-Stainless-Arch: x64\r\nX-Stainless-Runtime: CPython\r\n"
    b"X-Stainless-Runtime-Version: 3.12.3\r\nAuthorization: Bearer bench-relay-key\r\n"
    b"X-Stainless-Async: false\r\nx-stainless-retry-count: 0\r\nx-stainless-read-timeout: 600\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
HEAD = (
    b"HTTP/1.1 200 OK\r\nAccess-Control-Allow-Origin: \r\nContent-Type: text/event-stream\r\n"
    b"Keep-Alive: timeout=5, max=100\r\nServer: llama.cpp\r\nTransfer-Encoding: chunked\r\n\r\n"
)
EVENTS = [
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" t%d"}}],'
    b'"created":1765000000,"id":"chatcmpl-abc","model":"bench-model","system_fingerprint":'
    b'"b1-abc","object":"chat.completion.chunk"}\n\n' % i
    for i in range(40)
] + [b"data: [DONE]\n\n"]
READS = [HEAD] + [b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS] + [b"0\r\n\r\n"]

BAD_HEADS = {
    "bare-lf": b"HTTP/1.1 200 OK\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n",
    "cr": b"HTTP/1.1 200 O\rK\r\ncontent-length: 0\r\n\r\n",
    "nul": b"HTTP/1.1 200 O\x00K\r\ncontent-length: 0\r\n\r\n",
    "esc": b"HTTP/1.1 200 O\x1b[2JK\r\ncontent-length: 0\r\n\r\n",
    "000": b"HTTP/1.1 000 Zero\r\ncontent-length: 0\r\n\r\n",
    "099": b"HTTP/1.1 099 Low\r\ncontent-length: 0\r\n\r\n",
    "sign": b"HTTP/1.1 +20 Sign\r\ncontent-length: 0\r\n\r\n",
    "two-lengths": b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n",
    "gzip-coding": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
    "not-a-field": b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
}
CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
BAD_BODIES = {
    "size-lf": b"5\nhello\r\n0\r\n\r\n",
    "data-lf": b"5\r\nhello\n0\r\n\r\n",
    "last-lf": b"5\r\nhello\r\n0\n\r\n",
    "trailer-lf": b"5\r\nhello\r\n0\r\nset-cookie: a\nb: c\r\n\r\n",
    "trailer-field": b"5\r\nhello\r\n0\r\nnot a field\r\n\r\n",
    "trailer-nul": b"5\r\nhello\r\n0\r\nx: a\x00b\r\n\r\n",
    "ext-nul": b"5;a\x00b\r\nhello\r\n0\r\n\r\n",
    "hex": b"zz\r\nhello\r\n",
    "long": b"5\r\nhelloXX\r\n0\r\n\r\n",
    "neg": b"-1\r\n",
}


def best_ns(run: Callable[[], None], n: int) -> float:
    times = []
    for _ in range(5):
        started = time.thread_time_ns()
        for _ in range(n):
            run()
        times.append((time.thread_time_ns() - started) / n)
    return min(times)


def ours_request() -> None:
    end = REQUEST.find(b"\r\n\r\n")
    head = parse_request_head(REQUEST[:end])
    body = bytearray(REQUEST[end + 4 : end + 4 + head.length])
    assert len(body) == head.length


def ours_answer() -> None:
    buf = READS[0]
    head = parse_response_head(buf[: buf.find(b"\r\n\r\n")])
    assert head.chunked
    scanner = ChunkedScanner()
    for data in READS[1:]:
        scanner.feed(data)
    assert scanner.done


class _Request:
    __slots__ = ("body", "done", "headers", "url")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.url = b""
        self.done = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = True


class _Answer:
    __slots__ = ("done", "headers", "status")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = b""
        self.done = False

    def on_status(self, status: bytes) -> None:
        self.status += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        pass  # the relay passes the raw bytes on: only the end matters

    def on_message_complete(self) -> None:
        self.done = True


def main() -> None:
    try:
        import httptools
    except ImportError:
        sys.exit("httptools is not installed (pip install httptools)")

    def llhttp_request() -> None:
        sink = _Request()
        httptools.HttpRequestParser(sink).feed_data(REQUEST)
        assert sink.done

    def llhttp_answer() -> None:
        sink = _Answer()
        parser = httptools.HttpResponseParser(sink)
        for data in READS:
            parser.feed_data(data)
        assert sink.done and parser.get_status_code() == 200

    n = 20_000
    print(f"httptools {httptools.__version__} (llhttp), CPU a message, best of 5 x {n}:")
    rows = [
        ("request head + body (17 headers)", ours_request, llhttp_request),
        ("streamed answer: head + 41 chunks in 43 reads", ours_answer, llhttp_answer),
    ]
    for what, ours, theirs in rows:
        a, b = best_ns(ours, n), best_ns(theirs, n)
        print(f"  {what}: wire.py {a / 1000:.1f} us, httptools {b / 1000:.1f} us")

    def refuses_ours(raw: bytes, body: bytes = b"") -> bool:
        try:
            head = parse_response_head(raw[: raw.find(b"\r\n\r\n")])
            if body:
                ChunkedScanner().feed(body)
            return head is None
        except BadMessage:
            return True

    def refuses_llhttp(raw: bytes) -> bool:
        try:
            httptools.HttpResponseParser(_Answer()).feed_data(raw)
        except httptools.HttpParserError:
            return True
        return False

    print("worker answers refused (wire.py / httptools):")
    for name, raw in BAD_HEADS.items():
        print(f"  head {name}: {refuses_ours(raw)} / {refuses_llhttp(raw)}")
    for name, body in BAD_BODIES.items():
        print(f"  chunked {name}: {refuses_ours(CHUNKED, body)} / {refuses_llhttp(CHUNKED + body)}")


if __name__ == "__main__":
    main()
