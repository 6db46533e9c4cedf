"""``run.py --compare REF``: the micro figures of two revisions, side by side, in one run.

Each side is a source tree: another git ref is exported with ``git archive`` into a
temporary directory and its compiled core built there (``setup.py build_ext --inplace``);
this checkout is used as it is (uncommitted changes included). Every side's code runs in
``gw_worker.py`` processes of its own (``GWCAP_BENCH_SOURCE``: the editable install's
finder is taken out of the way, bench_source.py), so two layouts never meet in one
interpreter, and each side gets its own segment.

Interleaved: every round runs every case of every side once (the side order alternates
from round to round), so noise from the shared machine falls on both sides alike. What
is compared: uncontended ``slot_blocking``/``slot()`` against the two-section floor and
``asyncio.Semaphore`` measured in the same worker (the ratios docs/benchmarks.md quotes);
hand-off p50/p99 (two workers of the side ping-pong one slot of limit 1); an arrival
refused with QueueFull with 2 and 17 processes attached. The hand-off is measured for a
blocking and an async waiter.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench_common import Cleanup, new_segment_name, write_config
from bench_host import Worker, ask_all, start_workers, stop_workers
from bench_procs import handoffs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = ("shim_blocking", "shim_async", "asyncio", "floor2")


@dataclass
class Side:
    label: str
    source: str
    segment: str = ""
    workers: list[Worker] = field(default_factory=list)
    iterations: dict[str, int] = field(default_factory=dict)
    per_op: dict[str, list[float]] = field(default_factory=dict)  # case -> one per round
    handoff_ns: list[int] = field(default_factory=list)
    handoff_async_ns: list[int] = field(default_factory=list)
    refusal_ns: dict[int, list[float]] = field(default_factory=dict)  # processes -> rounds


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def build_core(tree: str) -> None:
    """Build ``tree``'s compiled core in place with its own setup.py. In a scratch copy
    of setup.py and the C sources only: setuptools reads pyproject.toml next to setup.py,
    and the venv's setuptools may be older than what a tree's pyproject.toml needs (pip
    builds the editable install in an isolated environment with a newer one)."""
    import glob
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gwbench-build-") as scratch:
        shutil.copy(os.path.join(tree, "setup.py"), scratch)
        os.mkdir(os.path.join(scratch, "shm_layout"))
        for source in glob.glob(os.path.join(tree, "shm_layout", "*.[ch]")):
            shutil.copy(source, os.path.join(scratch, "shm_layout"))
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=scratch,
            capture_output=True,
            check=True,
        )
        built = glob.glob(os.path.join(scratch, "shm_layout", "_core*.so"))
        if not built:
            raise RuntimeError(f"no compiled core was built for {tree}")
        for old in glob.glob(os.path.join(tree, "shm_layout", "_core*.so")):
            os.unlink(old)  # unlink, not overwrite: a running process may map it
        for so in built:
            shutil.copy(so, os.path.join(tree, "shm_layout"))


def prepare_tree(cleanup: Cleanup, ref: str, log: Callable[[str], None]) -> Side:
    """Export ``ref`` and build its core; a Side for it."""
    sha = git("rev-parse", "--short", ref)
    directory = cleanup.tempdir()
    log(f"compare: exporting {ref} ({sha}) and building its core")
    archive = subprocess.run(
        ["git", "archive", "--format=tar", sha], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
    build_core(directory)
    return Side(f"{ref} ({sha})" if ref != sha else sha, directory)


def this_checkout() -> Side:
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    sha = git("rev-parse", "--short", "HEAD")
    return Side(f"this checkout ({sha}{', with changes' if dirty else ''})", ROOT)


def _unlink_layout2_names(segment: str) -> None:
    """Layout 2 named its semaphores after the segment (``.C``, ``.d0`` .. ``.d127``)."""
    import posix_ipc

    for name in [segment + ".C", *(f"{segment}.d{m}" for m in range(128))]:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_semaphore(name)


def _setup(cleanup: Cleanup, side: Side, config: str, target_s: float) -> None:
    side.segment = cleanup.segment(new_segment_name())
    cleanup.push(f"layout 2 names of {side.segment}", lambda: _unlink_layout2_names(side.segment))
    side.workers = start_workers(cleanup, 2, side.source)
    cleanup.push("stop workers", lambda: stop_workers(side.workers))
    lead = side.workers[0]
    lead.ask("attach", segment=side.segment, config=config)
    side.workers[1].ask("attach", segment=side.segment, config=config)
    base = new_segment_name()
    sem, shm = cleanup.semaphore(base + ".F"), cleanup.shared_memory(base + ".M")
    lead.ask("micro_setup", provider="bench", sem=sem, shm=shm)
    for case in CASES:
        side.iterations[case] = lead.ask("calibrate", case=case, target_s=target_s)["n"]
        side.per_op[case] = []


def _handoff_round(side: Side, slots: int, mode: str) -> None:
    start_ns = time.monotonic_ns() + 100_000_000
    for w in side.workers:
        w.send(
            "handoff",
            provider="handoff",
            slots=slots,
            hold_s=0.002,
            gap_s=0.0003,
            start_ns=start_ns,
            mode=mode,
        )
    answers = [w.receive() for w in side.workers]
    latencies = handoffs({a["pid"]: [tuple(r) for r in a["records"]] for a in answers})
    (side.handoff_ns if mode == "blocking" else side.handoff_async_ns).extend(latencies)


def run_compare(
    cleanup: Cleanup,
    sides: Sequence[Side],
    *,
    rounds: int,
    target_s: float,
    handoff_rounds: int,
    handoff_slots: int,
    refusal_counts: Sequence[int],
    log: Callable[[str], None],
) -> None:
    """Fill in every side's figures (see the module docstring)."""
    directory = cleanup.tempdir()
    config = write_config(
        directory,
        [
            {"id": "bench", "maxConcurrent": 4},
            {"id": "handoff", "maxConcurrent": 1},
            {"id": "full", "maxConcurrent": 1},
        ],
    )
    for side in sides:
        log(f"compare: {side.label}: workers, segment, calibration")
        _setup(cleanup, side, config, target_s)
    log(f"compare: uncontended, {rounds} interleaved rounds")
    for r in range(rounds):
        for side in sides if r % 2 == 0 else list(reversed(sides)):
            for case in CASES:
                n = side.iterations[case]
                side.per_op[case].append(side.workers[0].ask("run", case=case, n=n)["ns"] / n)
    log(f"compare: hand-off, {handoff_rounds} interleaved rounds of 2 x {handoff_slots} slots")
    for r in range(handoff_rounds):
        for side in sides if r % 2 == 0 else list(reversed(sides)):
            for mode in ("blocking", "async"):
                _handoff_round(side, handoff_slots, mode)
    _refusals(cleanup, sides, config, refusal_counts, rounds, log)


def _refusals(
    cleanup: Cleanup,
    sides: Sequence[Side],
    config: str,
    counts: Sequence[int],
    rounds: int,
    log: Callable[[str], None],
) -> None:
    """Side by side: the lead holds ``full``'s slot, 32 wait spread over the other
    processes of the side (its partner and, for more, idle-attached extra workers)."""
    extra = {s.label: start_workers(cleanup, max(counts) - 2, s.source) for s in sides}
    for workers in extra.values():
        cleanup.push("stop workers", functools.partial(stop_workers, workers))
    attached = {s.label: 2 for s in sides}
    granted = {s.label: 0 for s in sides}
    for n in counts:
        log(f"compare: QueueFull with {n} processes attached")
        for s in sides:
            more = extra[s.label][attached[s.label] - 2 : n - 2]
            ask_all(more, "attach", segment=s.segment, config=config)
            attached[s.label] = n
            others = [s.workers[1], *extra[s.label][: n - 2]]
            s.workers[0].ask("hold", provider="full")
            for i, w in enumerate(others):
                count = 32 // len(others) + (1 if i < 32 % len(others) else 0)
                if count:
                    w.ask("wait", provider="full", count=count)
            s.refusal_ns[n] = []
        for s in sides:
            _wait_for(s, "full", (1, 32))
        per_round = {s.label: _per_round(s) for s in sides}  # about 0.1 s a round
        for r in range(rounds):
            for s in sides if r % 2 == 0 else list(reversed(sides)):
                k = per_round[s.label]
                ns = s.workers[0].ask("refuse", provider="full", n=k)["ns"]
                s.refusal_ns[n].append(ns / k)
        for s in sides:
            s.workers[0].ask("release")
            others = [s.workers[1], *extra[s.label][: n - 2]]
            granted[s.label] += 32
            _wait_granted(others, granted[s.label])


def _wait_for(side: Side, provider: str, want: tuple[int, int], timeout: float = 60.0) -> None:
    """Poll (running, waiting) through the side's own reader (the layouts differ)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = side.workers[0].ask("load", segment=side.segment, provider=provider)["load"]
        if seen is not None and tuple(seen) == want:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{side.label}: {provider} is {seen}, not {want}")
        time.sleep(0.02)


def _per_round(side: Side, target_s: float = 0.1) -> int:
    n = 100
    while True:
        ns = side.workers[0].ask("refuse", provider="full", n=n)["ns"]
        if ns >= 20_000_000 or n >= 1_000_000:
            return max(100, int(target_s * 1e9 * n / ns))
        n *= 4


def _wait_granted(workers: Sequence[Worker], expected: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(a["waited"] for a in ask_all(workers, "waited")) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError("the waiters were not granted in time")
        time.sleep(0.05)
