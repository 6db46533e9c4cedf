"""Cross-process measurements: hand-off latency, contended throughput, idle waiters.

Workers are separate interpreters started with the ``spawn`` method, as
handler processes are. Times that are compared across processes come from
``time.monotonic_ns`` (CLOCK_MONOTONIC, one clock for the whole host on
Linux); ``perf_counter`` is only ever compared within one process.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

import posix_ipc
import psutil
from bench_common import (
    Cleanup,
    child_ignores_ctrl_c,
    children_ignore_ctrl_c,
    create_segment,
    new_segment_name,
    percentile,
    proc_cpu_ns,
    proc_switches,
    wait_until,
    write_config,
)

HANDOFF = "handoff"  # limit 1
CONTENDED = "contended"  # limit 4
IDLE = "idle"  # limit 1, held by the parent while 32 wait
CONTENDED_LIMIT = 4
RESULT_TIMEOUT_S = 120.0
SLOT_TIMEOUT_S = 10.0  # a wait this long is a fault, reported as an error, not a hang

SlotFactory = Callable[[], AbstractContextManager[object]]


def _ctx() -> SpawnContext:
    return mp.get_context("spawn")


# --- what a worker holds: the shim, or a comparison ------------------------------------------
def _open_slot(kind: str, spec: tuple[str, ...]) -> tuple[SlotFactory, Callable[[], None]]:
    """A factory of blocking ``with`` slots for ``kind``, and how to let go of it."""
    if kind in ("shim", "shim-file"):
        from handler_shim import Admission

        config, segment, provider = spec
        adm = Admission.attach(config=config, generation="bench", segment=segment)
        return (lambda: adm.slot_blocking(provider, timeout=SLOT_TIMEOUT_S)), adm.close
    if kind == "sem":
        (name,) = spec
        sem = posix_ipc.Semaphore(name)

        @contextlib.contextmanager
        def sem_slot() -> Iterator[None]:
            sem.acquire(SLOT_TIMEOUT_S)
            try:
                yield
            finally:
                sem.release()

        return sem_slot, sem.close
    if kind == "flock":
        (path,) = spec
        fd = os.open(path, os.O_RDWR)

        @contextlib.contextmanager
        def flock_slot() -> Iterator[None]:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

        return flock_slot, lambda: os.close(fd)
    raise ValueError(kind)


def _make_resource(cleanup: Cleanup, kind: str, provider: str, limit: int) -> tuple[str, ...]:
    """Create what ``kind`` shares between the workers (all registered for cleanup)."""
    directory = cleanup.tempdir()
    if kind in ("shim", "shim-file"):
        config = write_config(directory, [{"id": provider, "maxConcurrent": limit}])
        name = cleanup.segment(new_segment_name())
        create_segment(name, lock_file=kind == "shim-file")
        return (config, name, provider)
    if kind == "sem":
        name = cleanup.semaphore(new_segment_name() + ".S")
        posix_ipc.Semaphore(name, posix_ipc.O_CREX, 0o600, limit).close()
        return (name,)
    if kind == "flock":
        assert limit == 1, "flock is a mutex"
        path = os.path.join(directory, "lock")
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        return (path,)
    raise ValueError(kind)


def _start(cleanup: Cleanup, target: Callable[..., None], *args: Any) -> BaseProcess:
    proc = _ctx().Process(target=target, args=args, daemon=True)
    with children_ignore_ctrl_c():
        proc.start()
    cleanup.process(proc)
    return proc


def _collect(q: Any, procs: list[BaseProcess], count: int) -> list[Any]:
    """``count`` results from ``q``; a worker that died without answering is an error."""
    out: list[Any] = []
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while len(out) < count:
        try:
            item = q.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(
                    f"benchmark worker pid {dead[0].pid} exited with {dead[0].exitcode}"
                ) from None
            if time.monotonic() > deadline:
                raise TimeoutError("benchmark workers did not report in time") from None
            continue
        if isinstance(item, tuple) and item and item[0] == "error":
            raise RuntimeError(f"benchmark worker failed: {item[1]}")
        out.append(item)
    return out


def _guard(q: Any, body: Callable[[], None]) -> None:
    """Run a worker's body, reporting an exception to the parent instead of hanging it."""
    child_ignores_ctrl_c()
    try:
        body()
    except BaseException as exc:
        q.put(("error", f"{type(exc).__name__}: {exc}"))
        raise


# --- 1. hand-off latency ---------------------------------------------------------------------
def handoff_worker(
    kind: str, spec: tuple[str, ...], slots: int, hold_s: float, gap_s: float, go: Any, q: Any
) -> None:
    def body() -> None:
        slot, close = _open_slot(kind, spec)
        try:
            q.put("ready")
            go.wait()
            records = []
            now = time.monotonic_ns
            for _ in range(slots):
                arrived = now()
                with slot():
                    entered = now()
                    time.sleep(hold_s)
                    leaving = now()
                records.append((arrived, entered, leaving))
                time.sleep(gap_s)
            q.put((os.getpid(), records))
        finally:
            close()

    _guard(q, body)


def handoff_worker_async(
    kind: str, spec: tuple[str, ...], slots: int, hold_s: float, gap_s: float, go: Any, q: Any
) -> None:
    """The same ping-pong with ``async with adm.slot()`` in an event loop: the waiter is a
    task, woken through the process's doorbell and its dispatcher thread."""

    def body() -> None:
        import asyncio

        from handler_shim import Admission

        config, segment, provider = spec
        adm = Admission.attach(config=config, generation="bench", segment=segment)

        async def run() -> list[tuple[int, int, int]]:
            records = []
            now = time.monotonic_ns
            for _ in range(slots):
                arrived = now()
                async with adm.slot(provider, timeout=SLOT_TIMEOUT_S):
                    entered = now()
                    time.sleep(hold_s)  # the holder's body; nothing else runs on this loop
                    leaving = now()
                records.append((arrived, entered, leaving))
                await asyncio.sleep(gap_s)
            return records

        try:
            q.put("ready")
            go.wait()
            q.put((os.getpid(), asyncio.run(run())))
        finally:
            adm.close()

    _guard(q, body)


@dataclass
class HandoffResult:
    kind: str
    latencies_ns: list[int]

    @property
    def p50(self) -> float:
        return percentile(self.latencies_ns, 50)

    @property
    def p99(self) -> float:
        return percentile(self.latencies_ns, 99)


def handoffs(per_process: dict[int, list[tuple[int, int, int]]]) -> list[int]:
    """Release-to-running latencies of real hand-offs.

    With limit 1 the slots form one timeline. A hand-off is a slot entered by
    another process than the previous one, which had arrived (was waiting)
    before that previous slot was released.
    """
    timeline = sorted(
        (entered, leaving, arrived, pid)
        for pid, records in per_process.items()
        for arrived, entered, leaving in records
    )
    out = []
    for (_e0, left, _a0, pid0), (entered, _l1, arrived, pid1) in itertools.pairwise(timeline):
        if pid1 != pid0 and arrived < left:
            if entered < left:
                raise AssertionError("two holders at once with limit 1")
            out.append(entered - left)
    return out


def run_handoff(
    cleanup: Cleanup, kind: str, slots_each: int, hold_s: float = 0.002, gap_s: float = 0.0003
) -> HandoffResult:
    """Two processes ping-pong one slot (limit 1); each slot is held ``hold_s``.

    The other process re-arrives ``gap_s`` after its release, long before the
    holder lets go, so every hand-off is to a waiter that is asleep.
    """
    with cleanup.scope() as scope:
        is_async = kind == "shim-async"
        spec = _make_resource(scope, "shim" if is_async else kind, HANDOFF, 1)
        ctx = _ctx()
        q, go = ctx.Queue(), ctx.Event()
        target = handoff_worker_async if is_async else handoff_worker
        procs = [
            _start(scope, target, kind, spec, slots_each, hold_s, gap_s, go, q) for _ in range(2)
        ]
        _collect(q, procs, 2)
        go.set()
        results = _collect(q, procs, 2)
        for proc in procs:
            proc.join(10)
        return HandoffResult(kind, handoffs(dict(results)))


# --- 2. contended throughput -----------------------------------------------------------------
START_DELAY_NS = 100_000_000  # commands reach every worker before the common start time


def _precise_sleep() -> None:
    """Timer slack 1 ns for this thread (Linux ``PR_SET_TIMERSLACK``): a 1 ms body then
    sleeps 1.0x ms rather than 1.05-1.1 ms, so the body is what the figure says."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0)


def throughput_worker(specs: dict[str, tuple[str, ...]], commands: Any, q: Any) -> None:
    """Attach to every kind once, then run the rounds the parent commands."""

    def body() -> None:
        _precise_sleep()
        opened = {kind: _open_slot(kind, spec) for kind, spec in specs.items()}
        try:
            q.put("ready")
            while (command := commands.get()) is not None:
                kind, start_ns, duration_s, body_s = command
                slot = opened[kind][0]
                time.sleep(max(0.0, (start_ns - time.monotonic_ns()) / 1e9))
                count = 0
                in_body = 0
                errors: list[str] = []
                now = time.monotonic_ns
                t0 = time.monotonic()
                end = t0 + duration_s
                while time.monotonic() < end:
                    try:
                        with slot():
                            if body_s:
                                b0 = now()
                                time.sleep(body_s)
                                in_body += now() - b0
                    except Exception as exc:  # counted and shown, not hidden
                        errors.append(f"{type(exc).__name__}: {exc}")
                        continue
                    count += 1
                q.put((count / (time.monotonic() - t0), errors, count, in_body))
        finally:
            for _, close in opened.values():
                close()

    _guard(q, body)


def shim_counters(segment: str, provider: str) -> tuple[int, int]:
    """(slots admitted, arrivals that queued) so far: ``admitted_total`` and ``next_ticket``."""
    from shm_layout import rows
    from shm_layout.layout import PROVIDER
    from shm_layout.segment import map_readonly

    buf = map_readonly(segment)
    try:
        p = rows.find_provider(buf, provider)
        assert p is not None
        base = rows.provider_base(p)
        return PROVIDER["admitted_total"].get(buf, base), PROVIDER["next_ticket"].get(buf, base)
    finally:
        buf.close()


@dataclass
class ThroughputRun:
    rates: list[float]  # total slots/s, one per round
    queued: float | None = None  # shim only: share of slots that waited in the queue
    errors: list[str] = field(default_factory=list)  # failed acquires, all rounds
    switches_per_slot: list[float] = field(default_factory=list)  # all workers' threads
    cpu_us_per_slot: list[float] = field(default_factory=list)  # all workers' threads
    body_us: list[float] = field(default_factory=list)  # mean measured body, per round


def run_throughput(
    cleanup: Cleanup,
    kinds: tuple[str, ...],
    process_counts: tuple[int, ...],
    rounds: int,
    duration_s: float,
    log: Callable[[str], None],
    body_s: float = 0.0,
) -> dict[str, dict[int, ThroughputRun]]:
    """Total slots/s of N workers looping on slots against limit 4, each slot's body
    ``body_s`` of sleep (0: empty slots).

    One pool of ``max(process_counts)`` spawned workers serves every run (the
    first N take part), and kinds and rounds are interleaved, so start-up cost
    and machine noise do not fall on one side of a ratio. The workers' context switches
    and CPU (every thread, from /proc) are read before and after each run.
    """
    with cleanup.scope() as scope:
        specs = {kind: _make_resource(scope, kind, CONTENDED, CONTENDED_LIMIT) for kind in kinds}
        ctx = _ctx()
        q = ctx.Queue()
        pool = max(process_counts)
        commands = [ctx.Queue() for _ in range(pool)]
        procs = [_start(scope, throughput_worker, specs, commands[i], q) for i in range(pool)]

        def stop_workers() -> None:
            for c in commands:
                c.put(None)

        scope.push("stop workers", stop_workers)
        _collect(q, procs, pool)
        runs = {k: {n: ThroughputRun([]) for n in process_counts} for k in kinds}
        what = f"{body_s * 1e3:g} ms bodies" if body_s else "empty slots"
        for n in process_counts:
            log(
                f"throughput: {n} processes, {what}, {rounds} x {duration_s:g}s each of "
                + "/".join(kinds)
            )
            queued = [0, 0]
            pids = [p.pid for p in procs[:n] if p.pid is not None]
            for _ in range(rounds):
                for kind in kinds:
                    if kind == "shim":
                        before = shim_counters(specs[kind][1], CONTENDED)
                    sw0 = sum(proc_switches(p) for p in pids)
                    cpu0 = sum(proc_cpu_ns(p) for p in pids)
                    start_ns = time.monotonic_ns() + START_DELAY_NS
                    for c in commands[:n]:
                        c.put((kind, start_ns, duration_s, body_s))
                    reports = _collect(q, procs, n)
                    sw1 = sum(proc_switches(p) for p in pids)
                    cpu1 = sum(proc_cpu_ns(p) for p in pids)
                    run = runs[kind][n]
                    run.rates.append(sum(r[0] for r in reports))
                    run.errors.extend(e for r in reports for e in r[1])
                    slots = max(1, sum(r[2] for r in reports))
                    # the start wait and the report are in the window too: a few switches
                    run.switches_per_slot.append((sw1 - sw0) / slots)
                    run.cpu_us_per_slot.append((cpu1 - cpu0) / 1e3 / slots)
                    run.body_us.append(sum(r[3] for r in reports) / 1e3 / slots)
                    if kind == "shim":
                        after = shim_counters(specs[kind][1], CONTENDED)
                        queued[0] += after[0] - before[0]
                        queued[1] += after[1] - before[1]
            if "shim" in runs and queued[0]:
                runs["shim"][n].queued = queued[1] / queued[0]
        for c in commands:
            c.put(None)
        for proc in procs:
            proc.join(10)
        return runs


# --- 3. idle waiters (R-A7) ------------------------------------------------------------------
def idle_worker(
    config: str, segment: str, threads: int, marks: tuple[Any, Any], release: Any, q: Any
) -> None:
    def body() -> None:
        from handler_shim import Admission

        adm = Admission.attach(config=config, generation="bench-idle", segment=segment)
        granted: list[bool] = []

        def wait_one() -> None:
            with adm.slot_blocking(IDLE, timeout=RESULT_TIMEOUT_S):
                granted.append(True)

        workers = [threading.Thread(target=wait_one) for _ in range(threads)]
        try:
            for t in workers:
                t.start()
            marks[0].wait()
            before = adm.wakeups
            marks[1].wait()
            q.put(("wakeups", adm.wakeups - before))
            release.wait()
            for t in workers:
                t.join()
            q.put(("granted", len(granted)))
        finally:
            adm.close()

    _guard(q, body)


@dataclass
class IdleResult:
    waiters: int
    seconds: float
    cpu_percent: float  # of one core, all waiting processes together
    wakeups_per_s: float  # per waiting process (dispatcher wake-ups)


def _cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def run_idle(cleanup: Cleanup, processes: int, threads: int, seconds: float) -> IdleResult:
    from handler_shim import Admission
    from shm_layout import read_view

    def load(segment: str) -> tuple[int, int]:
        provider = read_view(segment).provider(IDLE)
        assert provider is not None
        return provider.running, provider.waiting

    waiters = processes * threads
    with cleanup.scope() as scope:
        config = write_config(scope.tempdir(), [{"id": IDLE, "maxConcurrent": 1}])
        segment = scope.segment(new_segment_name())
        holder = Admission.attach(config=config, generation="bench-holder", segment=segment)
        scope.push("holder admission", holder.close)
        ctx = _ctx()
        q = ctx.Queue()
        marks, release = (ctx.Event(), ctx.Event()), ctx.Event()
        with holder.slot_blocking(IDLE):
            procs = [
                _start(scope, idle_worker, config, segment, threads, marks, release, q)
                for _ in range(processes)
            ]
            wait_until(
                lambda: load(segment)[1] == waiters,
                RESULT_TIMEOUT_S,
                f"{waiters} waiters to queue",
            )
            time.sleep(0.5)  # let start-up work finish
            watched = [psutil.Process(p.pid) for p in procs]
            marks[0].set()
            cpu0, t0 = _cpu_seconds(watched), time.monotonic()
            time.sleep(seconds)
            cpu1, t1 = _cpu_seconds(watched), time.monotonic()
            marks[1].set()
            wakeups = [n for _, n in _collect(q, procs, processes)]
            running, waiting = load(segment)
            if (running, waiting) != (1, waiters):
                raise RuntimeError(f"idle waiters moved: running={running} waiting={waiting}")
            release.set()
        granted = sum(n for _, n in _collect(q, procs, processes))
        if granted != waiters:
            raise RuntimeError(f"only {granted} of {waiters} idle waiters were granted")
        for proc in procs:
            proc.join(10)
        wall = t1 - t0
        return IdleResult(
            waiters=waiters,
            seconds=wall,
            cpu_percent=100.0 * (cpu1 - cpu0) / wall,
            wakeups_per_s=sum(wakeups) / len(wakeups) / wall,
        )


# --- 5. a lock holder's death: how soon another process gets in -------------------------------
RECOVERY_HOLDER = r"""
import sys, time
sys.path.insert(0, {root!r})
from handler_shim import Admission
adm = Admission.attach(config={config!r}, segment={segment!r}, generation="doomed")
from shm_layout import _core
assert _core.TEST_HOOKS, "a test build of the core (GATEWAY_CAPACITY_TEST_HOOKS=1, make bench)"
adm._core.hold_lock(True)  # frozen inside a section, counters half written
print("locked", flush=True)
time.sleep(3600)
"""


def run_recovery(cleanup: Cleanup, kind: str, trials: int) -> list[float]:
    """Seconds from SIGKILL of a process holding the segment lock to another process's entry.

    The entering process waits in ``slot_blocking`` (in a thread) before the kill, so the
    figure is the lock's own hand-on plus the repair from the holder records.
    """
    import signal
    import subprocess
    import sys
    import threading

    from handler_shim import Admission

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = []
    with cleanup.scope() as scope:
        config, segment, provider = _make_resource(scope, kind, "recovery", 1)
        adm = Admission.attach(config=config, generation="bench", segment=segment)
        scope.push("admission", adm.close)
        for _ in range(trials):
            code = RECOVERY_HOLDER.format(root=root, config=config, segment=segment)
            holder = scope.popen(
                subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
            )
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == b"locked"
            entered: list[int] = []

            def enter(entered: list[int] = entered) -> None:
                with adm.slot_blocking(provider, timeout=30):
                    entered.append(time.monotonic_ns())

            t = threading.Thread(target=enter)
            t.start()
            time.sleep(0.05)  # the contender is waiting for the lock
            killed = time.monotonic_ns()
            os.kill(holder.pid, signal.SIGKILL)
            t.join(30)
            holder.wait(10)
            if entered:
                out.append((entered[0] - killed) / 1e9)
    return out
