"""LiteLLM's proxy and gateway-capacity, both ways in, against the real ``litellm`` package
(SPEC section 8; R-A1, R-A2, R-A4).

1. ``examples/litellm_proxy.py``: LiteLLM's ASGI app wrapped in ``AdmissionMiddleware``
   with ``provider=by_model``, under real uvicorn with two workers.
2. ``examples/litellm_admission.py``: a LiteLLM ``CustomLogger`` that acquires in
   ``async_pre_call_hook`` and releases on success/failure, beside the example gateway.

The provider's limit is 2; the fake upstream holds every answer until released.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from gwtest import ROOT, run_cli, wait_until
from litellm_support import (
    ALIAS,
    UPSTREAM_MODEL,
    HoldingUpstream,
    StartServed,
    counts,
    litellm_yaml,
    skip_without_litellm,
    wait_counts,
)
from served import Served

skip_without_litellm()

EXAMPLES = ROOT / "examples"


def completion(base: str, key: str, stream: bool = False) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": ALIAS, "stream": stream, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


@pytest.fixture
def wrapped_proxy(
    serve: StartServed, upstream: HoldingUpstream, tmp_path: Path, master_key: str
) -> Served:
    """examples/litellm_proxy.py: LiteLLM's proxy behind the middleware
    (``provider=by_model``), under uvicorn with two workers."""
    config = litellm_yaml(tmp_path, upstream, callback=False)
    return serve(
        "litellm_proxy:app",
        EXAMPLES,
        workers=2,
        env={"CONFIG_FILE_PATH": str(config), "LITELLM_MASTER_KEY": master_key},
    )


def worker_pids(server: Served) -> list[int]:
    """The pids of uvicorn's worker processes, as each logged them at its start."""
    return [int(pid) for pid in re.findall(r"Started server process \[(\d+)\]", server.output())]


def holder_pids(segment: str) -> set[int]:
    doc = json.loads(run_cli("inspect", "--segment", segment, "--json").stdout)
    return {h["pid"] for h in doc["holders"]}


@pytest.mark.timeout(300)  # LiteLLM's import alone is seconds of CPU per worker
def test_r_a1_r_a2_litellm_proxy_wrapped_two_uvicorn_workers_one_budget_and_429_beyond_the_queue(
    wrapped_proxy: Served, upstream: HoldingUpstream, master_key: str, segment_name: str
) -> None:
    proxy = wrapped_proxy
    pids = worker_pids(proxy)
    assert len(pids) == 2, proxy.output()[-3000:]
    first, second = pids
    with ThreadPoolExecutor(40) as pool:
        answers: list[Future[httpx.Response]] = []

        def send(n: int) -> None:
            answers.extend(pool.submit(completion, proxy.base, master_key) for _ in range(n))

        # Which worker accepts is the kernel's and asyncio's choice: one that wakes first
        # may take every pending connection (two fresh-clone runs saw all 34 on one). So
        # each half goes to one worker while the other is stopped (real SIGSTOP).
        os.kill(second, signal.SIGSTOP)  # idle: no record, so it never takes the lock
        try:
            send(17)  # the first worker: 2 run, 15 wait
            wait_counts(segment_name, (2, 15), timeout=60)
        finally:
            os.kill(second, signal.SIGCONT)
        os.kill(first, signal.SIGSTOP)  # it sweeps: it may stop inside the lock for 0.1 ms
        try:
            send(17)  # the second worker: its loop accepts at once even if the lock is
            # held (R-A11); its arrivals then wait for the first to continue
            wait_until(lambda: counts(segment_name) == (2, 32), timeout=5)
        finally:
            os.kill(first, signal.SIGCONT)
        wait_counts(segment_name, (2, 32), timeout=60)  # one budget across both workers
        assert upstream.seen == 2
        assert holder_pids(segment_name) == {first, second}
        refused = completion(proxy.base, master_key)
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
        assert counts(segment_name) == (2, 32)  # the refused one was never queued
        upstream.release.set()
        statuses = [a.result().status_code for a in answers]
    assert statuses == [200] * 34, statuses
    assert upstream.seen == 34 and set(upstream.models) == {UPSTREAM_MODEL}
    wait_counts(segment_name, (0, 0))
    doc = json.loads(run_cli("inspect", "--segment", segment_name, "--json").stdout)
    counters = doc["providers"][0]["counters"]
    assert counters["peak_running"] == 2 and counters["admitted_total"] == 34
    assert counters["rejected_total"] == 1


@pytest.mark.timeout(300)  # LiteLLM's import alone is seconds of CPU per worker
def test_r_a4_litellm_proxy_wrapped_a_client_leaving_mid_stream_or_while_waiting_frees_its_slot(
    wrapped_proxy: Served, upstream: HoldingUpstream, master_key: str, segment_name: str
) -> None:
    proxy = wrapped_proxy
    port = int(proxy.base.rsplit(":", 1)[1])
    body = json.dumps({"model": ALIAS, "stream": True, "messages": [{"role": "user"}]})
    raw = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {master_key}"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    streams = []
    for _ in range(2):
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        sock.sendall(raw)
        data = b""
        while b"t0" not in data:  # the first chunk of the stream has arrived
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        streams.append(sock)
    waiter = socket.create_connection(("127.0.0.1", port), timeout=60)
    waiter.sendall(raw)
    wait_counts(segment_name, (2, 1))
    waiter.close()  # gone while waiting: it leaves the queue
    wait_counts(segment_name, (2, 0), timeout=10)
    for sock in streams:  # gone mid-stream: the slot goes
        sock.close()
    wait_counts(segment_name, (0, 0), timeout=20)
    upstream.release.set()
    assert completion(proxy.base, master_key).status_code == 200  # the budget is whole
    wait_counts(segment_name, (0, 0))


@pytest.mark.timeout(300)  # LiteLLM's import alone is seconds of CPU per worker
def test_r_a1_litellm_callback_and_the_example_gateway_share_one_budget(
    serve: StartServed,
    upstream: HoldingUpstream,
    tmp_path: Path,
    master_key: str,
    segment_name: str,
) -> None:
    litellm_dir = tmp_path / "litellm"
    litellm_dir.mkdir()
    shutil.copy(EXAMPLES / "litellm_admission.py", litellm_dir)  # LiteLLM loads it from here
    config = litellm_yaml(litellm_dir, upstream, callback=True)
    litellm = serve(
        "litellm.proxy.proxy_server:app",
        litellm_dir,
        env={
            "CONFIG_FILE_PATH": str(config),
            "LITELLM_MASTER_KEY": master_key,
            "GATEWAY_GENERATION": "litellm-hook",
        },
    )
    gateway = serve("openai_gateway:app", EXAMPLES, env={"GATEWAY_GENERATION": "example-gw"})
    with ThreadPoolExecutor(40) as pool:
        answers: list[Future[httpx.Response]] = [
            pool.submit(completion, litellm.base, master_key),
            pool.submit(completion, gateway.base, "unused"),
        ]
        wait_counts(segment_name, (2, 0))
        answers += [
            pool.submit(completion, litellm.base, master_key),
            pool.submit(completion, gateway.base, "unused"),
        ]
        wait_counts(segment_name, (2, 2))
        assert len(holder_pids(segment_name)) == 2  # records of both processes
        assert upstream.seen == 2  # one budget: 2 in flight though two gateways hold work
        answers += [pool.submit(completion, gateway.base, "unused") for _ in range(30)]
        wait_counts(segment_name, (2, 32))
        refused = completion(litellm.base, master_key)  # the hook's refusal, through LiteLLM
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        upstream.release.set()
        statuses = [a.result().status_code for a in answers]
    assert statuses == [200] * len(answers)
    wait_counts(segment_name, (0, 0))
    # the hook gave every slot back: the budget is whole for the next arrivals
    upstream.release.set()
    assert completion(litellm.base, master_key).status_code == 200
    wait_counts(segment_name, (0, 0))
    doc = json.loads(run_cli("inspect", "--segment", segment_name, "--json").stdout)
    assert doc["providers"][0]["counters"]["peak_running"] == 2
    generations = {m["generation"] for m in doc["generations"] if m["alive"]}
    assert generations == {"litellm-hook", "example-gw"}
