"""``make bench``: admission measured against what else one could use (REQUIREMENTS.md 10).

Usage: ``.venv/bin/python bench/run.py [--quick] [--only SECTION,...] [--out PATH]
[--plots DIR]``

Sections (all by default): ``micro`` (uncontended acquire+release, side by
side), ``handoff`` (cross-process release-to-running latency), ``throughput``
(contended slots/s, 1..16 processes, limit 4), ``recovery`` (a lock holder's
SIGKILL to the next entry), ``idle`` (CPU of 32 blocked
waiters, R-A7), ``sidecar`` (RSS and CPU of ``gateway-capacity sidecar``), ``asgi``
(server CPU and latency a request pays for ``AdmissionMiddleware``; ``--asgi-before REF``
measures another revision's middleware beside it), ``retry`` (the openai SDK's retries
against a fixed and an estimated ``Retry-After``).
The table goes to stdout and to ``bench/results-latest.txt``; progress goes
to stderr. docs/benchmarks.md explains every figure.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench_common import (
    Cleanup,
    fmt_ratio,
    fmt_us,
    median,
    raise_on_sigterm,
    render_table,
)

SECTIONS = (
    "micro",
    "handoff",
    "throughput",
    "recovery",
    "idle",
    "sidecar",
    "sidecar-scale",
    "asgi",
    "retry",
)
PLOT_DATA: dict[str, object] = {}  # what the plots draw, filled by the sections
HERE = os.path.dirname(os.path.abspath(__file__))
PROCESS_COUNTS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Plan:
    micro_rounds: int
    micro_target_s: float
    handoff_slots_each: int
    throughput_rounds: int
    throughput_s: float
    idle_s: float
    sidecar_s: float
    asgi_rounds: int
    asgi_requests: int
    retry_delay_s: float  # how long the fake upstream takes for one completion
    scale_rounds: int = 3
    scale_s: float = 10.0
    scales: tuple[tuple[int, int], ...] = ((1, 1), (8, 4), (32, 4), (64, 1), (64, 4))


FULL = Plan(7, 0.2, 250, 3, 2.0, 5.0, 10.0, 20, 1500, 0.5)
QUICK = Plan(3, 0.04, 60, 1, 0.5, 2.0, 4.0, 4, 500, 0.1, 1, 3.0, ((1, 1), (8, 4)))
ASGI_BEFORE: list[str] = []  # --asgi-before REF: git refs whose middleware is measured too


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- sections: each returns its block of the report --------------------------------------
def section_micro(cleanup: Cleanup, plan: Plan) -> str:
    from bench_micro import run_micro

    results, notes = run_micro(
        cleanup, rounds=plan.micro_rounds, target_s=plan.micro_target_s, log=log
    )
    by_key = {r.key: median(r.per_op_ns) for r in results}
    shim = by_key.get("shim_blocking", float("nan"))
    floor = by_key.get("floor", float("nan"))
    rows = []
    for r in results:
        m = median(r.per_op_ns)
        rows.append(
            [
                r.label,
                fmt_us(m),
                fmt_us(min(r.per_op_ns)),
                f"{1e9 / m:,.0f}",
                fmt_ratio(m / shim),
                fmt_ratio(m / floor),
            ]
        )
    table = render_table(
        ["acquire+release, uncontended", "median us", "best us", "per s", "/shim", "/floor"],
        rows,
        right={1, 2, 3, 4, 5},
    )
    head = (
        f"1. Uncontended acquire+release, one thread (median of {plan.micro_rounds} interleaved "
        "rounds; /shim = time / slot_blocking time, /floor = time / floor time)"
    )
    return "\n".join([head, "", table, *notes])


def section_handoff(cleanup: Cleanup, plan: Plan) -> str:
    from bench_procs import run_handoff

    labels = {
        "shim": "shim slot_blocking, limit 1",
        "shim-file": "the same, lock-file kind (macOS path)",
        "sem": "floor: posix_ipc semaphore, value 1",
        "flock": "fcntl.flock mutex",
    }
    results = {}
    for kind in labels:
        log(f"hand-off: {kind}, 2 processes x {plan.handoff_slots_each} slots")
        results[kind] = run_handoff(cleanup, kind, plan.handoff_slots_each)
    PLOT_DATA["handoff"] = {labels[k]: r.latencies_ns for k, r in results.items()}
    floor_p50 = results["sem"].p50
    rows = [
        [
            labels[k],
            str(len(r.latencies_ns)),
            fmt_us(r.p50),
            fmt_us(r.p99),
            fmt_us(max(r.latencies_ns)),
            fmt_ratio(r.p50 / floor_p50),
        ]
        for k, r in results.items()
    ]
    table = render_table(
        [
            "release in A -> waiter in B running",
            "hand-offs",
            "p50 us",
            "p99 us",
            "max us",
            "p50/floor",
        ],
        rows,
        right={1, 2, 3, 4, 5},
    )
    head = (
        "2. Cross-process hand-off latency (2 spawned processes ping-pong one slot, each held "
        "2 ms; time.monotonic_ns across processes)"
    )
    return "\n".join([head, "", table])


def section_throughput(cleanup: Cleanup, plan: Plan) -> str:
    from bench_procs import CONTENDED_LIMIT, run_throughput

    runs = run_throughput(
        cleanup,
        ("shim", "shim-file", "sem"),
        PROCESS_COUNTS,
        plan.throughput_rounds,
        plan.throughput_s,
        log,
    )
    rates = {kind: {n: median(r.rates) for n, r in by_n.items()} for kind, by_n in runs.items()}
    PLOT_DATA["throughput"] = rates
    base = rates["shim"][PROCESS_COUNTS[0]]
    rows = [
        [
            str(n),
            f"{rates['shim'][n]:,.0f}",
            f"{rates['shim-file'][n]:,.0f}",
            f"{rates['sem'][n]:,.0f}",
            fmt_ratio(rates["shim"][n] / rates["sem"][n]),
            fmt_ratio(rates["shim"][n] / base),
            _percent(runs["shim"][n].queued),
            str(sum(len(runs[k][n].errors) for k in runs)),
        ]
        for n in PROCESS_COUNTS
    ]
    table = render_table(
        [
            "processes",
            "shim slots/s",
            "lock-file kind",
            "floor slots/s",
            "shim/floor",
            "shim vs 1 proc",
            "shim queued",
            "errors",
        ],
        rows,
        right={0, 1, 2, 3, 4, 5, 6, 7},
    )
    head = (
        f"3. Contended throughput, limit {CONTENDED_LIMIT}, empty slots, all processes together "
        f"(median of {plan.throughput_rounds} x {plan.throughput_s:g} s; floor = a posix_ipc "
        f"semaphore of value {CONTENDED_LIMIT})"
    )
    errors = sorted(
        {
            f"{kind}, {n} processes: {e}"
            for kind in runs
            for n in runs[kind]
            for e in runs[kind][n].errors
        }
    )
    notes = [f"error: {e}" for e in errors]
    return "\n".join([head, "", table, *notes])


def section_recovery(cleanup: Cleanup, plan: Plan) -> str:
    from bench_procs import run_recovery

    trials = max(3, plan.micro_rounds + 3)
    rows = []
    for kind, label in (("shim", "robust mutex (Linux)"), ("shim-file", "lock file (macOS path)")):
        log(f"recovery: {kind}, {trials} kills of a lock holder")
        times = run_recovery(cleanup, kind, trials)
        if not times:
            rows.append([label, "0", "-", "-"])
            continue
        rows.append(
            [label, str(len(times)), f"{1e3 * median(times):.2f}", f"{1e3 * max(times):.2f}"]
        )
    table = render_table(["lock kind", "kills", "median ms", "max ms"], rows, right={1, 2, 3})
    head = (
        "4. A lock holder's death: SIGKILL of a process frozen inside a section (counters "
        "half written) to the entry of a process already waiting for the lock, repair "
        "included (R-A6)"
    )
    return "\n".join([head, "", table])


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f} %"


def section_idle(cleanup: Cleanup, plan: Plan) -> str:
    from bench_procs import run_idle

    log(f"idle: 4 processes x 8 threads blocked for {plan.idle_s:g}s")
    r = run_idle(cleanup, processes=4, threads=8, seconds=plan.idle_s)
    verdict = "meets R-A7 (< 2 %)" if r.cpu_percent < 2.0 else "ABOVE R-A7's 2 %"
    return "\n".join(
        [
            "5. Idle waiters (R-A7)",
            "",
            f"{r.waiters} waiters (4 processes x 8 threads) blocked {r.seconds:.1f} s: "
            f"{r.cpu_percent:.2f} % of one core in total, {verdict}; "
            f"{r.wakeups_per_s:.1f} dispatcher wake-ups/s per process (R-A7 allows 10)",
        ]
    )


def section_sidecar(cleanup: Cleanup, plan: Plan) -> str:
    from bench_sidecar import run_sidecar, sidecar_available

    head = "6. Sidecar footprint (one loopback provider, --refresh 1)"
    if not sidecar_available():
        log("sidecar: command missing")
        return "\n".join([head, "", "sidecar: not measured (command missing)"])
    log(f"sidecar: {plan.sidecar_s:g}s against a loopback capacity server")
    r = run_sidecar(cleanup, plan.sidecar_s)
    published = "none" if r.published is None else str(r.published)
    return "\n".join(
        [
            head,
            "",
            f"over {r.seconds:.1f} s: RSS {r.rss_mib:.1f} MiB (peak {r.peak_rss_mib:.1f} MiB), "
            f"CPU {r.cpu_percent:.2f} % of one core, {r.probes} probes answered, "
            f"published limit {published}",
        ]
    )


def section_sidecar_scale(cleanup: Cleanup, plan: Plan) -> str:
    from bench_sidecar import replicas_possible, run_costs, run_scale, scale_report

    head = (
        "7. The sidecar as the work grows (providers x replicas, --refresh 1, keep-alive "
        f"loopback farm; medians of {plan.scale_rounds} rounds of {plan.scale_s:g} s)"
    )
    results, skipped = [], []
    for providers, replicas in plan.scales:
        if replicas > 1 and not replicas_possible():
            skipped.append(f"{providers}x{replicas}")
            continue
        log(f"sidecar-scale: {providers} x {replicas}")
        results.append(run_scale(cleanup, providers, replicas, plan.scale_s, plan.scale_rounds))
    costs = run_costs(cleanup)
    lines = [head, "", *scale_report(results, costs)]
    if skipped:
        missing = ", ".join(skipped)
        lines.append(f"not measured (needs root and unshare for a hosts file): {missing}")
    return "\n".join(lines)


def section_asgi(cleanup: Cleanup, plan: Plan) -> str:
    import subprocess

    from bench_asgi import CONCURRENCY, cost_table_rows, run_asgi_cost

    files: dict[str, str | None] = {}
    for ref in ASGI_BEFORE:
        directory = cleanup.tempdir()
        path = os.path.join(directory, "asgi_before.py")
        source = subprocess.run(
            ["git", "show", f"{ref}:handler_shim/asgi.py"],
            cwd=os.path.dirname(HERE),
            capture_output=True,
            check=True,
        ).stdout
        with open(path, "wb") as f:
            f.write(source)
        files[f"middleware at {ref}"] = path
    files["middleware (this checkout)"] = None
    log(f"asgi: {len(files) + 1} uvicorn servers, {plan.asgi_rounds} interleaved rounds")
    result = run_asgi_cost(cleanup, plan.asgi_rounds, plan.asgi_requests, files, log)
    table = render_table(
        ["trivial app under uvicorn", "CPU us/req", "added", "p50 us", "p50 vs plain", "p99 us"],
        cost_table_rows(result),
        right={1, 2, 3, 4, 5},
    )
    head = (
        f"7. The ASGI middleware's cost (server CPU per request from /proc schedstat, all "
        f"threads; {CONCURRENCY} keep-alive loopback connection(s), one request at a time; "
        f"{plan.asgi_rounds} interleaved rounds x {plan.asgi_requests} requests, medians; "
        "added and p50 vs plain: medians of per-round differences with the plain app; "
        "every request admitted at once). Target: at most +20 us, p50 within 5 %"
    )
    return "\n".join([head, "", table])


def section_retry(cleanup: Cleanup, plan: Plan) -> str:
    from bench_asgi import run_sdk_retry

    rows = []
    for fixed in (1, None):
        log(f"retry: 80 openai SDK completions, Retry-After {fixed or 'estimated'}")
        r = run_sdk_retry(cleanup, fixed, delay=plan.retry_delay_s)
        rows.append(
            [
                r.label,
                str(r.ok),
                str(r.failed),
                str(r.answered_429),
                str(r.extra_429),
                f"{r.seconds:.1f}",
                ",".join(map(str, r.retry_after_seen)) or "-",
            ]
        )
    table = render_table(
        ["Retry-After", "ok", "failed", "429s", "to retries", "total s", "values"],
        rows,
        right={1, 2, 3, 4, 5},
    )
    head = (
        "8. Retry hints: 80 concurrent completions from the openai SDK (default retries, "
        "which honour Retry-After) through examples/openai_gateway.py, limit 4, a fake "
        f"upstream of {plan.retry_delay_s:g} s a completion"
    )
    return "\n".join([head, "", table])


RUNNERS: dict[str, Callable[[Cleanup, Plan], str]] = {
    "micro": section_micro,
    "handoff": section_handoff,
    "throughput": section_throughput,
    "recovery": section_recovery,
    "idle": section_idle,
    "sidecar": section_sidecar,
    "sidecar-scale": section_sidecar_scale,


    "asgi": section_asgi,
    "retry": section_retry,
}


def draw_plots(directory: str) -> list[str]:
    """Throughput by process count and hand-off latency, as PNGs; returns the paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plots: matplotlib is not installed (the plot extra); no plots drawn")
        return []
    written = []
    rates = PLOT_DATA.get("throughput")
    if isinstance(rates, dict):
        fig, ax = plt.subplots(figsize=(7, 4))
        names = {"shim": "shim (robust mutex)", "shim-file": "shim (lock file)", "sem": "floor"}
        for kind, by_n in rates.items():
            ns = sorted(by_n)
            ax.plot(ns, [by_n[n] for n in ns], marker="o", label=names.get(kind, kind))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("processes")
        ax.set_ylabel("slots / s (limit 4, empty slots)")
        ax.set_title("Contended throughput")
        ax.legend()
        fig.tight_layout()
        path = os.path.join(directory, "bench-throughput.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    handoff = PLOT_DATA.get("handoff")
    if isinstance(handoff, dict):
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, lat in handoff.items():
            xs = sorted(x / 1e3 for x in lat)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ax.set_xscale("log")
        ax.set_xlabel("release in A to waiter in B running (us)")
        ax.set_ylabel("share of hand-offs")
        ax.set_title("Cross-process hand-off latency (cumulative)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(directory, "bench-handoff.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def banner(quick: bool) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"gateway-capacity benchmark, {'quick' if quick else 'full'} run, {now}\n"
        f"nproc {os.cpu_count()}, {platform.machine()}, Linux {platform.release()}, "
        f"Python {platform.python_version()}, load average at start {load}\n"
        "us = microseconds; every figure below is from this one run"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="gateway-capacity admission measured side by side with the alternatives "
        "(REQUIREMENTS.md section 10); see docs/benchmarks.md"
    )
    parser.add_argument("--quick", action="store_true", help="short smoke run (< 60 s)")
    parser.add_argument(
        "--only", metavar="SECTION,...", help=f"run only these sections of {','.join(SECTIONS)}"
    )
    parser.add_argument(
        "--out",
        default=os.path.join(HERE, "results-latest.txt"),
        metavar="PATH",
        help="where to write the table too (default bench/results-latest.txt)",
    )
    parser.add_argument(
        "--plots", metavar="DIR", help="also draw the throughput and hand-off plots into DIR"
    )
    parser.add_argument(
        "--asgi-before",
        metavar="REF",
        action="append",
        default=[],
        help="asgi section: also measure handler_shim/asgi.py as of this git ref",
    )
    args = parser.parse_args(argv)
    ASGI_BEFORE[:] = args.asgi_before
    chosen = SECTIONS if not args.only else tuple(s.strip() for s in args.only.split(","))
    unknown = [s for s in chosen if s not in RUNNERS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    plan = QUICK if args.quick else FULL

    raise_on_sigterm()
    blocks = [banner(args.quick)]
    started = time.monotonic()
    failed = []
    for name in chosen:
        cleanup = Cleanup()  # each section leaves nothing behind for the next
        try:
            blocks.append(RUNNERS[name](cleanup, plan))
        except KeyboardInterrupt:
            log("interrupted; cleaning up")
            return 130
        except Exception as exc:  # report it, and still measure the other sections
            log(f"{name}: failed: {type(exc).__name__}: {exc}")
            blocks.append(f"{name}: FAILED ({type(exc).__name__}: {exc})")
            failed.append(name)
        finally:
            cleanup.run()
    blocks.append(f"(run took {time.monotonic() - started:.0f} s)")
    report = "\n\n".join(blocks) + "\n"
    sys.stdout.write(report)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(report)
    log(f"written to {os.path.relpath(args.out)}")
    if args.plots:
        for path in draw_plots(args.plots):
            log(f"plot: {os.path.relpath(path)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
