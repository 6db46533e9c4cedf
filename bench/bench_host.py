"""The host as the number of handler processes grows: idle waiters, the sweep,
an arrival refused with QueueFull; and what one process pays: close(), import, attach.

Handler processes are ``bench/gw_worker.py`` subprocesses (a hundred start in seconds and
carry nothing of the benchmark), driven line by line. The parent is not registered in the
segments it only watches (a segment has 128 member rows, and the 128-process figures use
them all); it reads them lock-free, or opens them unregistered to time a sweep.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench_common import (
    Cleanup,
    children_ignore_ctrl_c,
    median,
    new_segment_name,
    proc_cpu_ns,
    proc_switches,
    write_config,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "gw_worker.py")
ANSWER_TIMEOUT_S = 120.0


class WorkerFailed(RuntimeError):
    pass


class Worker:
    """One ``gw_worker.py`` process; ``ask`` sends a command and returns its answer."""

    def __init__(self, cleanup: Cleanup, source: str | None = None) -> None:
        env = dict(os.environ)
        env.pop("GWCAP_BENCH_SOURCE", None)
        if source is not None:
            env["GWCAP_BENCH_SOURCE"] = source
        with children_ignore_ctrl_c():
            self.proc: subprocess.Popen[str] = subprocess.Popen(
                [sys.executable, WORKER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
                env=env,
            )
        cleanup.popen(self.proc)  # type: ignore[arg-type]
        self.pid = self.proc.pid
        self.started = False

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            raise WorkerFailed(
                f"worker {self.pid} "
                + ("did not answer in time" if code is None else f"exited with {code}")
            )
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise WorkerFailed(f"worker {self.pid}: {answer['error']}")
        return answer

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.receive()

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def start_workers(cleanup: Cleanup, n: int, source: str | None = None) -> list[Worker]:
    """``n`` workers, started together; returns once every one has said it is ready."""
    workers = [Worker(cleanup, source) for _ in range(n)]
    for w in workers:
        w.receive()
    return workers


def ask_all(workers: Sequence[Worker], op: str, **args: Any) -> list[dict[str, Any]]:
    """The same command to every worker at once (they work in parallel)."""
    for w in workers:
        w.send(op, **args)
    return [w.receive() for w in workers]


def stop_workers(workers: Sequence[Worker]) -> None:
    for w in workers:
        with contextlib.suppress(OSError):
            if w.proc.stdin is not None:
                w.proc.stdin.close()
    for w in workers:
        w.close()


def provider_load(segment: str, provider: str) -> tuple[int, int]:
    from shm_layout import read_view

    view = read_view(segment).provider(provider)
    assert view is not None, provider
    return view.running, view.waiting


def wait_for_load(segment: str, want: dict[str, tuple[int, int]], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        seen = {p: provider_load(segment, p) for p in want}
        if seen == want:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"segment {segment}: wanted {want}, have {seen}")
        time.sleep(0.02)


def make_segment(cleanup: Cleanup, providers: dict[str, int]) -> tuple[str, str]:
    """A segment with these providers (id: limit), made by an attach that then closes:
    rows stay, the member row is freed. Returns (segment, config path)."""
    from handler_shim import Admission

    config = write_config(
        cleanup.tempdir(), [{"id": p, "maxConcurrent": limit} for p, limit in providers.items()]
    )
    segment = cleanup.segment(new_segment_name())
    Admission.attach(config=config, generation="bench-setup", segment=segment).close()
    return segment, config


def wait_all_waited(workers: Sequence[Worker], expected: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        answers = ask_all(workers, "waited")
        done = sum(a["waited"] for a in answers)
        errors = [e for a in answers for e in a["errors"]]
        if errors:
            raise RuntimeError(f"a waiter failed: {errors[0]}")
        if done >= expected:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {done} of {expected} waiters were granted")
        time.sleep(0.05)


# --- idle waiters (R-A7) ---------------------------------------------------------------------
@dataclass
class IdleResult:
    processes: int
    mode: str
    seconds: float
    cpu_percent: float  # of one core, every waiting process together
    switches_per_s: float  # per process: context switches of all its threads (its wake-ups)
    doorbell_per_s: float  # per process: doorbell posts its dispatcher took (Admission.wakeups)


def run_idle(
    cleanup: Cleanup,
    process_counts: Sequence[int],
    seconds: float,
    modes: Sequence[str],
    log: Callable[[str], None],
) -> list[IdleResult]:
    """One waiter in each of N processes, for 0.5 s of settling and then ``seconds``.

    Providers of limit 1, 32 waiters each (the queue bound): process 32g holds provider g's
    slot, and all 32 processes of group g wait for it (the holder too, a second request)."""
    out = []
    with cleanup.scope() as scope:
        # segments first: the workers are stopped before their segments go (a handler
        # whose segment is removed under it makes it again, R-A15)
        segments = {
            (n, mode): make_segment(scope, {f"idle{g}": 1 for g in range(n // 32)})[0]
            for n in process_counts
            for mode in modes
        }
        workers = start_workers(scope, max(process_counts))
        scope.push("stop workers", lambda: stop_workers(workers))
        for n in process_counts:
            groups = n // 32
            for mode in modes:
                log(f"idle: {n} processes, one {mode} waiter each, {seconds:g}s")
                segment = segments[n, mode]
                used = workers[:n]
                ask_all(used, "attach", segment=segment)
                for g in range(groups):
                    used[32 * g].ask("hold", provider=f"idle{g}")
                for i, w in enumerate(used):
                    w.send("wait", provider=f"idle{i // 32}", count=1, mode=mode)
                for w in used:
                    w.receive()
                wait_for_load(segment, {f"idle{g}": (1, 32) for g in range(groups)})
                time.sleep(1.0)  # start-up work done, first sweeps passed
                pids = [w.pid for w in used]
                wake0 = [a["wakeups"] for a in ask_all(used, "wakeups")]
                cpu0 = sum(proc_cpu_ns(p) for p in pids)
                sw0 = sum(proc_switches(p) for p in pids)
                t0 = time.monotonic()
                time.sleep(seconds)
                cpu1 = sum(proc_cpu_ns(p) for p in pids)
                sw1 = sum(proc_switches(p) for p in pids)
                t1 = time.monotonic()
                wake1 = [a["wakeups"] for a in ask_all(used, "wakeups")]
                # the two reads of /proc for 128 processes are themselves a few ms
                wall = t1 - t0
                load = {f"idle{g}": provider_load(segment, f"idle{g}") for g in range(groups)}
                if any(v != (1, 32) for v in load.values()):
                    raise RuntimeError(f"idle waiters moved: {load}")
                before = sum(a["waited"] for a in ask_all(used, "waited"))
                for g in range(groups):
                    used[32 * g].ask("release")
                wait_all_waited(used, before + n)
                ask_all(used, "detach")
                out.append(
                    IdleResult(
                        processes=n,
                        mode=mode,
                        seconds=wall,
                        cpu_percent=100.0 * (cpu1 - cpu0) / 1e9 / wall,
                        switches_per_s=(sw1 - sw0) / n / wall,
                        doorbell_per_s=(sum(wake1) - sum(wake0)) / n / wall,
                    )
                )
    return out


# --- the host's sweep ------------------------------------------------------------------------
@dataclass
class SweepResult:
    processes: int
    providers: int
    seconds: float
    sweeps_per_s: float
    lock_entries_per_s: float
    spaced_ns: list[int]  # one sweep every 50 ms
    back_to_back_ns: list[int]

    @property
    def held_ms_per_s(self) -> float:
        return self.sweeps_per_s * median(self.spaced_ns) / 1e6


def run_sweep(
    cleanup: Cleanup, processes: int, providers: int, seconds: float, log: Callable[[str], None]
) -> SweepResult:
    """``processes`` registered processes on ``providers`` providers of limit 1: process i
    holds provider i's slot, the rest wait (one each). The host's own sweeps are counted
    from the header for ``seconds`` (``sweep_mono`` changes, ``lock_seq`` steps), then the
    parent, unregistered, times sweeps itself (``Core.sweep``: the same locked step)."""
    from shm_layout.layout import HEADER
    from shm_layout.segment import Segment, map_readonly

    with cleanup.scope() as scope:
        names = [f"sw{p}" for p in range(providers)]
        segment, _ = make_segment(scope, dict.fromkeys(names, 1))  # before the workers
        log(f"sweep: starting {processes} processes")
        workers = start_workers(scope, processes)
        scope.push("stop workers", lambda: stop_workers(workers))
        ask_all(workers, "attach", segment=segment)
        holders, waiters = workers[:providers], workers[providers:]
        ask_all_each(holders, "hold", [{"provider": n} for n in names])
        for i, w in enumerate(waiters):
            w.send("wait", provider=names[i % providers], count=1)
        for w in waiters:
            w.receive()
        want = {n: (1, 0) for n in names}
        for i in range(len(waiters)):
            r, q = want[names[i % providers]]
            want[names[i % providers]] = (r, q + 1)
        wait_for_load(segment, want)
        time.sleep(1.0)
        buf = map_readonly(segment)
        scope.push("mapping", buf.close)
        log(f"sweep: counting the host's sweeps for {seconds:g}s")
        sweeps = 0
        last = HEADER["sweep_mono"].get(buf)
        seq0 = HEADER["lock_seq"].get(buf)
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(0.005)
            now = HEADER["sweep_mono"].get(buf)
            if now != last:
                sweeps += 1
                last = now
        wall = time.monotonic() - t0
        entries = HEADER["lock_seq"].get(buf) - seq0
        seg = Segment.open(segment, create=False)
        scope.push("segment", seg.close)
        core = seg.core
        spaced = []
        for _ in range(40):
            time.sleep(0.05)
            t = time.perf_counter_ns()
            core.sweep(0.0)
            spaced.append(time.perf_counter_ns() - t)
        back = []
        for _ in range(200):
            t = time.perf_counter_ns()
            core.sweep(0.0)
            back.append(time.perf_counter_ns() - t)
        ask_all(holders, "release")
        wait_all_waited(waiters, len(waiters))
        ask_all(workers, "detach")
        return SweepResult(processes, providers, wall, sweeps / wall, entries / wall, spaced, back)


def ask_all_each(workers: Sequence[Worker], op: str, args: Sequence[dict[str, Any]]) -> None:
    for w, a in zip(workers, args, strict=True):
        w.send(op, **a)
    for w in workers:
        w.receive()


# --- an arrival refused with QueueFull -------------------------------------------------------
@dataclass
class RefusalResult:
    processes: int  # attached to the segment, the measuring one included
    user_ns: list[float]  # per refusal as the caller sees it (QueueFull raised and caught)
    core_ns: list[float]  # per refusing core step alone (this checkout only)


def run_refusals(
    cleanup: Cleanup,
    process_counts: Sequence[int],
    rounds: int,
    log: Callable[[str], None],
    measure_core: bool = True,
) -> list[RefusalResult]:
    """For each N, a segment of its own with N registered processes: a measuring one that
    holds the only slot of a limit-1 provider, and N-1 others over which 32 waiting
    requests (the bound) are spread. The measuring process arrives again and again: every
    arrival is refused. All segments live at once and the rounds (about 0.1 s each) go
    round the counts, so the machine's noise falls on every N alike; medians."""
    out = []
    with cleanup.scope() as scope:
        segments = {n: make_segment(scope, {"full": 1})[0] for n in process_counts}
        log(f"queuefull: starting {sum(process_counts)} processes")
        workers = start_workers(scope, sum(process_counts))
        scope.push("stop workers", lambda: stop_workers(workers))
        groups: dict[int, list[Worker]] = {}
        for n in process_counts:
            groups[n], workers = workers[:n], workers[n:]
        for n, group in groups.items():
            ask_all(group, "attach", segment=segments[n])
            group[0].ask("hold", provider="full")
            others = group[1:]
            for i, w in enumerate(others):
                count = 32 // len(others) + (1 if i < 32 % len(others) else 0)
                if count:
                    w.ask("wait", provider="full", count=count)
        for n in process_counts:
            wait_for_load(segments[n], {"full": (1, 32)})
        log(f"queuefull: {rounds} rounds over {', '.join(map(str, process_counts))} processes")
        ops = ["refuse", "refuse_core"] if measure_core else ["refuse"]

        def measure(n: int, op: str, k: int) -> int:
            ns: int = groups[n][0].ask(op, provider="full", n=k)["ns"]
            return ns

        sizes = {
            (n, op): _calibrate(functools.partial(measure, n, op))
            for n in process_counts
            for op in ops
        }
        samples: dict[tuple[int, str], list[float]] = {key: [] for key in sizes}
        for r in range(rounds):
            order = process_counts if r % 2 == 0 else list(reversed(process_counts))
            for n in order:
                for op in ops:
                    k = sizes[n, op]
                    samples[n, op].append(measure(n, op, k) / k)
        for n, group in groups.items():
            granted = sum(a["waited"] for a in ask_all(group[1:], "waited")) + 32
            group[0].ask("release")  # the 32 are granted in turn and leave at once
            wait_all_waited(group[1:], granted)
            ask_all(group, "detach")
            out.append(RefusalResult(n, samples[n, "refuse"], samples.get((n, "refuse_core"), [])))
    return out


def _calibrate(run: Callable[[int], int], target_s: float = 0.1) -> int:
    n = 100
    while True:
        ns = run(n)
        if ns >= 20_000_000 or n >= 1_000_000:
            return max(100, int(target_s * 1e9 * n / ns))
        n *= 4


# --- close() with nothing running ------------------------------------------------------------
def run_close(cleanup: Cleanup, trials: int) -> list[float]:
    """Seconds ``Admission.close()`` takes right after one slot in and out (so the
    dispatcher has run), on a fresh attachment each time."""
    from handler_shim import Admission

    with cleanup.scope() as scope:
        segment, config = make_segment(scope, {"close": 4})
        out = []
        for _ in range(trials):
            adm = Admission.attach(config=config, generation="bench-close", segment=segment)
            with adm.slot_blocking("close"):
                pass
            time.sleep(0.05)
            t0 = time.perf_counter()
            adm.close()
            out.append(time.perf_counter() - t0)
        return out


# --- what import handler_shim adds, and an attach --------------------------------------------
IMPORT_PROBE = r"""
import sys, time
root, site, segment, mode = sys.argv[1:5]
if mode == "S":
    sys.path.insert(0, root)
    sys.path.append(site)
    import os  # site imports os (and stat, posixpath) in any normal start; not ours
def mem():
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Private_Clean", "Private_Dirty"):
                out[key] = int(rest.split()[0])
    return out["Private_Clean"] + out["Private_Dirty"], out["Rss"]
before = set(sys.modules)
u0, r0 = mem()
t0 = time.perf_counter()
import handler_shim
t1 = time.perf_counter()
u1, r1 = mem()
loaded = sorted(set(sys.modules) - before)
adm = handler_shim.Admission.attach(generation="bench-import", segment=segment)
with adm.slot_blocking("imp"):
    pass
u2, r2 = mem()
after_attach = sorted(set(sys.modules) - before - set(loaded))
adm.close()
import json
print(json.dumps({"import_s": t1 - t0, "uss_kib": u1 - u0, "rss_kib": r1 - r0,
                  "attach_uss_kib": u2 - u1, "attach_rss_kib": r2 - r1,
                  "modules": loaded, "attach_modules": after_attach}))
"""


@dataclass
class ImportResult:
    mode: str
    import_s: list[float] = field(default_factory=list)
    uss_kib: list[int] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)
    attach_uss_kib: list[int] = field(default_factory=list)
    attach_rss_kib: list[int] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    attach_modules: list[str] = field(default_factory=list)


def site_packages() -> str:
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def run_import(cleanup: Cleanup, trials: int) -> list[ImportResult]:
    """Fresh interpreters, round by round: ``python -S`` with the checkout and
    site-packages put on ``sys.path`` by hand (no ``.pth`` processed, so no editable-install
    finder: what a wheel install imports; its start-up modules are a fresh venv's), with
    bytecode caches as pip writes them at install (one discarded run writes them); the
    same with no bytecode cache to read (``-B``, an empty ``pycache_prefix``: every module
    compiled); and the venv's python as installed here (its editable finder, which loads
    pathlib, re and more at start, so they do not count against the import)."""
    with cleanup.scope() as scope:
        segment, _ = make_segment(scope, {"imp": 4})
        empty = scope.tempdir()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        modes = {
            "S": ["-S"],
            "S-nopyc": ["-S", "-B", "-X", f"pycache_prefix={empty}"],
            "venv": [],
        }
        results = {mode: ImportResult(mode) for mode in modes}

        def probe(mode: str) -> dict[str, Any]:
            done = subprocess.run(
                [sys.executable, *modes[mode], "-c", IMPORT_PROBE, ROOT, site_packages(),
                 segment, "venv" if mode == "venv" else "S"],
                capture_output=True,
                text=True,
                check=True,
                cwd="/",
                env=env,
            )  # fmt: skip
            answer: dict[str, Any] = json.loads(done.stdout)
            return answer

        for mode in modes:
            probe(mode)  # writes the bytecode caches where the mode reads them
        for _ in range(trials):
            for mode, r in results.items():
                m = probe(mode)
                r.import_s.append(m["import_s"])
                r.uss_kib.append(m["uss_kib"])
                r.rss_kib.append(m["rss_kib"])
                r.attach_uss_kib.append(m["attach_uss_kib"])
                r.attach_rss_kib.append(m["attach_rss_kib"])
                r.modules, r.attach_modules = m["modules"], m["attach_modules"]
        return list(results.values())


def importtime_top(n: int = 8) -> list[tuple[str, int]]:
    """The biggest self times of ``python -S -X importtime`` importing handler_shim."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.path.append(sys.argv[2]); "
        "import os; import handler_shim"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-X", "importtime", "-c", code, ROOT, site_packages()],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
        env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
    )
    rows = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _cum, name = (x.strip() for x in line[len("import time:") :].split("|"))
        rows.append((name.strip(), int(self_us)))
    return sorted(rows, key=lambda r: -r[1])[:n]
