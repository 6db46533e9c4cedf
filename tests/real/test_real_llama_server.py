"""The router and the whole chain against real llama.cpp llama-server processes (R-K5).

``make real-workers`` builds llama-server once (scripts/build-llama-server) and runs
this module with ``GWCAP_LLAMA_SERVER`` set; without it every test skips, saying so.
The model is the tiny random-weight llama of scripts/tiny_gguf.py: its answers are
noise, its slots, health, props, model list and streaming are llama-server's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from llama import LlamaServer, binary, tiny_model
from servers import write_registry as replace_registry

from capacity_router import RouterServer

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        binary() is None,
        reason="no llama-server: `make real-workers` builds one and sets GWCAP_LLAMA_SERVER",
    ),
]

KEY = "router-test-key-0123456789"


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "router.key").write_text(KEY + "\n")
    (tmp_path / "router.key").chmod(0o600)
    return tmp_path


@pytest.fixture
def servers(work: Path) -> Iterator[Callable[..., LlamaServer]]:
    started: list[LlamaServer] = []

    def start(*args: str, key: str | None = None) -> LlamaServer:
        server = LlamaServer(list(args), work / f"llama-{len(started)}.log", key=key)
        started.append(server)
        server.wait_healthy()
        return server

    yield start
    for server in started:
        server.stop()


def entry(
    worker_id: str, server: LlamaServer, models: list[str], source: str = "llama-server"
) -> dict[str, Any]:
    """One worker of the registry: this llama-server, read as ``source``."""
    return {"id": worker_id, "urls": [server.url], "models": models, "slots": {"source": source}}


def write_registry(work: Path, workers: list[dict[str, Any]]) -> Path:
    path = work / "workers.json"
    replace_registry(path, workers)
    return path


@contextmanager
def two_behind_a_router(
    work: Path, servers: Callable[..., LlamaServer], parallel: tuple[int, int]
) -> Iterator[tuple[LlamaServer, LlamaServer, RouterServer]]:
    """Two llama-servers serving the tiny model as "tiny", workers a and b of a router that
    has read them both."""
    model = tiny_model(work)
    a, b = (servers("-m", str(model), "--alias", "tiny", "--parallel", str(n)) for n in parallel)
    registry = write_registry(work, [entry("a", a, ["tiny"]), entry("b", b, ["tiny"])])
    with RouterServer(registry, work / "router.key", poll_interval=0.5) as router:
        wait_rows(router, {"tiny": sum(parallel)})
        yield a, b, router


def capacity(router: RouterServer) -> dict[str, Any]:
    answer = httpx.get(
        f"{router.url}/v1/capacity", headers={"Authorization": f"Bearer {KEY}"}, trust_env=False
    )
    assert answer.status_code == 200
    doc: dict[str, Any] = answer.json()
    return doc


def rows(router: RouterServer) -> dict[str, int]:
    return {m["id"]: m["max_concurrent_requests"] for m in capacity(router)["models"]}


def wait_rows(
    router: RouterServer, expected: dict[str, int], timeout: float = 30.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    snap = capacity(router)
    while time.monotonic() < deadline:
        snap = capacity(router)
        if {m["id"]: m["max_concurrent_requests"] for m in snap["models"]} == expected:
            return snap
        time.sleep(0.2)
    raise AssertionError(f"capacity never became {expected}: last {snap}")


def test_r_k5_slots_follow_parallel_across_a_restart(
    work: Path, servers: Callable[..., LlamaServer]
) -> None:
    model = tiny_model(work)
    first = servers("-m", str(model), "--alias", "tiny", "--parallel", "2")
    registry = write_registry(
        work,
        [entry("a", first, ["tiny"])],
    )
    with RouterServer(registry, work / "router.key", poll_interval=0.5) as router:
        assert wait_rows(router, {"tiny": 2})["complete"] is True
        first.stop()
        # the same port, so the registry is unchanged: only the server's setting moved
        again = LlamaServer(
            ["-m", str(model), "--alias", "tiny", "--parallel", "4"],
            work / "again.log",
            port=first.port,
        )
        try:
            again.wait_healthy()
            assert wait_rows(router, {"tiny": 4})["complete"] is True
        finally:
            again.stop()


def test_r_k5_two_servers_sum_and_a_killed_one_drops_out(
    work: Path, servers: Callable[..., LlamaServer]
) -> None:
    with two_behind_a_router(work, servers, (2, 3)) as (_, b, router):
        b.kill()
        assert wait_rows(router, {"tiny": 2})["complete"] is True


def test_r_k5_a_server_with_an_api_key_is_read_with_its_key_file(
    work: Path, servers: Callable[..., LlamaServer]
) -> None:
    model = tiny_model(work)
    secret = work / "worker.key"
    secret.write_text("worker-secret-key\n")
    secret.chmod(0o600)
    keyed = servers(
        "-m", str(model), "--alias", "tiny", "--parallel", "3", "--api-key-file", str(secret)
    )
    worker = entry("k", keyed, ["tiny"])
    registry = write_registry(work, [worker])
    with RouterServer(registry, work / "router.key", poll_interval=0.5) as router:
        snap = capacity(router)
        assert snap["complete"] is False  # asked without its key: 401, unreadable
        write_registry(work, [{**worker, "keyFile": "worker.key"}])
        assert wait_rows(router, {"tiny": 3})["complete"] is True
        admin = httpx.get(
            f"{router.url}/admin/workers",
            headers={"Authorization": f"Bearer {KEY}"},
            trust_env=False,
        )
        assert admin.status_code == 200
        assert "worker-secret-key" not in admin.text + json.dumps(capacity(router))


def test_r_k5_an_id_a_one_model_server_does_not_list_still_counts(
    work: Path, servers: Callable[..., LlamaServer]
) -> None:
    model = tiny_model(work)
    s = servers("-m", str(model), "--alias", "tiny", "--parallel", "2")
    registry = write_registry(work, [entry("a", s, ["tiny", "typo-model"])])
    with RouterServer(registry, work / "router.key", poll_interval=0.5) as router:
        # llama-server with one model answers whatever "model" a request names
        assert wait_rows(router, {"tiny": 2, "typo-model": 2})["complete"] is True
        assert router.workers()[0].unlisted == ("typo-model",)


def test_r_k5_router_mode_is_read_per_model_without_loading_one(
    work: Path, servers: Callable[..., LlamaServer]
) -> None:
    models = work / "models"
    models.mkdir()
    tiny_model(models, "tiny-a")
    tiny_model(models, "tiny-b")
    s = servers(
        "--models-dir", str(models), "--models-max", "2", "--parallel", "3", "--no-models-autoload"
    )
    registry = write_registry(work, [entry("r", s, ["tiny-a", "tiny-b"], "llama-server-router")])
    with RouterServer(registry, work / "router.key", poll_interval=0.5) as router:
        wait_rows(router, {"tiny-a": 0, "tiny-b": 0})
        time.sleep(1.5)  # several rounds: none of them may load a model
        states = {
            m["id"]: m["status"]["value"] for m in httpx.get(f"{s.url}/models").json()["data"]
        }
        assert states == {"tiny-a": "unloaded", "tiny-b": "unloaded"}
        assert (
            httpx.post(f"{s.url}/models/load", json={"model": "tiny-a"}, timeout=30).status_code
            == 200
        )
        assert wait_rows(router, {"tiny-a": 3, "tiny-b": 0}, timeout=60)["complete"] is True


def test_r_k5_a_stream_through_the_router_with_the_openai_sdk_and_a_fenced_worker_drains(
    work: Path, servers: Callable[..., LlamaServer]
) -> None:
    with two_behind_a_router(work, servers, (2, 2)) as (_, _, router):
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        stream = client.completions.create(
            model="tiny", prompt="hello", max_tokens=400, stream=True
        )
        first = next(iter(stream))
        assert first.choices
        busy = [w for w, n in router.in_flight().items() if n]
        assert len(busy) == 1
        router.fence(busy[0])
        rest = list(stream)  # the fenced worker finishes the stream it runs
        assert len(rest) >= 1
        other = client.completions.create(model="tiny", prompt="again", max_tokens=4)
        assert other.choices[0].text is not None
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        assert sum(1 for _ in chat) >= 1
        assert capacity(router)["models"] == [{"id": "tiny", "max_concurrent_requests": 2}]


def test_the_recorder_writes_fixtures_the_replay_reads(work: Path) -> None:
    out = work / "fixtures"
    done = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parents[2] / "scripts" / "record-llama-server.py"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in out.glob("*.json"))
    assert names == [
        "llama-server-api-key-recorded.json",
        "llama-server-recorded.json",
        "llama-server-router-loaded-recorded.json",
        "llama-server-router-unloaded-recorded.json",
    ]
