"""The upgrade drill, run again and again, each failed run's evidence kept.

    python drill/repeat_drill.py --runs 20 --out DIR [--stress-cpu 2] [--long]

Runs ``drill/upgrade_drill.py --short --json`` (``--long``: the long form) ``--runs``
times, one after another, at normal priority (the load is the point). Each run's
summary goes to ``DIR/run-N.json`` and its timeline to ``DIR/run-N.err``; a failed
run's scratch directory (every process's whole log, the samples, the upstream's
events) is moved to ``DIR/run-N-evidence``. ``DIR/runs.txt`` gets a line a run: its
start and end, exit status, the load average (1, 5, 15 minutes) at its end, and its
problems. With ``--stress-cpu N`` it starts ``stress-ng --cpu N`` first, in a session
of its own, and stops it at the end, however the runs end. Exit 0 when every run passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN_TIMEOUT_S = 900.0  # a short run took 2-4 minutes at load 15-40


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@contextlib.contextmanager
def _stress(cpus: int) -> Iterator[None]:
    """``stress-ng --cpu cpus`` for as long as the block runs (nothing when 0)."""
    if not cpus:
        yield
        return
    proc = subprocess.Popen(
        ["stress-ng", "--cpu", str(cpus)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_once(n: int, out: Path, *, long: bool) -> tuple[int, dict[str, object] | None]:
    """Run ``n``: its exit status and its summary (None when it printed none)."""
    args = [sys.executable, str(HERE / "upgrade_drill.py"), "--json"]
    args += ["--evidence", str(out / f"run-{n}-evidence")]
    args += [] if long else ["--short"]
    with open(out / f"run-{n}.json", "wb") as so, open(out / f"run-{n}.err", "wb") as se:
        proc = subprocess.Popen(args, stdout=so, stderr=se, stdin=subprocess.DEVNULL)
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the drill cleans up what it started
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    lines = (out / f"run-{n}.json").read_text().strip().splitlines()
    try:
        return code, json.loads(lines[-1]) if lines else None
    except ValueError:
        return code, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True, help="where each run's output goes")
    ap.add_argument("--stress-cpu", type=int, default=0, help="stress-ng --cpu N beside them")
    ap.add_argument("--long", action="store_true", help="the long form, not the short one")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    table = args.out / "runs.txt"
    passed = 0
    with _stress(args.stress_cpu):
        for n in range(1, args.runs + 1):
            start = time.strftime("%H:%M:%S")
            code, summary = run_once(n, args.out, long=args.long)
            ok = code == 0 and summary is not None and summary.get("ok") is True
            passed += ok
            problems = "no summary" if summary is None else summary.get("problems")
            line = (
                f"run {n} start {start} end {time.strftime('%H:%M:%S')} rc {code} "
                f"{'OK' if ok else 'FAILED'} load {_load()} problems {problems}"
            )
            with open(table, "a") as f:
                print(line, file=f)
            print(line, flush=True)
    print(f"{passed} of {args.runs} passed", flush=True)
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
