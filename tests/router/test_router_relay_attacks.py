"""The relay under attack and under load (R-K5): a worker's redirect, idle sockets, a
descriptor shortage, a relay at its limit. Real routers, real workers on loopback, the
official ``openai`` SDK, ``nobody`` as the attacker."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from as_nobody import as_nobody, need_root
from router_support import (
    KEY,
    LoopbackHTTP,
    QuietHandler,
    Router,
    Sim,
    rows,
    serve_args,
    worker,
    write_registry,
)

from capacity_router import SimWorker

AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]
ROOT = Path(__file__).resolve().parents[2]


class RedirectingWorker(LoopbackHTTP):
    """Healthy on GET; answers every POST ``307 Location: /admin/fence/w2``."""

    def __init__(self) -> None:
        class Handler(QuietHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                self.send_response(307)
                self.send_header("Location", "/admin/fence/w2")
                self.send_header("Content-Length", "0")
                self.end_headers()

        super().__init__(Handler)


@pytest.fixture
def redirecting() -> Iterator[RedirectingWorker]:
    with RedirectingWorker() as w:
        yield w


def test_r_k5_a_workers_redirect_is_a_502_the_sdk_cannot_follow_into_the_admin_api(
    router: Router, sim: Sim, redirecting: RedirectingWorker, caplog: pytest.LogCaptureFixture
) -> None:
    w2 = sim(8)
    r = router(
        [
            worker("w1", [redirecting.url], ["wh"], slots={"fixed": 4}),
            worker("w2", [w2.url], ["other"]),
        ],
        poll_interval=30,
    )
    caplog.set_level(logging.WARNING, logger="capacity_router")
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key=KEY, max_retries=0, timeout=10)
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(model="wh", messages=MESSAGES)
    assert refused.value.status_code == 502
    assert "redirect" in refused.value.message
    assert "location" not in refused.value.response.headers
    request_id = refused.value.response.headers["x-router-request-id"]
    assert any(request_id in rec.getMessage() for rec in caplog.records), "no log line names it"
    assert [w.fenced_by for w in r.workers()] == [None, None]
    assert rows(r.observe()) == {"other": 8, "wh": 4}


def test_every_relayed_answer_carries_its_own_request_id(router: Router, sim: Sim) -> None:
    a = SimWorker(slots=2, openai=True, delay=0.01, model="wh")
    a.start()
    try:
        r = router([worker("a", [a.url], ["wh"])])
        body = {"model": "wh", "messages": MESSAGES, "max_tokens": 2}
        seen = []
        with httpx.Client(trust_env=False) as client:
            for headers, payload in (
                (AUTH, body),
                (AUTH, {**body, "stream": True}),
                (AUTH, {**body, "model": "typo"}),
                ({}, body),
            ):
                response = client.post(
                    f"{r.url}/v1/chat/completions", json=payload, headers=headers
                )
                seen.append((response.status_code, response.headers["x-router-request-id"]))
        assert [status for status, _ in seen] == [200, 200, 404, 401]
        assert len({rid for _, rid in seen}) == 4
    finally:
        a.stop()


def test_r_k5_capacity_is_polled_on_time_while_the_relay_is_at_its_limit(
    router: Router, sim: Sim
) -> None:
    a = sim(10)
    r = router([worker("a", [a.url], ["wh"])], poll_interval=0.2)
    before = r.snapshot()
    assert before is not None and rows(before) == {"wh": 10}
    assert r._server is not None

    async def saturate() -> None:  # the relay's loop can do nothing else for 3 s
        time.sleep(3.0)

    busy = r._server.call(saturate())
    seen = []
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        snapshot = r.snapshot()
        assert snapshot is not None
        seen.append(snapshot)
        time.sleep(0.1)
    busy.result(timeout=10)
    rounds = {s.observed_at for s in seen}
    assert len(rounds) >= 5, f"{len(rounds)} rounds in 2.5 s at a 0.2 s interval"
    assert all(s.complete and rows(s) == {"wh": 10} for s in seen)
    assert [w.state for w in r.workers()] == ["ok"]


SHORTAGE = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from capacity_router.poller import CapacityObserver
    from capacity_router.registry import RegistryWatcher
    running = CapacityObserver(RegistryWatcher(sys.argv[1]), timeout=2.0)
    fresh = CapacityObserver(RegistryWatcher(sys.argv[1]), timeout=2.0)
    def seen(snapshot):
        return [snapshot.complete, {m.id: m.max_concurrent_requests for m in snapshot.models}]
    async def main():
        rounds = [seen(await running.observe())]
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        rounds += [seen(await running.observe()), seen(await fresh.observe())]
        for fd in held:
            os.close(fd)
        return rounds + [seen(await running.observe())]
    print(json.dumps(asyncio.run(main())))
    """
)


def test_r_k5_a_round_without_a_descriptor_publishes_no_count_for_the_worker(
    registry_path: Path, sim: Sim
) -> None:
    a = sim(4)
    write_registry(registry_path, [worker("a", [a.url], ["wh"])])
    done = subprocess.run(
        [sys.executable, "-c", SHORTAGE, str(registry_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    before, starved, starved_at_start, after = json.loads(done.stdout)
    assert before == after == [True, {"wh": 4}]
    # Incomplete with no row, never "complete, wh: 0", whether the poll's socket or its
    # client could not be made.
    assert starved == starved_at_start == [False, {}]


def _set_nofile(limit: int | None) -> None:
    if limit is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


@pytest.mark.parametrize("nofile", [None, 1024], ids=["no-limit", "nofile-1024"])
def test_r_k5_idle_sockets_of_nobody_do_not_stop_the_key_holder(
    registry_path: Path, key_file: Path, nofile: int | None
) -> None:
    need_root()
    sim = SimWorker(slots=4, openai=True, delay=0.01, model="wh")
    sim.start()
    write_registry(registry_path, [worker("a", [sim.url], ["wh"])])
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway_capacity", "router", *serve_args(registry_path, key_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        preexec_fn=lambda: _set_nofile(nofile),
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip().removeprefix("serving ").removesuffix("/v1/capacity")
        port = int(url.rsplit(":", 1)[1])

        def attack() -> None:  # as nobody: 1,030 connections that never send a byte
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
            sockets = []
            for _ in range(1030):
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(("127.0.0.1", port))
                sockets.append(s)
            os.write(signal_w, b"x")
            time.sleep(4)

        signal_r, signal_w = os.pipe()
        attacker = threading.Thread(target=as_nobody, args=(attack,))
        attacker.start()
        os.read(signal_r, 1)
        started = time.monotonic()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=10)
        answers = []
        with httpx.Client(trust_env=False, timeout=10) as http:
            for _ in range(4):
                capacity = http.get(f"{url}/v1/capacity", headers=AUTH)
                assert capacity.status_code == 200
                document = capacity.json()
                assert document["complete"] and document["models"] == [
                    # the simulated llama-server's slot n_ctx (R-K7)
                    {"id": "wh", "max_concurrent_requests": 4, "max_request_tokens": 4096}
                ]
                answer = client.chat.completions.create(model="wh", messages=MESSAGES, max_tokens=2)
                answers.append(answer.choices[0].message.content)
        elapsed = time.monotonic() - started
        attacker.join(timeout=30)
        assert answers == ["t0 t1"] * 4
        assert elapsed < 10, f"{elapsed:.1f} s for 4 capacity reads and 4 completions"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
        sim.stop()
    assert len(err) < 20_000, f"{len(err)} bytes of logs"
    assert "Traceback" not in err
