"""The router serves the farm: OpenAI-compatible requests relayed to a worker (R-K5).

Real router, real simulated OpenAI workers on loopback, the official ``openai`` SDK
as the client.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gwtest import free_port, stopped_at_exit, wait_for
from router_support import (
    KEY,
    LoopbackHTTP,
    QuietHandler,
    Router,
    serve_args,
    worker,
    write_registry,
)

from capacity_contract.tokens import request_charge
from capacity_router import RouterServer, SimWorker, proxy
from capacity_router.proxy import Candidate, choose
from capacity_router.registry import SlotSource, Worker

MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def openai_sim() -> Iterator[Callable[..., SimWorker]]:
    with stopped_at_exit(SimWorker.stop) as keep:

        def make(
            slots: int = 4, delay: float = 0.05, model: str = "wh", n_ctx: int = 4096
        ) -> SimWorker:
            w = SimWorker(slots=slots, openai=True, delay=delay, model=model, n_ctx=n_ctx)
            w.start()
            return keep(w)

        yield make


OpenAISim = Callable[..., SimWorker]


def sdk(router: RouterServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0, timeout=30)


def running(w: SimWorker) -> int:
    return w.in_flight[0]


# -- requests through the router, with the official SDK -------------------------------


def test_r_k5_a_chat_completion_goes_through_the_router(
    router: Router, openai_sim: OpenAISim
) -> None:
    a = openai_sim()
    r = router([worker("a", [a.url], ["wh"])])
    answer = sdk(r).chat.completions.create(model="wh", messages=MESSAGES, max_tokens=3)
    assert answer.choices[0].message.content == "t0 t1 t2"
    assert answer.model == "wh"
    wait_for(lambda: a.completions == 1 and r.in_flight() == {}, what="the request's end")


def test_r_k5_a_streamed_chat_completion_goes_through_the_router(
    router: Router, openai_sim: OpenAISim
) -> None:
    a = openai_sim()
    r = router([worker("a", [a.url], ["wh"])])
    stream = sdk(r).chat.completions.create(
        model="wh", messages=MESSAGES, max_tokens=6, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "t0 t1 t2 t3 t4 t5 "
    assert chunks[-1].choices[0].finish_reason == "stop"
    # The SDK stops at [DONE]; the worker's end of the stream follows a moment later.
    wait_for(lambda: a.completions == 1 and r.in_flight() == {}, what="the stream's end")


def test_r_k5_models_are_what_eligible_workers_serve(router: Router, openai_sim: OpenAISim) -> None:
    a, b, sick, drained = openai_sim(), openai_sim(), openai_sim(), openai_sim()
    sick.set_healthy(False)
    r = router(
        [
            worker("a", [a.url], ["wh", "wh-long"]),
            worker("b", [b.url], ["other", "wh"]),
            worker("sick", [sick.url], ["sick-only"]),
            worker("drained", [drained.url], ["drained-only"], fenced=True),
        ]
    )
    client = sdk(r)
    assert [m.id for m in client.models.list()] == ["other", "wh", "wh-long"]
    assert client.models.retrieve("wh-long").id == "wh-long"
    r.fence("b")
    assert [m.id for m in client.models.list()] == ["wh", "wh-long"]
    with pytest.raises(openai.APIStatusError) as refused:
        client.models.retrieve("other")
    assert refused.value.status_code == 503  # registered, nothing serves it now


def test_r_k5_an_unknown_model_is_404_model_not_found(
    router: Router, openai_sim: OpenAISim
) -> None:
    a = openai_sim()
    r = router([worker("a", [a.url], ["wh"])])
    with pytest.raises(openai.NotFoundError) as refused:
        sdk(r).chat.completions.create(model="typo-model", messages=MESSAGES)
    assert refused.value.code == "model_not_found"
    assert refused.value.param == "model"
    assert "typo-model" in refused.value.message
    assert a.completions == 0


def test_r_k5_a_model_no_healthy_worker_serves_is_503_with_retry_after(
    router: Router, openai_sim: OpenAISim
) -> None:
    a, b = openai_sim(), openai_sim()
    b.set_healthy(False)
    r = router([worker("a", [a.url], ["wh"], fenced=True), worker("b", [b.url], ["wh"])])
    with pytest.raises(openai.InternalServerError) as refused:
        sdk(r).chat.completions.create(model="wh", messages=MESSAGES)
    assert refused.value.status_code == 503
    assert refused.value.code == "no_healthy_worker"
    assert refused.value.response.headers["retry-after"] == "1"
    assert a.completions == b.completions == 0


def test_r_k5_a_body_without_a_model_is_400(router: Router, openai_sim: OpenAISim) -> None:
    a = openai_sim()
    r = router([worker("a", [a.url], ["wh"])])
    for body in (b"not json", b'{"messages": []}', b'{"model": 7}', b"[]"):
        response = httpx.post(
            f"{r.url}/v1/chat/completions", content=body, headers=AUTH, trust_env=False
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "model"


def test_r_k5_a_body_over_the_bound_is_413_and_reaches_no_worker(
    router: Router, recording: RecordingWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(proxy, "MAX_REQUEST_BYTES", 1000)  # the router runs in this process
    r = router([worker("a", [recording.url], ["wh"])])
    body = json.dumps({"model": "wh", "input": "x" * 1000}).encode()
    response = httpx.post(f"{r.url}/v1/embeddings", content=body, headers=AUTH, trust_env=False)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert recording.seen == []


# -- which worker ------------------------------------------------------------------------


def _candidate(worker_id: str, slots: int, in_flight: int) -> Candidate:
    w = Worker(
        id=worker_id, urls=("http://127.0.0.1:1",), models=("wh",), slots=SlotSource(fixed=2)
    )
    return Candidate(w, slots, in_flight)


@pytest.mark.parametrize(
    ("candidates", "chosen"),
    [
        ([], None),
        ([("a", 4, 0)], "a"),
        ([("a", 2, 1), ("b", 2, 0)], "b"),  # most free
        ([("a", 8, 5), ("b", 2, 0)], "a"),  # 3 free beats 2 free
        ([("a", 4, 2), ("b", 2, 0)], "b"),  # a tie on free: fewer in flight
        ([("a", 2, 0), ("b", 2, 0)], "a"),  # a full tie: registry order
        ([("a", 2, 4), ("b", 1, 2)], "b"),  # all full: the least over
    ],
)
def test_r_k5_the_worker_with_the_most_free_slots_is_chosen(
    candidates: list[tuple[str, int, int]], chosen: str | None
) -> None:
    best = choose([_candidate(*c) for c in candidates])
    assert (None if best is None else best.worker.id) == chosen


def test_r_k5_the_next_request_goes_to_the_worker_with_more_free_slots(
    router: Router, openai_sim: OpenAISim
) -> None:
    a, b = openai_sim(slots=3, delay=20), openai_sim(slots=1, delay=20)
    r = router([worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh"])])
    client = sdk(r)
    streams = []
    try:
        for expected in ({"a": 1}, {"a": 2}, {"a": 2, "b": 1}):
            # create() returns once the worker answered its headers: the request runs there.
            streams.append(
                client.chat.completions.create(
                    model="wh", messages=MESSAGES, max_tokens=40, stream=True
                )
            )
            assert r.in_flight() == expected
        assert (running(a), running(b)) == (2, 1)
    finally:
        for stream in streams:
            stream.close()
    wait_for(lambda: r.in_flight() == {}, what="the router's count back to 0")


def test_r_k5_a_fenced_worker_finishes_its_stream_and_gets_no_new_request(
    router: Router, openai_sim: OpenAISim
) -> None:
    a, b = openai_sim(slots=4, delay=1.5), openai_sim(slots=2, delay=0.05)
    r = router([worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh"])])
    client = sdk(r)
    stream = client.chat.completions.create(
        model="wh", messages=MESSAGES, max_tokens=6, stream=True
    )
    chunks = iter(stream)
    first = next(chunks)
    assert r.in_flight() == {"a": 1}
    r.fence("a")
    for _ in range(3):
        client.chat.completions.create(model="wh", messages=MESSAGES, max_tokens=2)
    wait_for(lambda: b.completions == 3, what="b's three completions")
    rest = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in [first, *rest])
    assert text == "t0 t1 t2 t3 t4 t5 "
    assert rest[-1].choices[0].finish_reason == "stop"
    wait_for(lambda: a.completions == 1 and r.in_flight() == {}, what="the stream's end")


def test_r_k5_a_worker_url_that_refuses_is_skipped_for_its_next_url(
    router: Router, openai_sim: OpenAISim
) -> None:
    a = openai_sim()
    dead = f"http://127.0.0.1:{free_port()}"
    r = router([worker("a", [dead, a.url], ["wh"])])
    answer = sdk(r).chat.completions.create(model="wh", messages=MESSAGES, max_tokens=2)
    assert answer.choices[0].message.content == "t0 t1"


# -- a client that leaves ------------------------------------------------------------------


def test_r_k5_a_client_that_leaves_mid_stream_frees_the_upstream_request(
    router: Router, openai_sim: OpenAISim
) -> None:
    a = openai_sim(slots=2, delay=30)  # 60 tokens, one every 0.5 s: 30 s if left running
    r = router([worker("a", [a.url], ["wh"])])
    body = {"model": "wh", "messages": MESSAGES, "max_tokens": 60, "stream": True}
    with (
        httpx.Client(trust_env=False) as client,
        client.stream("POST", f"{r.url}/v1/chat/completions", json=body, headers=AUTH) as response,
    ):
        assert response.status_code == 200
        assert next(response.iter_raw()).startswith(b"data: ")
        assert running(a) == 1
    wait_for(lambda: r.in_flight() == {}, what="the router's count back to 0")
    wait_for(lambda: a.in_flight == (0, 0), what="the worker's slot freed")
    assert a.completions == 1  # ended, not finished: 29 s early


def test_r_k5_a_client_that_leaves_before_the_answer_releases_the_workers_count(
    router: Router, openai_sim: OpenAISim
) -> None:
    a = openai_sim(slots=2, delay=30)
    r = router([worker("a", [a.url], ["wh"])])
    body = {"model": "wh", "messages": MESSAGES}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{r.url}/v1/chat/completions", json=body, headers=AUTH, timeout=1.0, trust_env=False
        )
    wait_for(lambda: r.in_flight() == {}, what="the router's count back to 0")


# -- credentials and what goes upstream ----------------------------------------------------


class RecordingWorker(LoopbackHTTP):
    """A llama.cpp-shaped worker that records each POST and answers it with its path."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
        outer = self

        class Handler(QuietHandler):
            def _answer(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Upstream", "recorded")
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path.endswith("/v1/models"):  # lists nothing: served ids unchecked
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self._answer(b'{"total_slots": 2}' if self.path.endswith("/props") else b"{}")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                outer.seen.append(
                    (self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                )
                self._answer(json.dumps({"path": self.path}).encode())

        super().__init__(Handler)


@pytest.fixture
def recording() -> Iterator[RecordingWorker]:
    with RecordingWorker() as w:
        yield w


@pytest.mark.parametrize("key", [None, "wrong-key", f"{KEY}x"], ids=["none", "wrong", "longer"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings", "/v1/models"])
def test_r_k5_relayed_paths_need_the_routers_bearer(
    router: Router, recording: RecordingWorker, key: str | None, path: str
) -> None:
    r = router([worker("a", [recording.url], ["wh"])])
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    if path == "/v1/models":
        response = httpx.get(f"{r.url}{path}", headers=headers, trust_env=False)
    else:
        response = httpx.post(
            f"{r.url}{path}", json={"model": "wh"}, headers=headers, trust_env=False
        )
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert recording.seen == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "wh", "messages": MESSAGES}),
        ("/v1/completions", {"model": "wh", "prompt": "hello", "stream": False}),
        ("/v1/embeddings", {"model": "wh", "input": ["a", "b"]}),
    ],
)
def test_r_k5_each_relayed_path_reaches_the_worker_byte_for_byte(
    router: Router, recording: RecordingWorker, path: str, body: dict[str, Any]
) -> None:
    prefixed = f"{recording.url}/upstream/wh"  # a URL with a path prefix, as llama-swap's
    r = router([worker("a", [prefixed], ["wh"], slots={"fixed": 2})])
    raw = json.dumps(body, separators=(",", ":")).encode() + b"  "
    response = httpx.post(
        f"{r.url}{path}?trace=1",
        content=raw,
        headers={**AUTH, "Content-Type": "application/json", "X-Trace": "t-1"},
        trust_env=False,
    )
    assert response.status_code == 200
    assert response.json() == {"path": f"/upstream/wh{path}?trace=1"}
    assert response.headers["x-upstream"] == "recorded"
    assert "server" not in response.headers
    (_, headers, seen_body) = recording.seen[-1]
    assert seen_body == raw
    assert headers["x-trace"] == "t-1"
    assert "authorization" not in headers  # the worker has no key: none is sent


def test_r_k5_the_worker_gets_its_own_key_never_the_clients(
    registry_path: Path, key_file: Path, recording: RecordingWorker
) -> None:
    write_registry(
        registry_path,
        [worker("a", [recording.url], ["wh"]), worker("b", [recording.url + "/b"], ["other"])],
    )
    keys = {"a": b"worker-a-key"}
    with RouterServer(
        registry_path, key_file, poll_interval=0.2, worker_key=lambda w: keys.get(w.id)
    ) as r:
        for model in ("wh", "other"):
            response = httpx.post(
                f"{r.url}/v1/chat/completions",
                json={"model": model, "messages": MESSAGES},
                headers=AUTH,
                trust_env=False,
            )
            assert response.status_code == 200
    (_, to_a, _), (_, to_b, _) = recording.seen
    assert to_a["authorization"] == "Bearer worker-a-key"
    assert "authorization" not in to_b
    for headers in (to_a, to_b):
        assert KEY not in json.dumps(headers)


def test_r_k5_a_worker_with_a_key_file_gets_that_key_on_relayed_requests(
    registry_path: Path, key_file: Path, recording: RecordingWorker
) -> None:
    worker_key = registry_path.parent / "worker-a.key"
    worker_key.write_text("worker-a-file-key\n")
    worker_key.chmod(0o600)
    write_registry(registry_path, [worker("a", [recording.url], ["wh"], keyFile=worker_key.name)])
    with RouterServer(registry_path, key_file, poll_interval=0.2) as r:
        response = httpx.post(
            f"{r.url}/v1/chat/completions",
            json={"model": "wh", "messages": MESSAGES},
            headers=AUTH,
            trust_env=False,
        )
        assert response.status_code == 200
    (_, headers, _) = recording.seen[-1]
    assert headers["authorization"] == "Bearer worker-a-file-key"


# -- as an operator runs it ------------------------------------------------------------------


def test_r_k5_router_serve_relays_a_stream_from_a_simworker_process(
    registry_path: Path, key_file: Path
) -> None:
    cli = [sys.executable, "-m", "gateway_capacity", "router"]
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> str:
        proc = subprocess.Popen([*cli, *args], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        return proc.stdout.readline()

    try:
        line = start("simworker", "--slots", "2", "--openai", "--delay", "0.2", "--model", "wh")
        sim_url = line.split(" on ", 1)[1].split(" ", 1)[0]
        write_registry(registry_path, [worker("a", [sim_url], ["wh"])])
        line = start(*serve_args(registry_path, key_file), "--poll", "0.5")
        url = line.strip().removeprefix("serving ").removesuffix("/v1/capacity")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30)
        stream = client.chat.completions.create(
            model="wh", messages=MESSAGES, max_tokens=4, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream)
        assert text == "t0 t1 t2 t3 "
    finally:
        for proc in procs:
            proc.terminate()
            proc.communicate(timeout=20)


def test_r_k5_connection_drops_only_hop_by_hop_names_never_the_clients_accept_encoding(
    router: Router, recording: RecordingWorker
) -> None:
    r = router([worker("a", [recording.url], ["wh"])])
    response = httpx.post(
        f"{r.url}/v1/chat/completions",
        json={"model": "wh", "messages": MESSAGES},
        headers={
            **AUTH,
            "Connection": "accept-encoding, x-hop",
            "Accept-Encoding": "identity",
            "X-Hop": "1",
        },
        trust_env=False,
    )
    assert response.status_code == 200
    (_, headers, _) = recording.seen[-1]
    assert headers["accept-encoding"] == "identity"
    assert "x-hop" not in headers
    assert "connection" not in headers or "x-hop" not in headers["connection"]


# -- a request larger than a worker's slot (R-K7) ----------------------------------------


def test_r_k7_the_relay_judges_by_the_estimate_the_middleware_charges() -> None:
    doc: dict[str, Any] = {"model": "wh", "messages": MESSAGES, "max_tokens": 100}
    assert proxy.request_tokens(doc) == request_charge(doc).prompt + 100
    both = {"model": "wh", "max_tokens": 100, "max_completion_tokens": 7}
    assert proxy.request_tokens(both) == request_charge(both).prompt + 100  # the larger
    for odd in ('"x"', "true", "-5", "1.5", "null"):  # the worker judges these, not us
        raw = json.loads(f'{{"model": "wh", "max_tokens": {odd}}}')
        assert proxy.request_tokens(raw) == request_charge(raw).prompt


def test_r_k7_a_large_request_goes_to_the_worker_whose_slot_holds_it(
    router: Router, openai_sim: OpenAISim
) -> None:
    small, large = openai_sim(n_ctx=256), openai_sim(n_ctx=4096)
    r = router([worker("small", [small.url], ["wh"]), worker("large", [large.url], ["wh"])])
    assert {s.id: s.request_tokens for s in r.workers()} == {"small": 256, "large": 4096}
    client = sdk(r)
    for _ in range(3):  # 1000 tokens to generate: only the large one holds it
        client.chat.completions.create(model="wh", messages=MESSAGES, max_tokens=1000)
    # a worker counts a completion after its last byte, which may reach the client first
    wait_for(lambda: small.completions + large.completions == 3, what="three counted")
    assert (small.completions, large.completions) == (0, 3)
    for _ in range(4):  # a small request may go to either: the most free slots decide
        client.chat.completions.create(model="wh", messages=MESSAGES, max_tokens=3)
    wait_for(lambda: small.completions + large.completions == 7, what="seven counted")
    wait_for(lambda: r.in_flight() == {}, what="the requests' end")


def test_r_k7_a_request_no_worker_holds_is_400_with_the_numbers_and_reaches_none(
    router: Router, openai_sim: OpenAISim
) -> None:
    a, b = openai_sim(n_ctx=256), openai_sim(n_ctx=512)
    r = router([worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh"])])
    prompt = [{"role": "user", "content": "word. " * 300}]  # about 600 tokens
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(r).chat.completions.create(model="wh", messages=prompt, max_tokens=10)
    assert refused.value.code == "context_length_exceeded"
    message = refused.value.message
    assert "hold at most 512 a request" in message and "needs about 6" in message, message
    assert a.completions == b.completions == 0
    assert r.in_flight() == {}


def test_r_k7_a_worker_that_states_no_request_bound_takes_any_request(
    router: Router, openai_sim: OpenAISim, recording: RecordingWorker
) -> None:
    a = openai_sim(n_ctx=256)
    r = router([worker("a", [a.url], ["wh"]), worker("r", [recording.url], ["wh"])])
    assert {s.id: s.request_tokens for s in r.workers()} == {"a": 256, "r": None}
    body = json.dumps({"model": "wh", "messages": MESSAGES, "max_tokens": 5000}).encode()
    answer = httpx.post(
        f"{r.url}/v1/chat/completions", content=body, headers=AUTH, trust_env=False, timeout=30
    )
    assert answer.status_code == 200, answer.text
    assert [seen[2] for seen in recording.seen] == [body]
    assert a.completions == 0
