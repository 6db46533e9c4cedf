"""``GET /metrics`` on the router: the last round and the relay in Prometheus text,
scraped over HTTP and read with prometheus_client's parser (R-K5)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gwtest import stopped_at_exit, wait_for
from prometheus_client.parser import text_string_to_metric_families
from router_support import KEY, Router, ScriptedServer, Sim, status_from_peer, worker

from capacity_router import RouterServer, SimWorker

FIXTURES = Path(__file__).parent / "fixtures"
P = "gateway_capacity_router_"
AUTH = {"Authorization": f"Bearer {KEY}"}

# fixture -> (running, waiting) the server said in it (its /slots, /v1/loads or /metrics)
TOLD = {
    "llama-server-llama-cpp-python-0.3.36": (1.0, None),  # /slots: 1 of 4 processing
    "sglang-0.5.22-dp-attention": (5.0, 1.0),  # /v1/loads, summed over the ranks
    "tgi-router-info-running-bound": (16.0, 3.0),  # tgi_batch_current_size, tgi_queue_size
    "vllm-data-parallel": (5.0, 1.0),  # vllm:num_requests_{running,waiting}, two engines
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(router: RouterServer, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(
        f"{router.url}/metrics", headers=AUTH if headers is None else headers, trust_env=False
    )


def parsed(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((P + name, frozenset(labels.items())))


def replay(server: ScriptedServer, stem: str) -> dict[str, Any]:
    doc = json.loads((FIXTURES / f"{stem}.json").read_text())
    for route, answer in doc["answers"].items():
        body = json.dumps(answer["json"]) if "json" in answer else answer["text"]
        kind = "application/json" if "json" in answer else "text/plain"
        server.route(route, answer["status"], body, **{"Content-Type": kind})
    registry: dict[str, Any] = doc["registry"]
    return registry


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_r_k5_metrics_say_what_each_replayed_server_told(
    scripted: Callable[[], ScriptedServer], router: Router, sim: Sim
) -> None:
    workers = []
    for stem in TOLD:
        reg = replay(server := scripted(), stem)
        workers.append(worker(stem, [server.url], reg["models"], reg["slots"]))
    drained = sim(3)
    workers.append(worker("drained", [drained.url], ["wh"], fenced=True))
    odd = 'say "hi"\\n'  # a model id is any text: the library escapes it
    workers.append(worker("gone", [closed_port_url()], ["wh", odd], {"fixed": 2}))
    mute = scripted()
    mute.route("/health", 200, "{}")  # healthy, but its /props is missing
    workers.append(worker("mute", [mute.url], ["wh"]))
    r = router(workers, poll_interval=30, poll_timeout=5.0)
    snapshot = r.observe()

    response = scrape(r)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = parsed(response.text)

    for stem, (running, waiting) in TOLD.items():
        assert value(samples, "worker_running_requests", worker=stem) == running
        assert value(samples, "worker_waiting_requests", worker=stem) == waiting
        assert value(samples, "worker_relayed_requests", worker=stem) == 0
    statuses = {s.id: s for s in r.workers()}
    for worker_id, status in statuses.items():
        assert value(samples, "worker_slots", worker=worker_id) == status.slots
        states = {
            state: value(samples, "worker_state", worker=worker_id, **{P + "worker_state": state})
            for state in ("ok", "unreadable", "unhealthy", "unreachable", "fenced")
        }
        expected = "fenced" if status.fenced else status.state
        assert states == {state: float(state == expected) for state in states}, worker_id
    assert statuses["gone"].state == "unreachable" and statuses["drained"].fenced
    assert statuses["mute"].state == "unreadable"
    assert odd in {row.id for row in snapshot.models}
    for row in snapshot.models:
        assert value(samples, "model_capacity", model=row.id) == row.max_concurrent_requests
    assert value(samples, "snapshot_complete") == 0  # "mute" was not read
    assert value(samples, "last_round_timestamp_seconds") == snapshot.observed_at


@pytest.fixture
def busy_sim() -> Iterator[SimWorker]:
    with stopped_at_exit(SimWorker.stop) as keep:
        w = SimWorker(slots=2, openai=True, delay=1.5, model="wh", shape="vllm")
        w.start()
        yield keep(w)


def test_r_k5_metrics_count_the_relayed_requests_and_the_workers_own_figures(
    router: Router, busy_sim: SimWorker
) -> None:
    r = router(
        [worker("busy", [busy_sim.url], ["wh"], {"source": "vllm", "fixed": 2})], poll_interval=0.1
    )
    body = {"model": "wh", "messages": [{"role": "user", "content": "hi"}]}

    def ask() -> None:
        httpx.post(f"{r.url}/v1/chat/completions", json=body, headers=AUTH, timeout=30)

    askers = [threading.Thread(target=ask) for _ in range(2)]
    for t in askers:
        t.start()
    try:

        def both_seen() -> Samples | None:
            samples = parsed(scrape(r).text)
            if value(samples, "worker_running_requests", worker="busy") != 2:
                return None
            return samples

        samples = wait_for(both_seen, what="a round that sees both completions")
        assert value(samples, "worker_relayed_requests", worker="busy") == 2
        assert value(samples, "worker_waiting_requests", worker="busy") == 0
    finally:
        for t in askers:
            t.join(30)
    after = parsed(scrape(r).text)
    assert value(after, "worker_relayed_requests", worker="busy") == 0


def test_r_k5_metrics_answer_only_the_key_holder_on_loopback(router: Router, sim: Sim) -> None:
    a = sim(4)
    r = router([worker("a", [a.url], ["wh"])], poll_interval=30)
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        refused = scrape(r, headers)
        assert refused.status_code == 401
        assert "worker" not in refused.text
    request = f"GET /metrics HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer {KEY}\r\n\r\n"
    for peer in ("100.64.1.2", "fd7a:115c:a1e0::1"):
        assert status_from_peer(r, peer, request) == 403
    assert status_from_peer(r, "127.0.0.1", request) == 200
    samples = parsed(scrape(r).text)
    assert value(samples, "worker_slots", worker="a") == 4
    assert value(samples, "worker_running_requests", worker="a") is None  # no /slots on sim
