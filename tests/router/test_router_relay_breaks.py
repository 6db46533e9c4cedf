"""The relay against workers that lie or die and callers without the key (R-K5): a
request is never sent twice, ids say nothing, a worker's head is framed one way only.
Real routers, real workers on loopback (``raw_worker``), httpx and the ``openai`` SDK."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gwtest import wait_for
from raw_worker import BareServer, RawWorker, ok
from router_support import KEY, Router, serve_args, worker, write_registry

AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def raw() -> Iterator[list[RawWorker]]:
    made: list[RawWorker] = []
    yield made
    for w in made:
        w.stop()


def test_r_k5_request_ids_say_nothing_of_the_routers_pid_or_its_traffic(
    router: Router, raw: list[RawWorker]
) -> None:
    w = RawWorker(lambda n, head, body: ok())
    raw.append(w)
    r = router([worker("a", [w.url], ["wh"], slots={"fixed": 4})], poll_interval=30)
    with httpx.Client(trust_env=False, timeout=10) as client:
        ids = []
        for i in range(12):
            if i % 3 == 0:  # completions by the key holder between the stranger's reads
                client.post(f"{r.url}/v1/chat/completions", json={"model": "wh"}, headers=AUTH)
            answer = client.get(f"{r.url}/v1/capacity")
            assert answer.status_code == 401
            ids.append(answer.headers["x-router-request-id"])
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids), ids
    assert len({i[:6] for i in ids}) == len(ids), f"ids share a prefix: {ids}"
    assert not any(f"{os.getpid():x}" in i for i in ids)


def test_r_k5_a_request_the_worker_read_and_dropped_is_a_502_and_never_sent_again(
    router: Router, raw: list[RawWorker]
) -> None:
    # The second request of each connection is read, then the connection closed
    # unanswered: it may have run, so it must not run again.
    w = RawWorker(lambda n, head, body: ok() if n == 1 else None)
    raw.append(w)
    r = router([worker("a", [w.url], ["wh"], slots={"fixed": 4})], poll_interval=30)
    with httpx.Client(trust_env=False, timeout=10) as client:
        statuses = [
            client.post(
                f"{r.url}/v1/chat/completions", json={"model": "wh", "n": i}, headers=AUTH
            ).status_code
            for i in range(3)
        ]
    assert statuses == [200, 502, 200]
    assert len(w.posts) == 3, f"the worker read {len(w.posts)} requests for 3"


def test_r_k5_a_request_that_kills_its_worker_kills_one_worker_not_the_farm(
    router: Router, raw: list[RawWorker]
) -> None:
    def script(n: int, head: bytes, body: bytes) -> bytes | None:
        return None if b"poison" in body else ok()

    farm = [RawWorker(script, die=True) for _ in range(3)]
    raw.extend(farm)
    r = router(
        [worker(f"w{i}", [w.url], ["wh"], slots={"fixed": 4}) for i, w in enumerate(farm)],
        poll_interval=30,
    )
    with httpx.Client(trust_env=False, timeout=10) as client:
        for _ in range(3):  # kept-alive connections in the pool
            good = client.post(f"{r.url}/v1/chat/completions", json={"model": "wh"}, headers=AUTH)
            assert good.status_code == 200
        started = time.monotonic()
        poison = client.post(
            f"{r.url}/v1/chat/completions", json={"model": "wh", "poison": 1}, headers=AUTH
        )
        elapsed = time.monotonic() - started
    assert poison.status_code == 502
    ran = [sum(b"poison" in body for body in w.posts) for w in farm]
    assert sum(ran) == 1, f"the poison request ran on {ran} (w0, w1, w2)"
    assert elapsed < 2.0, f"{elapsed:.1f} s to the 502"


def test_r_k5_a_kept_alive_connection_the_worker_closed_while_idle_is_not_used(
    router: Router, raw: list[RawWorker]
) -> None:
    # Each connection carries one answer and the worker closes it right after (its
    # keep-alive timer): the pool notices before it writes the next request there.
    w = RawWorker(lambda n, head, body: ok(), one_answer=True)
    raw.append(w)
    r = router([worker("a", [w.url], ["wh"], slots={"fixed": 4})], poll_interval=30)
    with httpx.Client(trust_env=False, timeout=10) as client:
        statuses = []
        for _ in range(3):
            statuses.append(
                client.post(
                    f"{r.url}/v1/chat/completions", json={"model": "wh"}, headers=AUTH
                ).status_code
            )
            time.sleep(0.2)
    assert statuses == [200, 200, 200]
    assert len(w.posts) == 3


def _completion(content: str, model: str = "wh") -> bytes:
    return json.dumps(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
        }
    ).encode()


def _echo(n: int, head: bytes, body: bytes) -> bytes:
    question = json.loads(body)["messages"][0]["content"]
    return ok(_completion(f"echo: {question}"))


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)


LIES = {
    # The status line's bare LF makes the next line a header for h11 (httpx, the SDK):
    # chunked for the client, Content-Length for a lenient relay. The bytes past the
    # chunked end are a whole second answer, which the client gives the next request.
    "bare-lf-reason": lambda forged: (
        b"HTTP/1.1 200 OK\ntransfer-encoding: chunked\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(forged), forged)
    ),
    # Chunk lines ended by a bare LF: one framing for a lenient scanner, another for h11.
    "bare-lf-chunk": lambda forged: (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: application/json"
        b"\r\n\r\n" + forged.replace(b"\r\n", b"\n", 1)
    ),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_r_k5_a_worker_that_frames_its_answer_two_ways_gets_a_502_not_the_next_users_answer(
    router: Router, raw: list[RawWorker], lie: str
) -> None:
    forged_answer = ok(_completion("FORGED by the worker of an earlier request"))
    forged = _chunked(_completion("A's answer")) + forged_answer
    liar = RawWorker(lambda n, head, body: LIES[lie](forged))
    honest = RawWorker(_echo)
    raw.extend([liar, honest])
    r = router(
        [
            worker("liar", [liar.url], ["wl"], slots={"fixed": 4}),
            worker("honest", [honest.url], ["wh"], slots={"fixed": 4}),
        ],
        poll_interval=30,
    )
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key=KEY, max_retries=0, timeout=5)
    seen: list[str] = []
    try:
        answer = client.chat.completions.create(
            model="wl", messages=[{"role": "user", "content": "A's question"}]
        )
        seen.append(f"A: {answer.choices[0].message.content}")
    except openai.APIStatusError as refused:
        seen.append(f"A: {refused.status_code}")
    except openai.APIError as failed:  # a client left waiting: what a strict relay prevents
        seen.append(f"A: {type(failed).__name__}")
    for who in ("B", "C"):
        answer = client.chat.completions.create(
            model="wh", messages=[{"role": "user", "content": f"{who}'s secret"}]
        )
        seen.append(f"{who}: {answer.choices[0].message.content}")
    client.close()
    assert seen == ["A: 502", "B: echo: B's secret", "C: echo: C's secret"]


class SinkWorker(BareServer):
    """A worker that reads each POST's body into one reused buffer and answers ``{}``:
    what a 64 MiB body costs is then the router's, not the test worker's."""

    def __init__(self) -> None:
        self.bodies = 0
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        scratch = bytearray(1 << 20)
        with conn, conn.makefile("rb") as reader:
            while True:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = reader.readline()
                    if not line:
                        return
                    head += line
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                while length:
                    got = reader.readinto(memoryview(scratch)[: min(length, len(scratch))])
                    if not got:
                        return
                    length -= got
                if head.startswith(b"POST"):
                    self.bodies += 1
                conn.sendall(ok())


def test_r_k5_the_capacity_answer_is_on_time_while_four_64_mib_bodies_stream_in(
    registry_path: Path, key_file: Path
) -> None:
    # The router in a process of its own: what it costs is its own, not this test's
    # threads' (the senders and the worker here share one interpreter lock).
    sink = SinkWorker()
    write_registry(registry_path, [worker("a", [sink.url], ["wh"], slots={"fixed": 8})])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway_capacity",
            "router",
            *serve_args(registry_path, key_file),
            "--poll",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip().removeprefix("serving ").removesuffix("/v1/capacity")
        host, port = url.removeprefix("http://").rsplit(":", 1)

        def counted() -> bool:  # a busy machine may time out the first round's poll
            got = httpx.get(f"{url}/v1/capacity", headers=AUTH, trust_env=False).json()
            return bool(got["complete"] and got["models"])

        wait_for(counted, timeout=20, what="the worker counted")
        pad = (64 << 20) - 1024
        body = b'{"model": "wh", "pad": "' + b"x" * pad + b'"}'
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\nauthorization: Bearer "
            + KEY.encode()
            + b"\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        statuses: list[bytes] = []
        answers: list[bytes] = []  # any that is not a 200, to say why

        def send() -> None:
            with socket.create_connection((host, int(port)), timeout=60) as s:
                s.sendall(head)
                with memoryview(body) as view:
                    for at in range(0, len(body), 1 << 20):  # as a client's writes come
                        s.sendall(view[at : at + (1 << 20)])
                answer = s.recv(4096)
                statuses.append(answer.split(b" ")[1])
                if not answer.startswith(b"HTTP/1.1 200 "):
                    answers.append(answer)

        senders = [threading.Thread(target=send) for _ in range(4)]
        slowest = 0.0
        with httpx.Client(trust_env=False, timeout=30) as client:
            for t in senders:
                t.start()
            while any(t.is_alive() for t in senders):
                started = time.monotonic()
                capacity = client.get(f"{url}/v1/capacity", headers=AUTH)
                slowest = max(slowest, time.monotonic() - started)
                assert capacity.status_code == 200
                time.sleep(0.05)
        for t in senders:
            t.join()
        # Each body is relayed whole; on a machine with many times more runnable work
        # than cores a connect to the worker may miss its 2 s deadline (a 502 that says
        # so, never a cut), which is the machine's, not the body's cost.
        assert set(statuses) <= {b"200", b"502"} and statuses.count(b"200") >= 1, answers
        assert all(b"took the connection" in a for a in answers), answers
        assert sink.bodies == statuses.count(b"200")
        # The sidecar's deadline for this answer is 3 s; the bodies cost their size once.
        assert slowest < 3.0, f"the slowest capacity read took {slowest:.2f} s"
        print(f"slowest capacity read: {slowest:.3f} s")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
        sink.stop()
    assert "Traceback" not in err


def _metrics_requests(count: int) -> bytes:
    one = b"GET /metrics HTTP/1.1\r\nhost: r\r\nauthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    return one * count


def test_r_k5_hundreds_of_pipelined_requests_in_one_write_are_all_answered_in_order(
    router: Router, caplog: pytest.LogCaptureFixture
) -> None:
    r = router([], poll_interval=30)
    host, port = r.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(_metrics_requests(2000))
        answers = b""
        while answers.count(b"HTTP/1.1 200 ") < 2000:
            chunk = s.recv(1 << 20)
            assert chunk, f"closed after {answers.count(b'HTTP/1.1 200 ')} answers"
            answers += chunk
    assert "RecursionError" not in caplog.text


def test_r_k5_a_client_that_never_reads_its_pipelined_answers_holds_a_bounded_queue(
    router: Router,
) -> None:
    r = router([], poll_interval=30)
    host, port = r.url.removeprefix("http://").rsplit(":", 1)
    requests = _metrics_requests(100_000)  # 8 MB: more than the kernel's buffers hold
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        s.setblocking(False)
        sent = 0
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and sent < len(requests):
            try:
                sent += s.send(requests[sent : sent + (64 << 10)])
            except BlockingIOError:
                time.sleep(0.01)
        time.sleep(0.5)
        connections = r._connections
        assert connections is not None
        (conn,) = connections.open
        assert conn.transport is not None
        queued = conn.transport.get_write_buffer_size() + len(conn._buf)
    assert queued < 1 << 20, f"{queued} bytes held for a client that reads nothing ({sent} sent)"


def test_r_k5_a_client_gone_with_pipelined_bytes_behind_its_request_frees_the_worker(
    router: Router, raw: list[RawWorker]
) -> None:
    release = threading.Event()

    def hold(n: int, head: bytes, body: bytes) -> bytes:
        release.wait(30)
        return ok()

    w = RawWorker(hold)
    raw.append(w)
    r = router([worker("a", [w.url], ["wh"], slots={"fixed": 4})], poll_interval=30)
    host, port = r.url.removeprefix("http://").rsplit(":", 1)
    body = b'{"model": "wh"}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\nauthorization: Bearer "
        + KEY.encode()
        + b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    try:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(request + _metrics_requests(10_000))  # 800 KB behind it
            wait_for(lambda: r.in_flight() == {"a": 1}, what="the request at the worker")
        # Checked every 0.25 s; 5 s leaves a busy machine room (unbounded before).
        wait_for(lambda: r.in_flight() == {}, timeout=5, what="the worker freed")
    finally:
        release.set()
