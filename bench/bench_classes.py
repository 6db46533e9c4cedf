"""Admission classes, measured (docs/classes.md): the slot's cost with no classes and with
two, and how long an interactive request waits while a batch flood keeps the limit full,
with classes (an interactive reserve of 1), as one FIFO, and through a per-request Redis
semaphore (what one would build with a shared counter: no queue, no priority).

The flood: ``BATCH_PROCESSES`` processes, each looping on a batch slot with a body of
``BATCH_BODY_S``, on a limit of ``LIMIT``; the interactive side asks for one slot every
``PROBE_EVERY_S`` from this process and records the time from asking to admission.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench_common import Cleanup

LIMIT = 4
BATCH_PROCESSES = 8
BATCH_BODY_S = 0.02
PROBE_EVERY_S = 0.05
REDIS_POLL_S = 0.001  # a per-request gate polls: Redis has no queue to wait in


@dataclass(frozen=True)
class ClassResults:
    cost_ns: dict[str, list[float]]  # "fifo", "classes", "redis": per acquire+release, by round
    waits_ms: dict[str, list[float]]  # "classes", "fifo", "redis": interactive waits


def _config(cleanup: Cleanup) -> str:
    path = os.path.join(cleanup.tempdir(), "gateway.json")
    classes = [{"name": "interactive", "reserve": 1}, {"name": "batch"}]
    doc = {
        "providers": [
            {"id": "fifo", "maxConcurrent": LIMIT},
            {"id": "classes", "maxConcurrent": LIMIT, "classes": classes},
        ]
    }
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def _cost(adm: Any, provider: str, cls: str | None, ops: int) -> float:
    slot = adm.slot_blocking
    start = time.perf_counter_ns()
    for _ in range(ops):
        with slot(provider, cls=cls):
            pass
    return (time.perf_counter_ns() - start) / ops


def _redis_cost(sem: Any, ops: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(ops):
        sem.try_acquire()
        sem.release()
    return (time.perf_counter_ns() - start) / ops


def _batch_worker(config: str, segment: str, provider: str, stop: Any, redis_port: int) -> None:
    if redis_port:
        import redis
        from bench_redis import ACQUIRE_LUA

        client = redis.Redis(host="127.0.0.1", port=redis_port)
        acquire = client.register_script(ACQUIRE_LUA)
        while not stop.is_set():
            if acquire(keys=["gate"], args=[LIMIT]):
                time.sleep(BATCH_BODY_S)
                client.decr("gate")
            else:
                time.sleep(REDIS_POLL_S)
        return
    from handler_shim import Admission, AdmissionError

    adm = Admission.attach(config=config, segment=segment, generation="batch")
    while not stop.is_set():
        try:
            with adm.slot_blocking(provider, timeout=5.0, cls="batch"):
                time.sleep(BATCH_BODY_S)
        except AdmissionError:  # a full queue: a flood's own refusals
            time.sleep(BATCH_BODY_S)
    adm.close()


def _flood(
    config: str, segment: str, provider: str, seconds: float, probe: Callable[[], float],
    filled: Callable[[], None], redis_port: int = 0,
) -> list[float]:  # fmt: skip
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = [
        ctx.Process(target=_batch_worker, args=(config, segment, provider, stop, redis_port))
        for _ in range(BATCH_PROCESSES)
    ]
    for p in procs:
        p.start()
    try:
        filled()  # the flood fills the limit (and, but for Redis, queues)
        waits = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            waits.append(probe())
            time.sleep(PROBE_EVERY_S)
        return waits
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def run_classes(
    cleanup: Cleanup, rounds: int, seconds: float, log: Callable[[str], None]
) -> ClassResults:
    from handler_shim import Admission

    config = _config(cleanup)
    segment = cleanup.segment("/gwb-c" + secrets.token_hex(5))
    adm = Admission.attach(config=config, segment=segment, generation="bench")
    cleanup.push("admission", adm.close)
    cost: dict[str, list[float]] = {"fifo": [], "classes": [], "redis": []}
    sem = None
    redis_port = 0
    try:
        from bench_redis import RedisSemaphore, start_redis

        client = start_redis(cleanup)
        sem = RedisSemaphore(client, "cost", LIMIT)
        redis_port = int(client.connection_pool.connection_kwargs["port"])
    except Exception as exc:
        log(f"classes: no Redis comparison ({exc})")
    ops = 20000
    for r in range(rounds):
        log(f"classes: cost round {r + 1}/{rounds}")
        cost["fifo"].append(_cost(adm, "fifo", None, ops))
        cost["classes"].append(_cost(adm, "classes", "interactive", ops))
        if sem is not None:
            cost["redis"].append(_redis_cost(sem, ops // 10))

    def probe_shim(provider: str) -> Callable[[], float]:
        def probe() -> float:
            asked = time.perf_counter()
            with adm.slot_blocking(provider, timeout=30.0, cls="interactive"):
                return (time.perf_counter() - asked) * 1000

        return probe

    def shim_filled(provider: str) -> Callable[[], None]:
        def wait() -> None:
            from shm_layout.view import read_view

            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                p = read_view(segment).provider(provider)
                if (
                    p is not None
                    and p.running >= LIMIT - 1
                    and p.waiting >= BATCH_PROCESSES - LIMIT
                ):
                    return
                time.sleep(0.05)
            log(f"classes: the flood on {provider} did not fill the limit within 60 s")

        return wait

    waits: dict[str, list[float]] = {}
    log("classes: interactive under a batch flood, with classes")
    waits["classes"] = _flood(
        config, segment, "classes", seconds, probe_shim("classes"), shim_filled("classes")
    )
    log("classes: interactive under a batch flood, one FIFO")
    waits["fifo"] = _flood(
        config, segment, "fifo", seconds, probe_shim("fifo"), shim_filled("fifo")
    )
    if sem is not None:
        from bench_redis import ACQUIRE_LUA

        client.delete("gate")
        gate = client.register_script(ACQUIRE_LUA)

        def probe_redis() -> float:
            asked = time.perf_counter()
            while not gate(keys=["gate"], args=[LIMIT]):
                time.sleep(REDIS_POLL_S)
            waited = (time.perf_counter() - asked) * 1000
            client.decr("gate")
            return waited

        def redis_filled() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and int(client.get("gate") or 0) < LIMIT:
                time.sleep(0.05)

        log("classes: interactive under a batch flood, per-request Redis semaphore")
        waits["redis"] = _flood(config, segment, "", seconds, probe_redis, redis_filled, redis_port)
    return ClassResults(cost, waits)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> tuple[float, float, float]:
    """(p50, p99, max)"""
    if not values:
        return (float("nan"),) * 3
    return statistics.median(values), percentile(values, 0.99), max(values)
