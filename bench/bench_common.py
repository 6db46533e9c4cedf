"""Shared pieces of the benchmark: cleanup, unique names, timing and table helpers.

Everything the benchmark creates (segments and their semaphores, temporary
directories, child processes, the redis-server) is registered with
:class:`Cleanup` the moment it exists, so it is removed on success, failure,
Ctrl-C and SIGTERM alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import posix_ipc

from shm_layout import unlink_segment


def create_segment(name: str, *, lock_file: bool) -> None:
    """Create segment ``name`` with the lock kind asked for; every process that attaches
    later follows its header, whatever its own environment says."""
    from shm_layout import lock
    from shm_layout.segment import Segment

    saved = os.environ.get(lock.FORCE_LOCK_FILE_ENV)
    os.environ[lock.FORCE_LOCK_FILE_ENV] = "1" if lock_file else "0"
    try:
        Segment.open(name).close()
    finally:
        if saved is None:
            del os.environ[lock.FORCE_LOCK_FILE_ENV]
        else:
            os.environ[lock.FORCE_LOCK_FILE_ENV] = saved


def new_segment_name() -> str:
    """``/gwb-`` + 8 hex: 13 bytes, well under the 26 a segment name may use."""
    return "/gwb-" + secrets.token_hex(4)


@dataclass
class Cleanup:
    """A LIFO of undo actions, run once, each shielded from the others' failures."""

    _undo: list[tuple[str, Callable[[], object]]] = field(default_factory=list)

    def push(self, what: str, fn: Callable[[], object]) -> None:
        self._undo.append((what, fn))

    def segment(self, name: str) -> str:
        self.push(f"segment {name}", lambda: unlink_segment(name))
        return name

    def semaphore(self, name: str) -> str:
        return self._posix_ipc("semaphore", posix_ipc.unlink_semaphore, name)

    def shared_memory(self, name: str) -> str:
        return self._posix_ipc("shared memory", posix_ipc.unlink_shared_memory, name)

    def _posix_ipc(self, what: str, unlink: Callable[[str], None], name: str) -> str:
        """Unlink the POSIX IPC object ``name`` at cleanup, if it still exists."""

        def undo() -> None:
            with contextlib.suppress(posix_ipc.ExistentialError):
                unlink(name)

        self.push(f"{what} {name}", undo)
        return name

    def tempdir(self) -> str:
        path = tempfile.mkdtemp(prefix="gwbench-")
        self.push(f"directory {path}", lambda: shutil.rmtree(path, ignore_errors=True))
        return path

    def process(self, proc: BaseProcess) -> BaseProcess:
        self.push(f"process {proc.pid}", lambda: stop_process(proc))
        return proc

    def popen(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self.push(f"process {proc.pid}", lambda: stop_popen(proc))
        return proc

    def run(self) -> None:
        # Signals must not interrupt the cleanup itself.
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while self._undo:
                what, fn = self._undo.pop()
                try:
                    fn()
                except Exception as exc:  # keep cleaning the rest
                    print(f"cleanup: {what}: {exc}")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Cleanup]:
        """A nested scope: what is pushed inside is undone when it ends."""
        inner = Cleanup()
        try:
            yield inner
        finally:
            inner.run()


def stop_process(proc: BaseProcess, grace: float = 2.0) -> None:
    if proc.pid is None:
        return
    if proc.is_alive():
        proc.terminate()
        proc.join(grace)
    if proc.is_alive():
        proc.kill()
    proc.join(grace)


def stop_popen(proc: subprocess.Popen[bytes], grace: float = 3.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)


def raise_on_sigterm() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so every ``finally`` runs."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


def child_ignores_ctrl_c() -> None:
    """Children leave Ctrl-C to the parent, which stops them and cleans up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def children_ignore_ctrl_c() -> Iterator[None]:
    """Start children inside this: an ignored SIGINT survives exec, so a Ctrl-C that
    reaches the whole process group cannot interrupt them while they import."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def write_config(directory: str, providers: Sequence[dict[str, Any]]) -> str:
    path = os.path.join(directory, "gateway.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"providers": list(providers)}, f)
    return path


def write_router_files(directory: str, key: str, worker_url: str, model: str) -> tuple[str, str]:
    """A router's key file (0600) and a registry of one worker ``w`` at ``worker_url``
    serving ``model`` (read as llama-server's /props), in ``directory``: their paths."""
    key_file = os.path.join(directory, "router.key")
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, key.encode())
    os.close(fd)
    registry = os.path.join(directory, "workers.json")
    worker = {"id": "w", "urls": [worker_url], "models": [model], "slots": {"source": "props"}}
    with open(registry, "w", encoding="utf-8") as f:
        json.dump({"workers": [worker]}, f)
    return key_file, registry


# --- timing ------------------------------------------------------------------------------
def calibrate(
    run: Callable[[int], int], target_s: float, lo: int = 200, hi: int = 2_000_000
) -> int:
    """Iterations that take about ``target_s``, from a short warm-up run."""
    n = lo
    while True:
        elapsed = run(n)
        if elapsed >= 20_000_000 or n >= hi:  # 20 ms is enough to extrapolate
            break
        n *= 4
    per_op = elapsed / n
    return max(lo, min(hi, int(target_s * 1e9 / per_op)))


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, int(-(-q * len(ordered) // 100)))  # ceil(q/100 * n)
    return ordered[min(rank, len(ordered)) - 1]


def fmt_us(ns: float) -> str:
    us = ns / 1000
    if us >= 100:
        return f"{us:.0f}"
    if us >= 10:
        return f"{us:.1f}"
    return f"{us:.2f}"


def fmt_ratio(x: float) -> str:
    if x != x:  # NaN
        return "-"
    if x >= 10:
        return f"{x:.0f}x"
    return f"{x:.2f}x"


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            out.append(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)


# --- what the kernel says a process did ---------------------------------------------------
def proc_cpu_ns(pid: int) -> int:
    """CPU time (user + system, ns) of every live thread of ``pid`` so far, from
    ``/proc/<pid>/task/*/schedstat`` (nanoseconds; psutil's ticks are 10 ms). A thread
    that ended is not counted: measure processes whose threads live through the window."""
    total = 0
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError),
                open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f,
            ):
                total += int(f.read().split()[0])
    return total


def proc_switches(pid: int) -> int:
    """Context switches (voluntary + involuntary) of every live thread of ``pid``: each
    voluntary one is a sleep, so a wake-up follows it."""
    total = 0
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(FileNotFoundError, ProcessLookupError),
                open(f"/proc/{pid}/task/{tid}/status", encoding="ascii") as f,
            ):
                for line in f:
                    if "ctxt_switches:" in line:
                        total += int(line.split()[1])
    return total


def loadavg() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclass
class MachineMeter:
    """Who used the CPUs between ``start`` and ``report``: this benchmark (its process and
    every child it has reaped: ``os.times``) and everyone else (all busy time in
    /proc/stat minus ours). The load average counts our own workers too; this does not."""

    wall: float = 0.0
    ours: float = 0.0
    busy: float = 0.0

    @staticmethod
    def _busy_s() -> float:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours_s() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def start(self) -> MachineMeter:
        self.wall, self.ours, self.busy = time.monotonic(), self._ours_s(), self._busy_s()
        return self

    @classmethod
    def others_share(cls, seconds: float = 3.0) -> float:
        """Share of all cores busy over ``seconds`` while this process sleeps and has no
        children running: everyone else's use of the machine."""
        busy0, t0 = cls._busy_s(), time.monotonic()
        time.sleep(seconds)
        return (cls._busy_s() - busy0) / ((time.monotonic() - t0) * (os.cpu_count() or 1))

    def measure(self) -> tuple[str, float]:
        """The line for the report, and everyone else's share of the cores."""
        wall = time.monotonic() - self.wall
        ours = self._ours_s() - self.ours
        others = max(0.0, self._busy_s() - self.busy - ours)
        cores = os.cpu_count() or 1
        share = others / (wall * cores)
        line = (
            f"CPU over {wall:.0f} s: this benchmark {ours:.1f} s, others {others:.1f} s "
            f"({100 * share:.0f} % of {cores} cores)"
        )
        return line, share

    def report(self) -> str:
        return self.measure()[0]
