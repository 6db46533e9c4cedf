"""The router end to end against simulated llama.cpp workers on loopback (R-K5, R-K1..R-K3)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from gwtest import wait_for
from router_support import KEY, Router, Sim, get_capacity, rows, worker, write_registry

from capacity_contract import CapacitySnapshot, decode_snapshot
from capacity_router import FencedInRegistry, RouterServer, UnknownWorker


def served(router: RouterServer) -> CapacitySnapshot:
    response = get_capacity(router)
    assert response.status_code == 200
    return decode_snapshot(response.content)


def test_r_k5_two_ten_slot_workers_advertise_twenty_over_http(router: Router, sim: Sim) -> None:
    a, b = sim(10), sim(10)
    r = router([worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh"])])
    snap = served(r)
    assert rows(snap) == {"wh": 20}
    assert snap.complete is True


def test_r_k5_one_worker_reached_through_several_urls_counts_once(router: Router, sim: Sim) -> None:
    a = sim(10)
    urls = [a.url, a.url.replace("127.0.0.1", "localhost"), a.url + "/"]
    r = router([worker("a", urls, ["wh"])])
    assert rows(served(r)) == {"wh": 10}


def test_r_k5_aliases_on_one_worker_count_its_slots_once_per_model_id(
    router: Router, sim: Sim
) -> None:
    a, b = sim(10), sim(6)
    r = router([worker("a", [a.url], ["wh", "wh-long", "wh"]), worker("b", [b.url], ["wh"])])
    assert rows(served(r)) == {"wh": 16, "wh-long": 10}


def test_r_k5_unhealthy_and_stopped_workers_are_not_counted_and_return_when_back(
    router: Router, sim: Sim
) -> None:
    a, b, c = sim(10), sim(10), sim(10)
    r = router(
        [worker(x, [s.url], ["wh"]) for x, s in (("a", a), ("b", b), ("c", c))], poll_interval=30
    )  # only the rounds this test runs
    assert rows(served(r)) == {"wh": 30}
    b.set_healthy(False)
    c.stop()
    snap = r.observe()
    assert rows(snap) == {"wh": 10}
    assert snap.complete is True
    assert served(r) == snap
    b.set_healthy(True)
    c.start()  # same port
    assert rows(r.observe()) == {"wh": 30}


def test_r_k5_unregistered_worker_is_not_counted_and_a_removed_one_leaves(
    router: Router, sim: Sim, registry_path: Path
) -> None:
    a, b = sim(10), sim(10)
    sim(10)  # running, answering, never registered
    r = router([worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh"])])
    assert rows(served(r)) == {"wh": 20}
    write_registry(registry_path, [worker("a", [a.url], ["wh"])])
    assert rows(r.observe()) == {"wh": 10}


@pytest.mark.parametrize("fault", ["garbage", "error", "hang"])
def test_r_k5_answering_worker_whose_slots_cannot_be_read_makes_it_incomplete(
    router: Router, sim: Sim, fault: Any
) -> None:
    a, b = sim(10), sim(10)
    r = router(
        [worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh", "b-only"])],
        poll_interval=30,
        poll_timeout=0.5,
    )
    b.set_props_fault(fault)  # /health still 200
    snap = r.observe()
    assert snap.complete is False
    assert rows(snap) == {"wh": 10}  # b-only is unknown, not 0
    assert served(r) == snap
    b.set_props_fault(None)
    snap = r.observe()
    assert snap.complete is True
    assert rows(snap) == {"wh": 20, "b-only": 10}


def test_r_k5_fixed_worker_counts_its_fixed_slots_while_it_answers(
    router: Router, sim: Sim
) -> None:
    a, b = sim(10), sim(99)
    r = router([worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh"], {"fixed": 4})])
    assert rows(served(r)) == {"wh": 14}
    b.stop()
    assert rows(r.observe()) == {"wh": 10}


def test_r_k5_fencing_removes_slots_from_the_next_observation_and_unfence_restores(
    router: Router, sim: Sim
) -> None:
    a, b = sim(10), sim(10)
    r = router([worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh"])], poll_interval=30)
    before = served(r).observed_at
    snap = r.fence("a")
    assert rows(snap) == {"wh": 10}
    assert snap.observed_at > before  # a new observation, run at once
    assert served(r) == snap
    assert [w.fenced_by for w in r.workers()] == ["admin", None]
    polled = a.props_requests
    r.observe()
    assert a.props_requests == polled  # a drained worker is left alone
    assert rows(r.unfence("a")) == {"wh": 20}
    assert rows(served(r)) == {"wh": 20}


def test_r_k5_fence_of_unknown_worker_and_unfence_of_file_fenced_worker_are_refused(
    router: Router, sim: Sim
) -> None:
    a, b = sim(10), sim(10)
    r = router([worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh"], fenced=True)])
    assert rows(served(r)) == {"wh": 10}
    with pytest.raises(UnknownWorker):
        r.fence("nobody")
    with pytest.raises(FencedInRegistry):
        r.unfence("b")
    assert rows(served(r)) == {"wh": 10}


def test_r_k5_changing_a_worker_slot_setting_shows_in_its_next_observation(
    router: Router, sim: Sim
) -> None:
    a, b = sim(10), sim(10)
    r = router([worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh"])], poll_interval=0.2)
    assert rows(served(r)) == {"wh": 20}
    changed_at = time.time()
    a.set_slots(4)
    # no trigger: the periodic observation alone picks it up
    snap = wait_for(lambda: (s := served(r)).observed_at > changed_at + 0.05 and s)
    assert rows(snap) == {"wh": 14}


def test_r_k5_registry_edited_live_is_reread_and_a_broken_edit_keeps_the_last_good(
    router: Router, sim: Sim, registry_path: Path
) -> None:
    a, b = sim(10), sim(7)
    r = router([worker("a", [a.url], ["wh"])], poll_interval=0.2)
    assert rows(served(r)) == {"wh": 10}
    write_registry(registry_path, [worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh"])])
    wait_for(lambda: rows(served(r)) == {"wh": 17})
    registry_path.write_text('{"workers": [{"id": "a"')  # broken, in place
    broken_at = time.time()
    snap = wait_for(lambda: (s := served(r)).observed_at > broken_at + 0.05 and s)
    assert rows(snap) == {"wh": 17}
    write_registry(registry_path, [worker("b", [b.url], ["wh"], fenced=True)])
    wait_for(lambda: rows(served(r)) == {"wh": 0})


def test_r_k1_observed_at_is_when_the_observation_was_made(router: Router, sim: Sim) -> None:
    a = sim(10)
    r = router([worker("a", [a.url], ["wh"])], poll_interval=30)
    before = time.time()
    snap = r.observe()
    after = time.time()
    assert before <= snap.observed_at <= after
    time.sleep(0.3)
    assert served(r).observed_at == snap.observed_at  # served as observed, not re-stamped


def test_r_k5_response_is_the_contract_and_nothing_else(
    router: Router, sim: Sim, key_file: Path, registry_path: Path
) -> None:
    a, b = sim(10), sim(10)
    r = router(
        [worker("worker-secret-id", [a.url], ["wh"]), worker("b", [b.url], ["wh"], {"fixed": 3})]
    )
    response = get_capacity(r)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["cache-control"] == "no-store"
    assert "server" not in response.headers
    decode_snapshot(response.content)
    raw = json.loads(response.content)
    assert set(raw) == {"object", "version", "complete", "observed_at", "models"}
    assert all(set(row) == {"id", "max_concurrent_requests"} for row in raw["models"])
    text = response.text
    for secret in (
        KEY,
        "worker-secret-id",
        a.url,
        b.url,
        str(a.port),
        "127.0.0.1",
        str(key_file),
        str(registry_path),
        "props",
        "fixed",
    ):
        assert secret not in text


def test_r_k2_r_k3_largest_registry_still_gives_a_valid_body_under_64_kib(
    router: Router, sim: Sim
) -> None:
    a, b = sim(4096), sim(0)
    models = [f"{i:03d}-" + "m" * 252 for i in range(128)]
    r = router([worker("a", [a.url], models), worker("b", [b.url], models, {"fixed": 4096})])
    response = get_capacity(r)
    assert len(response.content) <= 64 * 1024
    snap = decode_snapshot(response.content)
    assert len(snap.models) == 128
    assert set(rows(snap).values()) == {4096}


def test_snapshot_python_api_matches_the_wire(router: Router, sim: Sim) -> None:
    a = sim(10)
    r = router([worker("a", [a.url], ["wh"])], poll_interval=30)
    assert msgspec.json.decode(get_capacity(r).content, type=CapacitySnapshot) == r.snapshot()
