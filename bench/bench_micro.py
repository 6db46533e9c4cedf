"""Uncontended acquire+release, one process, one thread: what each way of admitting costs.

Each case is a ``run(n) -> elapsed ns`` for ``n`` acquire+release pairs. The
rounds are interleaved (every case once per round, then the next round), so
noise from the shared machine falls on all cases alike and the ratios of one
round's medians stay honest.
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter_ns

import posix_ipc
from bench_common import Cleanup, calibrate, create_segment, new_segment_name, write_config
from bench_redis import RedisSemaphore, RedisUnavailable, start_redis
from floor_loops import floor_runs

from handler_shim import Admission

PROVIDER = "bench"
LIMIT = 4


@dataclass
class Case:
    key: str
    label: str
    run: Callable[[int], int]
    iterations: int = 0


@dataclass
class MicroResult:
    key: str
    label: str
    iterations: int
    per_op_ns: list[float]  # one per round


class Full(Exception):
    """An uncontended acquire found the budget spent: the benchmark itself is broken."""


def _shim_cases(cleanup: Cleanup, runner: asyncio.Runner) -> list[Case]:
    directory = cleanup.tempdir()
    config = write_config(directory, [{"id": PROVIDER, "maxConcurrent": LIMIT}])
    name = cleanup.segment(new_segment_name())
    adm = Admission.attach(config=config, generation="bench", segment=name)
    cleanup.push("admission", adm.close)
    # the same on a segment of the lock-file kind (the macOS path, forced here)
    file_name = cleanup.segment(new_segment_name())
    create_segment(file_name, lock_file=True)
    file_adm = Admission.attach(config=config, generation="bench", segment=file_name)
    cleanup.push("admission (lock file)", file_adm.close)

    def blocking_on(attachment: Admission) -> Callable[[int], int]:
        def run(n: int) -> int:
            slot = attachment.slot_blocking
            t0 = perf_counter_ns()
            for _ in range(n):
                with slot(PROVIDER):
                    pass
            return perf_counter_ns() - t0

        return run

    blocking, file_blocking = blocking_on(adm), blocking_on(file_adm)

    async def _async(n: int) -> int:
        slot = adm.slot
        t0 = perf_counter_ns()
        for _ in range(n):
            async with slot(PROVIDER):
                pass
        return perf_counter_ns() - t0

    return [
        Case("shim_blocking", "shim slot_blocking()", blocking),
        Case("shim_async", "shim async slot()", lambda n: runner.run(_async(n))),
        Case("shim_file", "shim slot_blocking(), lock-file kind (macOS path)", file_blocking),
    ]


def _asyncio_case(runner: asyncio.Runner) -> Case:
    async def _run(n: int) -> int:
        sem = asyncio.Semaphore(LIMIT)
        t0 = perf_counter_ns()
        for _ in range(n):
            async with sem:
                pass
        return perf_counter_ns() - t0

    return Case(
        "asyncio", "asyncio.Semaphore (1 process, not shared)", lambda n: runner.run(_run(n))
    )


_COUNTER = struct.Struct("<q")


def _flock_case(cleanup: Cleanup) -> Case:
    """A counter in a file, read-modify-written under ``flock``: a real cross-process budget."""
    path = os.path.join(cleanup.tempdir(), "budget")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    cleanup.push("budget file", lambda: os.close(fd))
    os.pwrite(fd, _COUNTER.pack(0), 0)

    def change(delta: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            (n,) = _COUNTER.unpack(os.pread(fd, 8, 0))
            if delta > 0 and n >= LIMIT:
                raise Full("file counter")
            os.pwrite(fd, _COUNTER.pack(n + delta), 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def run(n: int) -> int:
        t0 = perf_counter_ns()
        for _ in range(n):
            change(+1)
            change(-1)
        return perf_counter_ns() - t0

    return Case("flock", "fcntl.flock counter in a file", run)


def _redis_cases(cleanup: Cleanup) -> list[Case] | str:
    try:
        client = start_redis(cleanup)
    except RedisUnavailable as exc:
        return str(exc)
    cleanup.push("redis client", client.close)
    sem = RedisSemaphore(client, "gwbench:budget", LIMIT)

    def run(n: int) -> int:
        acquire, release = sem.try_acquire, sem.release
        t0 = perf_counter_ns()
        for _ in range(n):
            if not acquire():
                raise Full("redis")
            release()
        return perf_counter_ns() - t0

    def ping(n: int) -> int:
        t0 = perf_counter_ns()
        for _ in range(n):
            client.ping()
        return perf_counter_ns() - t0

    return [
        Case("redis", "Redis Lua semaphore (loopback)", run),
        Case("redis_ping", "  for scale: one Redis PING round trip", ping),
    ]


def floor_name_pair(cleanup: Cleanup) -> tuple[str, str]:
    base = new_segment_name()
    return cleanup.semaphore(base + ".F"), cleanup.shared_memory(base + ".M")


def _floor_cases(cleanup: Cleanup) -> list[Case]:
    """One posix_ipc semaphore acquire+release around one struct read-modify-write (one
    section), and two of them (arrive and leave: the design's floor, REQUIREMENTS 10)."""
    sem_name, shm_name = floor_name_pair(cleanup)
    sem = posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX, 0o600, 1)
    cleanup.push("floor semaphore", sem.close)
    shm = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, 0o600, mmap.PAGESIZE)
    buf = mmap.mmap(shm.fd, mmap.PAGESIZE)
    shm.close_fd()
    cleanup.push("floor mapping", buf.close)
    one, two = floor_runs(sem, buf)

    return [
        Case("floor", "floor: 2 x (posix_ipc sem + struct RMW)", two),
        Case("floor1", "  one such section (sem + struct RMW)", one),
    ]


def run_micro(
    cleanup: Cleanup, *, rounds: int, target_s: float, log: Callable[[str], None]
) -> tuple[list[MicroResult], list[str]]:
    """Measure every case; returns results and notes (e.g. why a case was skipped)."""
    notes: list[str] = []
    runner = asyncio.Runner()
    cleanup.push("event loop", runner.close)
    cases = _shim_cases(cleanup, runner)
    cases.append(_asyncio_case(runner))
    cases.append(_flock_case(cleanup))
    redis_cases = _redis_cases(cleanup)
    if isinstance(redis_cases, str):
        notes.append(f"redis: not measured ({redis_cases})")
    else:
        cases.extend(redis_cases)
    cases.extend(_floor_cases(cleanup))
    for case in cases:
        case.iterations = calibrate(case.run, target_s)
    log(
        "uncontended: "
        + ", ".join(f"{c.key} x{c.iterations}" for c in cases)
        + f", {rounds} rounds"
    )
    samples: dict[str, list[float]] = {c.key: [] for c in cases}
    for _ in range(rounds):
        for case in cases:
            samples[case.key].append(case.run(case.iterations) / case.iterations)
    return [MicroResult(c.key, c.label, c.iterations, samples[c.key]) for c in cases], notes
