"""Shared admission across processes and generations (R-A1..R-A5, R-A8, R-A9, R-G1).

Real processes (tests/agent.py), real segment, SIGKILL; observations are made
through the operator's CLI JSON or a lock-free read of the segment. The
multi-process tests run in both semaphore modes (R-A10).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gwtest import (
    Agent,
    P1Segment,
    availability,
    provider_doc,
    run_cli,
    wait_for,
    wait_until,
)

from shm_layout.layout import MAJOR, MINOR
from shm_layout.view import read_view

MakeP1Segment = Callable[..., P1Segment]


def _segment(p1_segment: MakeP1Segment, limit: int) -> P1Segment:
    return p1_segment(limit, maxConcurrent=99)


def _only_slot_held(p1_segment: MakeP1Segment) -> tuple[P1Segment, Agent]:
    """A segment where p1's limit is 1, and a handler process holding that one slot."""
    seg = _segment(p1_segment, 1)
    holder = seg.handler("hold")
    holder.expect("admitted")
    return seg, holder


def test_r_a1_two_generations_never_exceed_the_limit(
    lock_kind: str, p1_segment: MakeP1Segment
) -> None:
    seg = _segment(p1_segment, 3)
    segment_name = seg.name
    peak = 0
    samples = 0
    stop = threading.Event()

    def observe() -> None:
        nonlocal peak, samples
        while not stop.is_set():
            try:
                view = read_view(segment_name)
            except Exception:  # not created yet
                time.sleep(0.01)
                continue
            p1 = view.provider("p1")
            if p1 is not None:
                peak = max(peak, p1.running, p1.stored_running)
                samples += 1
            time.sleep(0.002)

    observer = threading.Thread(target=observe)
    observer.start()
    try:
        workers = [
            seg.handler(
                "--gen", f"handler-{g}.0", "cycle", "40", "--hold-ms", "5", "--timeout", "60"
            )
            for g in (1, 2)
            for _ in range(3)
        ]
        for w in workers:
            w.expect("done", timeout=120)
            assert w.finish() == 0
    finally:
        stop.set()
        observer.join()
    assert samples > 50
    assert peak == 3  # reached, never exceeded
    p1 = provider_doc(segment_name)
    assert p1["running"] == 0 and p1["waiting"] == 0


def test_r_a2_thirty_two_wait_and_the_thirty_third_is_rejected_at_once(
    lock_kind: str, p1_segment: MakeP1Segment
) -> None:
    seg, holder = _only_slot_held(p1_segment)
    segment_name = seg.name
    waiters = [seg.handler("--gen", f"g{i % 2}", "hold", "--threads", "8") for i in range(4)]
    assert wait_until(lambda: provider_doc(segment_name)["waiting"] == 32, timeout=20)
    extra = seg.handler("hold", "--timeout", "5")
    # an arrival that was queued instead would end with "timeout" after its 5 s
    outcome = extra.expect(("queue_full", "timeout", "admitted"), timeout=30)
    assert outcome["event"] == "queue_full", extra.seen
    p1 = provider_doc(segment_name)
    assert p1["waiting"] == 32 and p1["queue_bound"] == 32
    holder.send("release")
    for w in waiters:
        w.send("release")
    for w in waiters:
        for _ in range(8):
            w.expect("released", timeout=30)
    assert wait_until(lambda: provider_doc(segment_name)["waiting"] == 0)


def test_r_a3_waiters_are_admitted_in_arrival_order_across_processes(
    lock_kind: str, p1_segment: MakeP1Segment
) -> None:
    seg, holder = _only_slot_held(p1_segment)
    arrivals = []
    for i in range(6):
        a = seg.handler("--gen", f"gen-{i % 3}", "hold", "--timeout", "60")
        a.expect("started")
        assert wait_until(lambda n=i + 1: provider_doc(seg.name)["waiting"] == n, timeout=15)
        arrivals.append(a)
    holder.send("release")
    order = []
    waiting = list(arrivals)
    while waiting:  # each release hands the one slot to exactly one waiter: which?
        wait_for(lambda: any(a.has_seen("admitted") for a in waiting), 30, what="an admission")
        admitted = [a for a in waiting if a.has_seen("admitted")]
        assert len(admitted) == 1, [arrivals.index(a) for a in admitted]
        order.append(arrivals.index(admitted[0]))
        waiting.remove(admitted[0])
        admitted[0].send("release")  # hands the slot to the next one
    assert order == list(range(len(arrivals)))


def test_r_a5_sigkill_of_a_running_holder_lets_a_waiter_in_within_2s(
    lock_kind: str, p1_segment: MakeP1Segment
) -> None:
    seg, holder = _only_slot_held(p1_segment)
    waiter = seg.handler("hold", "--timeout", "30")
    waiter.expect("started")
    assert wait_until(lambda: provider_doc(seg.name)["waiting"] == 1)
    holder.kill()
    killed = time.time()
    ev = waiter.expect("admitted", timeout=10)
    assert ev["t"] - killed < 2.0, f"reclaimed after {ev['t'] - killed:.2f}s"  # R-A5 deadline
    doc = run_cli("inspect", "--segment", seg.name, "--json")
    assert f'"pid": {holder.pid}' not in doc.stdout  # its record is gone


def test_r_a5_a_killed_waiter_leaves_the_queue_within_2s_and_is_never_counted(
    lock_kind: str, p1_segment: MakeP1Segment
) -> None:
    seg, holder = _only_slot_held(p1_segment)
    segment_name = seg.name
    doomed = seg.handler("hold", "--threads", "3")
    doomed.expect("started")
    assert wait_until(lambda: provider_doc(segment_name)["waiting"] == 3)
    doomed.kill()
    # availability never counts a dead process's records, even before reclaim
    assert provider_doc(segment_name)["waiting"] == 0
    # and the holder's process (a live one holding a slot) reclaims them (R-A5)
    view = None

    def reclaimed() -> bool:
        nonlocal view
        view = read_view(segment_name)
        p1 = view.provider("p1")
        return p1 is not None and p1.stored_waiting == 0

    killed = time.monotonic()
    assert wait_until(reclaimed, timeout=5)
    assert time.monotonic() - killed < 2.0
    holder.send("release")
    holder.expect("released")


def _inspect(segment: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(run_cli("inspect", "--segment", segment, "--json").stdout)
    return doc


def test_r_a5_reuse_of_a_dead_process_registration_never_makes_it_look_alive(
    lock_kind: str, p1_segment: MakeP1Segment
) -> None:
    """Liveness is the member's kernel-held lock, checked against the row's serial, never
    a pid: when a dead process's member row is taken by a new process, the dead one's
    records do not come back to life with it."""
    seg = _segment(p1_segment, 1)
    dead = seg.handler("hold")
    dead.expect("admitted")
    (member,) = [g["index"] for g in _inspect(seg.name)["generations"]]
    dead.kill()
    heir = seg.handler("hold")
    heir.expect("admitted", timeout=10)  # the dead one's slot was freed, not inherited
    assert [g["index"] for g in _inspect(seg.name)["generations"]] == [member]  # reused
    p1 = provider_doc(seg.name)
    assert p1["running"] == 1
    heir.send("release")
    heir.expect("released")


def test_r_a8_r_a9_r_g1_first_handler_creates_the_segment_with_static_limits(
    segment_name: str, write_config: Callable[..., Path], agents: Callable[..., Agent]
) -> None:
    cfg = write_config(
        {
            "maxConcurrent": 5,
            "unknownTopLevel": {"kept": True},
            "providers": [
                {"id": "p1", "maxConcurrent": 2},
                {"id": "gw", "someFutureField": 1},
                {"id": "disc", "capacityDiscovery": True, "baseUrl": "http://127.0.0.1:9/v1"},
            ],
        }
    )
    a = agents("--segment", segment_name, "--config", str(cfg), "--gen", "handler-2.0", "hold")
    a.expect("admitted")
    doc = availability(segment_name)
    limits = {p["id"]: (p["effective_limit"], p["source"]) for p in doc["providers"]}
    assert limits == {"p1": (2, "provider"), "gw": (5, "gateway"), "disc": (5, "gateway")}
    assert doc["sidecar"] is None
    gens = [(g["generation"], g["pid"], g["layout"]) for g in doc["generations"]]
    assert gens == [("handler-2.0", a.pid, f"{MAJOR}.{MINOR}")]
    a.send("release")
    a.expect("released")
    assert a.finish() == 0
    assert availability(segment_name)["generations"] == []  # deregistered on close


def test_r_a1_stress_many_short_slots_from_8_processes_leave_nothing_behind(
    p1_segment: MakeP1Segment,
) -> None:
    seg = _segment(p1_segment, 3)
    workers = [seg.handler("cycle", "150", "--timeout", "60") for _ in range(8)]
    for w in workers:
        w.expect("done", timeout=180)
        assert w.finish() == 0
    doc = run_cli("inspect", "--segment", seg.name, "--json")
    inspected = json.loads(doc.stdout)
    p1 = inspected["providers"][0]
    assert (p1["running"], p1["waiting"], p1["stored_running"], p1["stored_waiting"]) == (
        0,
        0,
        0,
        0,
    )
    assert inspected["holders"] == []
    assert p1["counters"]["admitted_total"] == 8 * 150
    assert p1["counters"]["peak_running"] <= 3
