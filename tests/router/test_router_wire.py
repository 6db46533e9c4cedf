"""The relay's HTTP/1.1 framing (R-K5): one way to frame a message, or a refusal."""

from __future__ import annotations

import socket

import pytest
from router_support import KEY, Router, Sim, worker

from capacity_router import SimWorker
from capacity_router.wire import BadMessage, ChunkedScanner, parse_response_head

CHUNKED = b"5\r\nhello\r\n1;ext=1\r\n \r\n0\r\nx-trailer: 1\r\n\r\n"


def test_a_chunked_body_ends_where_its_framing_says_at_every_split() -> None:
    for cut in range(len(CHUNKED) + 1):
        scanner = ChunkedScanner()
        used = scanner.feed(CHUNKED[:cut])
        assert used == cut and (scanner.done == (cut == len(CHUNKED)))
        if not scanner.done:
            used = scanner.feed(CHUNKED[cut:] + b"NEXT")
            assert used == len(CHUNKED) - cut  # the next message's bytes are not the body's
        assert scanner.done


@pytest.mark.parametrize(
    "body",
    [b"zz\r\nhello\r\n", b"5\r\nhelloXX\r\n0\r\n\r\n", b"-1\r\n"],
    ids=["hex", "long", "neg"],
)
def test_a_chunked_body_that_lies_about_its_framing_is_refused(body: bytes) -> None:
    with pytest.raises(BadMessage):
        ChunkedScanner().feed(body)


def test_a_response_with_two_lengths_or_an_unknown_coding_is_refused() -> None:
    for head in (
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip",
        b"HTTP/1.1 200 OK\r\nbad header",
        b"HTTP/2 200 OK",
    ):
        with pytest.raises(BadMessage):
            parse_response_head(head)
    chunked = parse_response_head(
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked"
    )
    assert chunked.chunked and chunked.length is None


def _exchange(url: str, raw: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(raw)
        answer = b""
        while chunk := s.recv(65536):  # every refusal closes: the framing is lost
            answer += chunk
        return answer


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n", b"411"),
        (b"Content-Length: 4\r\nContent-Length: 5\r\n\r\nabcd", b"400"),
        (b"X-Folded: a\r\n b\r\nContent-Length: 0\r\n\r\n", b"400"),
        (b"X-Big: " + b"a" * 70_000 + b"\r\n\r\n", b"431"),
    ],
    ids=["te-and-cl", "two-lengths", "folded", "big-head"],
)
def test_r_k5_a_request_framed_two_ways_is_refused_and_the_connection_closed(
    router: Router, sim: Sim, raw: bytes, status: bytes
) -> None:
    a = sim(4)
    r = router([worker("a", [a.url], ["wh"])], poll_interval=30)
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer {KEY}\r\n"
    answer = _exchange(r.url, head.encode() + raw)
    assert answer.split(b" ", 2)[1] == status
    assert b"x-router-request-id: " in answer


def test_r_k5_a_client_that_asks_to_close_is_told_so_and_the_connection_closes(
    router: Router,
) -> None:
    sim = SimWorker(slots=2, openai=True, delay=0.01, model="wh")
    sim.start()
    try:
        r = router([worker("a", [sim.url], ["wh"])], poll_interval=30)
        body = b'{"model": "wh", "max_tokens": 2}'
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer {KEY}\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        answer = _exchange(r.url, head.encode() + body)  # returns at the router's close
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert b"\r\nconnection: close\r\n" in answer.split(b"\r\n\r\n", 1)[0] + b"\r\n"
    finally:
        sim.stop()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\ntransfer-encoding: chunked\r\ncontent-length: 5",
        b"HTTP/1.1 200 O\rK",
        b"HTTP/1.1 200 O\x00K",
        b"HTTP/1.1 200 O\x1b[2JK",
        b"HTTP/1.1 000 Zero",
        b"HTTP/1.1 099 Low",
        b"HTTP/1.1 +20 Sign",
    ],
    ids=["bare-lf", "cr", "nul", "esc", "000", "099", "sign"],
)
def test_r_k5_a_status_line_a_lenient_client_would_read_otherwise_is_refused(
    head: bytes,
) -> None:
    with pytest.raises(BadMessage) as refused:
        parse_response_head(head)
    assert refused.value.status == 502


@pytest.mark.parametrize(
    "body",
    [
        b"5\nhello\r\n0\r\n\r\n",
        b"5\r\nhello\n0\r\n\r\n",
        b"5\r\nhello\r\n0\n\r\n",
        b"5\r\nhello\r\n0\r\nset-cookie: a\nb: c\r\n\r\n",
        b"5\r\nhello\r\n0\r\nnot a field\r\n\r\n",
        b"5\r\nhello\r\n0\r\nx: a\x00b\r\n\r\n",
        b"5;a\x00b\r\nhello\r\n0\r\n\r\n",
    ],
    ids=["size-lf", "data-lf", "last-lf", "trailer-lf", "trailer-field", "trailer-nul", "ext-nul"],
)
def test_r_k5_chunked_framing_with_a_bare_lf_or_a_bad_trailer_is_refused(body: bytes) -> None:
    with pytest.raises(BadMessage) as refused:
        ChunkedScanner().feed(body)
    assert refused.value.status == 502
