"""The design's floor, timed: a posix_ipc semaphore around a read-modify-write of a
counter in shared memory (REQUIREMENTS 10).

One definition for ``make bench``'s micro section (bench_micro.py) and for the handler
processes of ``run.py --compare`` (gw_worker.py), so that both time the same loop. It
imports nothing of the product: a worker may run another revision's tree.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from time import perf_counter_ns

import posix_ipc

COUNTER = struct.Struct("<q")

Run = Callable[[int], int]


def floor_runs(sem: posix_ipc.Semaphore, buf: mmap.mmap) -> tuple[Run, Run]:
    """``(one, two)``, each a ``run(n) -> elapsed ns``: ``n`` times one section (acquire,
    counter + 1, release), and ``n`` times two (arrive and leave: + 1, then - 1)."""
    counter = COUNTER

    def one(n: int) -> int:
        acquire, release = sem.acquire, sem.release
        unpack, pack = counter.unpack_from, counter.pack_into
        t0 = perf_counter_ns()
        for _ in range(n):
            acquire()
            pack(buf, 0, unpack(buf, 0)[0] + 1)
            release()
        return perf_counter_ns() - t0

    def two(n: int) -> int:
        acquire, release = sem.acquire, sem.release
        unpack, pack = counter.unpack_from, counter.pack_into
        t0 = perf_counter_ns()
        for _ in range(n):
            acquire()
            pack(buf, 0, unpack(buf, 0)[0] + 1)
            release()
            acquire()
            pack(buf, 0, unpack(buf, 0)[0] - 1)
            release()
        return perf_counter_ns() - t0

    return one, two
