"""wait-for-slot against vLLM's own /metrics URL and against a capacity router (R-W1, R-K5)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from capacity_router import RouterServer, SimWorker

pytestmark = pytest.mark.timeout(60)

ROUTER_KEY = "wfs-router-key-77a1"


def test_r_w1_a_vllm_metrics_url_is_sampled_directly(server, cli, gauges):
    server.serve(gauges(running=[2], waiting=[1]))
    ran = cli("--url", server.url + "/metrics", "--check")
    assert ran.code == 0, ran.stderr
    assert [r.path for r in server.requests] == ["/metrics"]
    assert "running 2 + waiting 1 + need 1 = 4 <= limit 6: room" in ran.stderr


def test_r_w1_a_metrics_url_with_a_model_counts_only_that_models_series(
    server, cli, answer, vllm_text
):
    server.serve(answer(200, vllm_text(running=[5], waiting=[0], model="other")))
    ran = cli("--url", server.url + "/metrics", "--model", "workhorse", "--check")
    assert ran.code == 2
    assert "no vllm:num_requests_running" in ran.stderr and "'workhorse'" in ran.stderr


@pytest.fixture
def farm(tmp_path: Path) -> Iterator[tuple[RouterServer, Path]]:
    workers = [SimWorker(slots=3, model="workhorse"), SimWorker(slots=2, model="workhorse")]
    for w in workers:
        w.start()
    registry = tmp_path / "workers.json"
    entries = [
        {"id": f"w{i}", "urls": [w.url], "models": ["workhorse"], "slots": {"source": "props"}}
        for i, w in enumerate(workers)
    ]
    registry.write_text(json.dumps({"workers": entries}))
    key = tmp_path / "router.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, ROUTER_KEY.encode() + b"\n")
    os.close(fd)
    router = RouterServer(registry, key, poll_interval=30)
    router.start()
    try:
        yield router, key
    finally:
        router.stop()
        for w in workers:
            w.stop()


def test_r_k5_against_a_router_the_room_is_the_farms_capacity(farm, cli):
    router, key = farm
    target = ("--url", router.url + "/v1", "--model", "workhorse", "--key-file", str(key))
    ran = cli(*target, "--check", "--need", "5", "--json")
    assert ran.code == 0, ran.stderr
    doc = json.loads(ran.stdout)
    assert doc["limit"] == 5 and doc["running"] == 0  # 3 + 2 slots, nothing relayed now
    assert cli(*target, "--check", "--need", "6", "--limit", "9").code == 1
    assert cli(*target, "--check", "--need", "2", "--limit", "1").code == 2  # usage
    unknown = cli("--url", router.url, "--model", "typo", "--key-file", str(key), "--check")
    assert unknown.code == 2 and "serves no model 'typo'; known: workhorse" in unknown.stderr
    nokey = cli("--url", router.url, "--model", "workhorse", "--check")
    assert nokey.code == 2 and "give the router's key" in nokey.stderr


def test_r_k5_the_routers_load_counts_what_it_relays_to_each_models_workers() -> None:
    from capacity_contract import CapacitySnapshot, ModelCapacity
    from capacity_router.app import farm_load
    from capacity_router.poller import WorkerStatus

    snap = CapacitySnapshot(
        object="inference_capacity",
        version=1,
        complete=True,
        observed_at=1.0,
        models=[
            ModelCapacity(id="a", max_concurrent_requests=5),
            ModelCapacity(id="b", max_concurrent_requests=4),
        ],
    )
    statuses = [
        WorkerStatus("w1", ("a",), None, "ok", 3, "props"),
        WorkerStatus("w2", ("a", "b"), None, "ok", 2, "props"),
    ]
    doc = farm_load(snap, statuses, {"w1": 2, "w2": 1}, relays=True)
    assert doc["models"] == [
        {"id": "a", "max_concurrent_requests": 5, "running": 3},
        {"id": "b", "max_concurrent_requests": 4, "running": 1},
    ]
