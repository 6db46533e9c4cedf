"""``make bench``: admission measured against what else one could use (REQUIREMENTS.md 10).

Usage: ``.venv/bin/python bench/run.py [--quick] [--only SECTION,...] [--out PATH]
[--plots DIR]``

Sections (all by default): ``micro`` (uncontended acquire+release, side by
side), ``handoff`` (cross-process release-to-running latency), ``throughput``
(contended slots/s, 1..16 processes, limit 4, empty slots), ``body`` (16 processes on
limit 4 with 1 ms bodies), ``switch`` (what one wake-up of another process costs here),
``recovery`` (a lock holder's SIGKILL to the next entry), ``idle`` (CPU and wake-ups of
one waiter in each of 32 and 128 processes, R-A7), ``sweep`` (how long the host's sweep
holds the lock, and how often, with 127 processes), ``queuefull`` (an arrival refused
with QueueFull, 2/17/127 processes), ``close`` (``Admission.close()`` with nothing
running), ``import`` (what ``import handler_shim`` and an attach add to a process),
``sidecar`` (RSS and CPU of ``gateway-capacity sidecar``), ``asgi``
(server CPU and latency a request pays for ``AdmissionMiddleware``; ``--asgi-before REF``
measures another revision's middleware beside it), ``retry`` (the openai SDK's retries
against a fixed and an estimated ``Retry-After``), ``proxy`` (what ``router serve``'s relay
adds per request and per streamed token, beside the same requests sent to the worker).
``--compare REF`` instead runs the micro figures (uncontended, hand-off, QueueFull) of
REF and of this checkout side by side, in interleaved rounds (bench_compare.py).
The table goes to stdout and to ``bench/results-latest.txt``; progress goes
to stderr. docs/benchmarks.md explains every figure.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench_common import (
    Cleanup,
    MachineMeter,
    fmt_ratio,
    fmt_us,
    loadavg,
    median,
    raise_on_sigterm,
    render_table,
)

SECTIONS = (
    "micro",
    "handoff",
    "throughput",
    "body",
    "switch",
    "recovery",
    "idle",
    "sweep",
    "queuefull",
    "close",
    "import",
    "sidecar",
    "sidecar-scale",
    "asgi",
    "retry",
    "proxy",
    "relay",
    "share",
    "classes",
    "tokens",
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
    idle_counts: tuple[int, ...] = (32, 128)
    idle_modes: tuple[str, ...] = ("blocking", "async")
    sweep_processes: int = 127
    sweep_s: float = 10.0
    refusal_counts: tuple[int, ...] = (2, 17, 127)
    close_trials: int = 20
    import_trials: int = 7
    switch_rounds: int = 5
    switch_trips: int = 20000
    body_rounds: int = 5
    body_s: float = 2.0
    proxy_rounds: int = 7
    proxy_requests: int = 100  # per kind and side in a round (short answers)
    proxy_streams: int = 30  # per side in a round (64-token streams)


FULL = Plan(7, 0.2, 250, 3, 2.0, 5.0, 10.0, 20, 1500, 0.5)
QUICK = Plan(
    3, 0.04, 60, 1, 0.5, 2.0, 4.0, 4, 500, 0.1, 1, 3.0, ((1, 1), (8, 4)),
    idle_counts=(32,), idle_modes=("blocking",), sweep_processes=9, sweep_s=1.0,
    refusal_counts=(2, 5), close_trials=3, import_trials=2, switch_rounds=1,
    switch_trips=5000, body_rounds=1, body_s=0.3, proxy_rounds=1, proxy_requests=20,
    proxy_streams=5,
)  # fmt: skip
BODY_S = 0.001  # the body of each slot in the ``body`` section
COMPARE: list[str] = []  # --compare REF: git refs measured beside this checkout
ASGI_BEFORE: list[str] = []  # --asgi-before REF: git refs whose middleware is measured too


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- sections: each returns its block of the report --------------------------------------
def _round_ratio(samples: dict[str, list[float]], top: str, bottom: str) -> float:
    """Median over rounds of one round's ``top`` time / the same round's ``bottom`` time."""
    if top not in samples or bottom not in samples:
        return float("nan")
    return median([a / b for a, b in zip(samples[top], samples[bottom], strict=True)])


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def section_micro(cleanup: Cleanup, plan: Plan) -> str:
    from bench_micro import run_micro

    results, notes = run_micro(
        cleanup, rounds=plan.micro_rounds, target_s=plan.micro_target_s, log=log
    )
    by_key = {r.key: median(r.per_op_ns) for r in results}
    samples = {r.key: r.per_op_ns for r in results}
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
        "rounds; /shim = time / slot_blocking time, /floor = time / the two-section floor's)"
    )
    blocking = _round_ratio(samples, "shim_blocking", "floor")
    in_async = _round_ratio(samples, "shim_async", "asyncio")
    flock = _round_ratio(samples, "flock", "shim_blocking")
    redis = _round_ratio(samples, "redis", "shim_blocking")
    targets = [
        "targets (median over rounds of each round's ratio):",
        f"  slot_blocking / two-section floor     {blocking:.2f}x  (target <= 1.5x: "
        f"{_verdict(blocking <= 1.5)})",
        f"  async slot() / asyncio.Semaphore      {in_async:.2f}x  (target <= 1.5x: "
        f"{_verdict(in_async <= 1.5)})",
        f"  flock counter / slot_blocking         {flock:.1f}x  (slot_blocking faster: "
        f"{_verdict(flock > 1)})",
    ]
    if redis == redis:
        targets.append(f"  Redis Lua semaphore / slot_blocking   {redis:.0f}x")
    return "\n".join([head, "", table, *notes, "", *targets])


def section_handoff(cleanup: Cleanup, plan: Plan) -> str:
    from bench_procs import run_handoff

    labels = {
        "shim": "shim slot_blocking, limit 1 (futex waiter)",
        "shim-async": "shim async slot(), limit 1 (doorbell)",
        "shim-file": "slot_blocking, lock-file kind (macOS path)",
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
    shim = results["shim"]
    target = (
        f"target (blocking waiter): p50 <= 25 us: {_verdict(shim.p50 <= 25_000)} "
        f"({fmt_us(shim.p50)}); p99 <= 250 us: {_verdict(shim.p99 <= 250_000)} "
        f"({fmt_us(shim.p99)}). The async waiter is informational."
    )
    lines = [head, "", table, "", target]
    if plan is FULL:
        lines += ["", *_handoff_by_hold(cleanup, plan)]
    return "\n".join(lines)


HOLDS_S = (0.002, 0.0005, 0.0002, 0.00005)


def _handoff_by_hold(cleanup: Cleanup, plan: Plan) -> list[str]:
    """How long the waiter slept decides how long it takes to wake: the same ping-pong
    with shorter holds (the gap after a release is a seventh of the hold)."""
    from bench_procs import run_handoff

    by_hold: dict[float, dict[str, float]] = {}
    for hold in HOLDS_S:
        log(f"hand-off: shim and sem with {hold * 1e3:g} ms holds")
        by_hold[hold] = {
            kind: run_handoff(cleanup, kind, plan.handoff_slots_each, hold, hold / 7).p50
            for kind in ("shim", "sem")
        }
    PLOT_DATA["handoff_by_hold"] = by_hold
    rows = [
        [
            f"{hold * 1e3:g}",
            fmt_us(p["shim"]),
            fmt_us(p["sem"]),
            fmt_us(p["shim"] - p["sem"]),
        ]
        for hold, p in by_hold.items()
    ]
    table = render_table(
        ["hold ms (the waiter sleeps as long)", "shim p50 us", "semaphore p50 us", "shim - sem us"],
        rows,
        right={0, 1, 2, 3},
    )
    return [
        "2b. Hand-off p50 by how long the waiter slept (the same ping-pong, shorter holds; a "
        "vCPU that idles longer wakes slower)",
        "",
        table,
    ]


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
            f"{median(runs['shim'][n].switches_per_slot):.2f}",
            f"{median(runs['shim'][n].cpu_us_per_slot):.1f}",
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
            "switches/slot",
            "CPU us/slot",
            "errors",
        ],
        rows,
        right=set(range(10)),
    )
    head = (
        f"3. Contended throughput, limit {CONTENDED_LIMIT}, empty slots, all processes together "
        f"(median of {plan.throughput_rounds} x {plan.throughput_s:g} s; floor = a posix_ipc "
        f"semaphore of value {CONTENDED_LIMIT}; switches/slot and CPU us/slot: the shim "
        "workers' context switches and CPU, every thread, from /proc, per slot)"
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


def section_body(cleanup: Cleanup, plan: Plan) -> str:
    from bench_procs import CONTENDED_LIMIT, run_throughput

    n = PROCESS_COUNTS[-1]
    runs = run_throughput(
        cleanup, ("shim", "sem"), (n,), plan.body_rounds, plan.body_s, log, body_s=BODY_S
    )
    ideal = CONTENDED_LIMIT / BODY_S
    labels = {"shim": "shim slot_blocking", "sem": "floor: posix_ipc semaphore (not FIFO)"}
    rows = []
    for kind, label in labels.items():
        r = runs[kind][n]
        rate, body = median(r.rates), median(r.body_us)
        rows.append(
            [
                label,
                f"{rate:,.0f}",
                f"{100 * rate / ideal:.1f} %",
                f"{body:.0f}",
                f"{100 * rate / (CONTENDED_LIMIT / (body / 1e6)):.1f} %",
                f"{median(r.switches_per_slot):.2f}",
                f"{median(r.cpu_us_per_slot):.1f}",
                str(len(r.errors)),
            ]
        )
    table = render_table(
        [
            f"{n} processes, limit {CONTENDED_LIMIT}, {BODY_S * 1e3:g} ms body",
            "slots/s",
            f"of {ideal:,.0f}",
            "body us",
            "of 4/body",
            "switches/slot",
            "CPU us/slot",
            "errors",
        ],
        rows,
        right=set(range(1, 8)),
    )
    rate = median(runs["shim"][n].rates)
    head = (
        f"3b. Throughput with real bodies: {n} processes on limit {CONTENDED_LIMIT}, each slot "
        f"sleeping {BODY_S * 1e3:g} ms inside (timer slack 1 ns), median of "
        f"{plan.body_rounds} interleaved rounds x {plan.body_s:g} s. 'body us' is the "
        "measured mean body; 'of 4/body' compares with the ideal for that body"
    )
    target = (
        f"target: >= 90 % of the ideal {ideal:,.0f} slots/s: "
        f"{_verdict(rate >= 0.9 * ideal)} ({100 * rate / ideal:.1f} %)"
    )
    notes = [f"error: {e}" for k in runs for e in sorted(set(runs[k][n].errors))]
    return "\n".join([head, "", table, *notes, "", target])


def section_switch(cleanup: Cleanup, plan: Plan) -> str:
    from bench_switch import run_switch

    log(f"switch: pipe ping-pong, {plan.switch_rounds} rounds")
    results = run_switch(cleanup, plan.switch_rounds, plan.switch_trips)
    rows = []
    for r in results:
        rows.append(
            [
                r.label,
                fmt_us(median(r.pinned_ns)) if r.pinned_ns else "-",
                fmt_us(median(r.pinned_ns) / 2) if r.pinned_ns else "-",
                fmt_us(median(r.free_ns)),
                fmt_us(median(r.free_ns) / 2),
            ]
        )
    table = render_table(
        [
            "pipe ping-pong between 2 processes",
            "round trip, 1 CPU",
            "per wake-up",
            "round trip, any CPU",
            "per wake-up",
        ],
        rows,
        right={1, 2, 3, 4},
    )
    head = (
        "3c. What one wake-up of a sleeping process costs here (us; median of "
        f"{plan.switch_rounds} rounds of {plan.switch_trips:,} round trips; '1 CPU' = both "
        "pinned to CPU 0 with taskset: a context switch each way)"
    )
    return "\n".join([head, "", table])


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
    from bench_host import run_idle

    results = run_idle(cleanup, plan.idle_counts, plan.idle_s, plan.idle_modes, log)
    rows = [
        [
            str(r.processes),
            "slot_blocking (futex)" if r.mode == "blocking" else "async slot() (doorbell)",
            f"{r.seconds:.1f}",
            f"{r.cpu_percent:.2f} %",
            f"{r.switches_per_s:.1f}",
            f"{r.doorbell_per_s:.1f}",
        ]
        for r in results
    ]
    table = render_table(
        [
            "processes",
            "one waiter each",
            "s",
            "CPU, all, of one core",
            "wake-ups/s per process",
            "doorbell posts/s",
        ],
        rows,
        right={0, 2, 3, 4, 5},
    )
    head = (
        "5. Idle waiters (R-A7): one waiting request in each of N processes (providers of "
        "limit 1 whose slot is held, 32 waiting each); CPU of every thread of the N "
        "processes from /proc schedstat; wake-ups = their threads' context switches; "
        "doorbell posts = Admission.wakeups (the dispatcher's doorbell posts)"
    )
    worst = max((r.cpu_percent for r in results if r.processes == 128), default=None)
    lines = [head, "", table]
    if worst is not None:
        lines += [
            "",
            f"target: 128 waiting processes under 2 % of a core: "
            f"{_verdict(worst < 2.0)} (at most {worst:.2f} %)",
        ]
    return "\n".join(lines)


def section_sweep(cleanup: Cleanup, plan: Plan) -> str:
    from bench_common import percentile
    from bench_host import run_sweep

    providers = min(64, (plan.sweep_processes + 1) // 2)  # 127: 64 hold, 63 wait
    r = run_sweep(cleanup, plan.sweep_processes, providers, plan.sweep_s, log)
    spaced, back = r.spaced_ns, r.back_to_back_ns
    rows = [
        ["one sweep every 50 ms", str(len(spaced)), fmt_us(median(spaced)),
         fmt_us(percentile(spaced, 90)), fmt_us(max(spaced))],
        ["back to back", str(len(back)), fmt_us(median(back)), fmt_us(percentile(back, 90)),
         fmt_us(max(back))],
    ]  # fmt: skip
    table = render_table(
        ["one sweep (Core.sweep: lock, sweep, unlock)", "sweeps", "median us", "p90 us", "max us"],
        rows,
        right={1, 2, 3, 4},
    )
    held = r.held_ms_per_s
    head = (
        f"5b. The host's sweep with {r.processes} registered processes on {r.providers} "
        f"providers (each holds a slot or waits for one): the host's own sweeps counted from "
        f"the header over {r.seconds:.1f} s, then sweeps timed by an unregistered process"
    )
    return "\n".join(
        [
            head,
            "",
            f"the host swept {r.sweeps_per_s:.2f} times a second (sweep_mono changes); the "
            f"lock was taken {r.lock_entries_per_s:.2f} times a second in all (lock_seq)",
            "",
            table,
            "",
            f"lock held by sweeps: {r.sweeps_per_s:.2f}/s x {fmt_us(median(spaced))} us = "
            f"{held:.3f} ms per second; target under 1 ms per second: {_verdict(held < 1.0)}",
        ]
    )


def section_queuefull(cleanup: Cleanup, plan: Plan) -> str:
    from bench_host import run_refusals

    results = run_refusals(cleanup, plan.refusal_counts, plan.micro_rounds, log)
    rows = [
        [str(r.processes), fmt_us(median(r.user_ns)), fmt_us(min(r.user_ns)),
         fmt_us(median(r.core_ns)) if r.core_ns else "-"]
        for r in results
    ]  # fmt: skip
    table = render_table(
        ["processes attached", "QueueFull raised+caught us", "best us", "core step alone us"],
        rows,
        right={0, 1, 2, 3},
    )
    head = (
        "5c. An arrival refused with QueueFull (limit 1 held, 32 waiting spread over the other "
        f"processes; median of {plan.micro_rounds} rounds of about 0.1 s; 'core step' = "
        "Core.arrive returning FULL, no exception)"
    )
    worst = max(median(r.user_ns) for r in results)
    spread = worst / min(median(r.user_ns) for r in results)
    target = (
        f"target: <= 5 us, flat: {_verdict(worst <= 5000 and spread < 1.3)} (at most "
        f"{fmt_us(worst)} us; largest / smallest {spread:.2f}x)"
    )
    return "\n".join([head, "", table, "", target])


def section_close(cleanup: Cleanup, plan: Plan) -> str:
    from bench_host import run_close

    log(f"close: {plan.close_trials} attach, one slot, close()")
    times = run_close(cleanup, plan.close_trials)
    return "\n".join(
        [
            "5d. Admission.close() with nothing running (a fresh attachment, one slot in and "
            "out, 50 ms, then close())",
            "",
            f"{len(times)} closes: median {1e3 * median(times):.2f} ms, max "
            f"{1e3 * max(times):.2f} ms; target <= 10 ms: {_verdict(max(times) <= 0.010)}",
        ]
    )


def section_import(cleanup: Cleanup, plan: Plan) -> str:
    from bench_host import importtime_top, run_import

    log(f"import: {plan.import_trials} fresh interpreters of each kind")
    results = run_import(cleanup, plan.import_trials)
    labels = {
        "S": "python -S, checkout + site-packages on sys.path (as a wheel install)",
        "S-nopyc": "  the same with no bytecode cache (every module compiled)",
        "venv": "this venv's python (the editable finder loaded re, pathlib at start)",
    }
    rows = []
    for r in results:
        rows.append(
            [
                labels[r.mode],
                f"{1e3 * median(r.import_s):.1f}",
                f"{median(r.uss_kib) / 1024:.2f}",
                f"{median(r.rss_kib) / 1024:.2f}",
                str(len(r.modules)),
                f"{median(r.attach_uss_kib) / 1024:.2f}",
                f"{median(r.attach_rss_kib) / 1024:.2f}",
            ]
        )
    table = render_table(
        [
            "fresh interpreter",
            "import ms",
            "USS MiB",
            "RSS MiB",
            "modules",
            "attach USS MiB",
            "attach RSS MiB",
        ],
        rows,
        right=set(range(1, 7)),
    )
    main = next(r for r in results if r.mode == "S")
    top = ", ".join(f"{name} {us / 1e3:.1f}" for name, us in importtime_top())
    head = (
        "5e. What import handler_shim adds to a process (median of "
        f"{plan.import_trials} fresh interpreters each; USS = Private_Clean + Private_Dirty "
        "of /proc/self/smaps_rollup, after minus before; attach = Admission.attach(segment=) "
        "of an existing segment and one slot, after minus after the import)"
    )
    uss, ms = median(main.uss_kib) / 1024, 1e3 * median(main.import_s)
    return "\n".join(
        [
            head,
            "",
            table,
            "",
            f"target (python -S row): <= 3 MiB USS: {_verdict(uss <= 3.0)} ({uss:.2f}); "
            f"<= 60 ms: {_verdict(ms <= 60)} ({ms:.1f})",
            f"largest self times (python -S -X importtime, ms): {top}",
            f"loaded by the import: {' '.join(main.modules)}",
            f"loaded by the attach: {' '.join(main.attach_modules)}",
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


def section_proxy(cleanup: Cleanup, plan: Plan) -> str:
    from bench_proxy import proxy_table_rows, run_proxy_cost

    log(f"proxy: router serve in front of simworker --openai, {plan.proxy_rounds} rounds")
    result = run_proxy_cost(
        cleanup, plan.proxy_rounds, plan.proxy_requests, plan.proxy_streams, log
    )
    table = render_table(
        ["request", "direct p50 us", "via router p50 us", "adds at p50", "adds at p10",
         "router CPU us"],
        proxy_table_rows(result, fmt_us),
        right={1, 2, 3, 4, 5},
    )  # fmt: skip
    head = (
        "9. The router's relay: the same chat completions straight to a simulated worker "
        "(router simworker --openai --delay 0) and through router serve in front of it, one "
        f"at a time from httpx on loopback; {plan.proxy_rounds} interleaved rounds x "
        f"{plan.proxy_requests} requests ({plan.proxy_streams} for the 64-token streams); "
        "p50: median of per-round medians; adds at p50 (p10): median of per-round "
        "differences of the medians (10th percentiles, less disturbed by a busy machine); "
        "router CPU: its schedstat (all threads) per request, or per token for the slope"
    )
    return "\n".join([head, "", table])


def section_relay(cleanup: Cleanup, plan: Plan) -> str:
    from bench_relay import relay_tables, run_relay

    log("relay: router serve and nginx side by side, the stream ladder at 40 tok/s")
    result = run_relay(cleanup, log, quick=plan is QUICK)
    head = (
        "9b. The relay at a farm's load, beside nginx (bench/bench_relay.py): one keep-alive "
        "HTTP/1.1 upstream, streamed tokens 25 ms apart, router serve and nginx (one worker, "
        "upstream keepalive, proxy_buffering off) in front of it, rungs interleaved; proxy "
        "CPU from schedstat of every thread of every process"
    )
    return "\n".join([head, "", relay_tables(result)])


def section_share(cleanup: Cleanup, plan: Plan) -> str:
    from bench_redis import RedisUnavailable
    from bench_share import LEASE_S, THEIR_TTL_S, run_share

    head = (
        "10. Share mode (docs/share.md): three gateways, one 6-slot farm, one redis-server; "
        f"lease {LEASE_S:g} s, beside a per-request Redis semaphore in LiteLLM's style "
        "(sorted set of slot ids with a TTL)"
    )
    iterations = 20_000 if plan is QUICK else 200_000
    try:
        r = run_share(cleanup, log, iterations)
    except RedisUnavailable as exc:
        log(f"share: {exc}")
        return "\n".join([head, "", f"share: not measured ({exc})"])
    table = render_table(
        ["", "share mode", "per-request Redis semaphore"],
        [
            [
                "per request (acquire+release)",
                f"{fmt_us(r.share_ns)} us (local mode {fmt_us(r.local_ns)} us)",
                f"{fmt_us(r.zset_ns)} us",
            ],
            [
                "a crashed gateway's capacity lost for",
                f"{r.ours_lost_s:.2f} s (lease {LEASE_S:g} s)",
                f"{r.theirs_lost_s:.2f} s with a {THEIR_TTL_S:g} s TTL (LiteLLM: 3600 s)",
            ],
            ["a demand shift moves capacity in", f"{r.shift_s:.2f} s", "at once (per request)"],
            [
                "Redis operations per second per gateway",
                f"{r.ops_idle:.1f} idle, {r.ops_busy:.1f} while demand moves",
                "2 per request",
            ],
        ],
        right=set(),
    )
    return "\n".join([head, "", table])


def section_classes(cleanup: Cleanup, plan: Plan) -> str:
    from bench_classes import BATCH_BODY_S, BATCH_PROCESSES, LIMIT, run_classes, summary

    seconds = 1.5 if plan is QUICK else 6.0
    result = run_classes(cleanup, plan.micro_rounds, seconds, log)
    labels = {
        "fifo": "slot_blocking, no classes",
        "classes": "slot_blocking, two classes",
        "redis": "per-request Redis Lua semaphore",
    }
    base = median(result.cost_ns["fifo"])
    rows = [
        [labels[k], fmt_us(median(v)), fmt_us(min(v)), fmt_ratio(median(v) / base)]
        for k, v in result.cost_ns.items()
        if v
    ]
    cost = render_table(["acquire+release, uncontended", "median us", "best us", "/no classes"],
                        rows, right={1, 2, 3})  # fmt: skip
    waits = [
        [{"classes": "ours, interactive reserve 1", "fifo": "ours, one FIFO",
          "redis": "per-request Redis semaphore"}[k],
         str(len(v)), *(f"{x:.1f}" for x in summary(v))]
        for k, v in result.waits_ms.items()
    ]  # fmt: skip
    wait = render_table(["interactive request", "samples", "p50 ms", "p99 ms", "max ms"],
                        waits, right={1, 2, 3, 4})  # fmt: skip
    head = (
        f"14. Admission classes: the slot's cost (median of {plan.micro_rounds} rounds), and the "
        f"wait of an interactive request while {BATCH_PROCESSES} processes flood batch slots "
        f"({BATCH_BODY_S * 1000:g} ms bodies) on a limit of {LIMIT}"
    )
    return "\n".join([head, "", cost, "", wait])


def section_tokens(cleanup: Cleanup, plan: Plan) -> str:
    from bench_tokens import (
        BASE,
        CALLGRIND_OPS,
        CHARGE,
        LABELS,
        run_callgrind,
        run_tokens,
        unsupported,
    )

    head = (
        f"15. Admission in tokens: a request charged {CHARGE} tokens against a published "
        f"token budget beside the same admission in slots alone, uncontended acquire+release "
        f"(median of {plan.micro_rounds} interleaved rounds; target: within 1.5x)"
    )
    why = unsupported()
    if why is not None:
        return f"{head}\n\n  not measured: {why}"
    cost = run_tokens(cleanup, plan.micro_rounds, 2000 if plan is QUICK else 20000, log)
    rows = []
    for key, values in cost.items():
        ratio = median(values) / median(cost[BASE[key]])
        mark = "" if BASE[key] == key else f" ({_verdict(ratio <= 1.5)})"
        rows.append(
            [LABELS[key], fmt_us(median(values)), fmt_us(min(values)), fmt_ratio(ratio) + mark]
        )
    table = render_table(
        ["acquire+release, uncontended", "median us", "best us", "/uncharged"],
        rows,
        right={1, 2, 3},
    )
    counts = run_callgrind(cleanup, log)
    if isinstance(counts, str):
        return "\n".join([head, "", table, "", f"  instructions: not counted ({counts})"])
    rows = []
    for key, value in counts.items():
        ratio = value / counts[BASE[key]]
        mark = "" if BASE[key] == key else f" ({_verdict(ratio <= 1.5)})"
        rows.append([LABELS[key], f"{value:,.0f}", fmt_ratio(ratio) + mark])
    instructions = render_table(
        [
            f"instructions per acquire+release (callgrind, {CALLGRIND_OPS[1]} less "
            f"{CALLGRIND_OPS[0]} of them, over the difference)",
            "instructions",
            "/uncharged",
        ],
        rows,
        right={1, 2},
    )
    return "\n".join([head, "", table, "", instructions])


def compare_report(cleanup: Cleanup, plan: Plan) -> str:
    """``--compare REF``: REF(s) and this checkout side by side (bench_compare.py)."""
    from bench_common import percentile
    from bench_compare import prepare_tree, run_compare, this_checkout

    sides = [prepare_tree(cleanup, ref, log) for ref in COMPARE]
    sides.append(this_checkout())
    counts = (2, 17) if plan is not QUICK else (2,)
    rounds = plan.micro_rounds
    handoff_rounds = 3 if plan is FULL else 1
    run_compare(
        cleanup,
        sides,
        rounds=rounds,
        target_s=plan.micro_target_s,
        handoff_rounds=handoff_rounds,
        handoff_slots=plan.handoff_slots_each // handoff_rounds + 1,
        refusal_counts=counts,
        log=log,
    )

    def ratio(side: Any, top: str, bottom: str) -> float:
        pairs = zip(side.per_op[top], side.per_op[bottom], strict=True)
        return median([a / b for a, b in pairs])

    def refusal(n: int, side: Any) -> str:
        return fmt_us(median(side.refusal_ns[n]))

    def row(label: str, cell: Callable[[Any], str]) -> list[str]:
        return [label, *(cell(side) for side in sides)]

    rows = [
        row("slot_blocking acquire+release us",
            lambda s: fmt_us(median(s.per_op["shim_blocking"]))),
        row("  / two-section floor (target <= 1.5x)",
            lambda s: fmt_ratio(ratio(s, "shim_blocking", "floor2"))),
        row("async slot() acquire+release us", lambda s: fmt_us(median(s.per_op["shim_async"]))),
        row("  / asyncio.Semaphore (target <= 1.5x)",
            lambda s: fmt_ratio(ratio(s, "shim_async", "asyncio"))),
        row("two-section floor us", lambda s: fmt_us(median(s.per_op["floor2"]))),
        row("asyncio.Semaphore us", lambda s: fmt_us(median(s.per_op["asyncio"]))),
        row("hand-off p50 us (blocking waiter)", lambda s: fmt_us(percentile(s.handoff_ns, 50))),
        row("hand-off p99 us", lambda s: fmt_us(percentile(s.handoff_ns, 99))),
        row("hand-offs", lambda s: str(len(s.handoff_ns))),
        row("hand-off p50 us (async waiter)",
            lambda s: fmt_us(percentile(s.handoff_async_ns, 50))),
        row("hand-off p99 us (async waiter)",
            lambda s: fmt_us(percentile(s.handoff_async_ns, 99))),
        row("hand-off max us (async waiter)", lambda s: fmt_us(max(s.handoff_async_ns))),
        *(
            row(f"QueueFull refusal us, {n} processes", functools.partial(refusal, n))
            for n in counts
        ),
    ]  # fmt: skip
    table = render_table(["figure", *(s.label for s in sides)], rows, right=set(range(1, 9)))
    head = (
        f"Revisions side by side ({rounds} interleaved rounds of the uncontended cases, "
        f"{handoff_rounds} of the hand-off, {rounds} of each QueueFull count; medians; ratios "
        "are medians of each round's ratio, within one side's worker)"
    )
    trees = [f"{s.label}: {s.source}" for s in sides]
    return "\n".join([head, "", table, "", *trees])


RUNNERS: dict[str, Callable[[Cleanup, Plan], str]] = {
    "micro": section_micro,
    "handoff": section_handoff,
    "throughput": section_throughput,
    "body": section_body,
    "switch": section_switch,
    "recovery": section_recovery,
    "idle": section_idle,
    "sweep": section_sweep,
    "queuefull": section_queuefull,
    "close": section_close,
    "import": section_import,
    "sidecar": section_sidecar,
    "sidecar-scale": section_sidecar_scale,
    "asgi": section_asgi,
    "retry": section_retry,
    "proxy": section_proxy,
    "relay": section_relay,
    "share": section_share,
    "classes": section_classes,
    "tokens": section_tokens,
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
    by_hold = PLOT_DATA.get("handoff_by_hold")
    if isinstance(by_hold, dict):
        fig, ax = plt.subplots(figsize=(7, 4))
        holds = sorted(by_hold)
        for kind, label in (("shim", "shim slot_blocking"), ("sem", "posix_ipc semaphore")):
            ax.plot(
                [h * 1e3 for h in holds],
                [by_hold[h][kind] / 1e3 for h in holds],
                marker="o",
                label=label,
            )
        ax.axhline(25, color="grey", linestyle="--", linewidth=1, label="target p50 25 us")
        ax.set_xscale("log")
        ax.set_xlabel("how long the waiter slept: the holder's hold (ms)")
        ax.set_ylabel("hand-off p50 (us)")
        ax.set_ylim(bottom=0)
        ax.set_title("Hand-off latency by sleep length")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(directory, "bench-handoff-by-hold.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


QUIET_MAX_WAIT_S = 1800.0
QUIET_ATTEMPTS = 4  # --wait-quiet: a section others disturbed is measured again, this often


def wait_quiet(share: float, section: str) -> bool:
    """Wait until others use less than ``share`` of the cores; False if they never did."""
    deadline = time.monotonic() + QUIET_MAX_WAIT_S
    while True:
        busy = MachineMeter.others_share()
        if busy < share:
            return True
        if time.monotonic() > deadline:
            return False
        log(f"{section}: others use {100 * busy:.0f} % of the cores; waiting for quiet")
        time.sleep(10)


def revision() -> str:
    """The checkout's commit, and whether tracked files differ from it."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=os.path.dirname(HERE), capture_output=True, text=True
        ).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return sha + (" with uncommitted changes" if dirty else "")


def banner(quick: bool) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"gateway-capacity benchmark, {'quick' if quick else 'full'} run, {now}\n"
        f"command: {' '.join(['bench/run.py', *sys.argv[1:]])}; commit {revision()}\n"
        f"nproc {os.cpu_count()}, {platform.machine()}, Linux {platform.release()}, "
        f"Python {platform.python_version()}, load average at start {loadavg()}\n"
        "us = microseconds; every figure below is from this one run; each section ends with "
        "the load average (1, 5, 15 min) at its start and end"
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
    parser.add_argument(
        "--wait-quiet",
        metavar="PERCENT",
        type=float,
        help="before each section, wait until everyone else uses less than PERCENT of the "
        "cores (3 s samples of /proc/stat while the benchmark rests; at most 30 min), and "
        "measure a section again (up to 4 times in all) when they used more meanwhile",
    )
    parser.add_argument(
        "--compare",
        metavar="REF",
        action="append",
        default=[],
        help="instead of the sections: the micro figures of REF and of this checkout side "
        "by side (repeatable)",
    )
    args = parser.parse_args(argv)
    ASGI_BEFORE[:] = args.asgi_before
    COMPARE[:] = args.compare
    chosen = SECTIONS if not args.only else tuple(s.strip() for s in args.only.split(","))
    unknown = [s for s in chosen if s not in RUNNERS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    plan = QUICK if args.quick else FULL

    raise_on_sigterm()
    blocks = [banner(args.quick)]
    started = time.monotonic()
    failed = []
    runners = RUNNERS
    if COMPARE:
        chosen, runners = ("compare",), {"compare": compare_report}
    for name in chosen:
        attempts = 1 if args.wait_quiet is None else QUIET_ATTEMPTS
        for attempt in range(1, attempts + 1):
            if args.wait_quiet is not None and not wait_quiet(args.wait_quiet / 100, name):
                log(f"{name}: others kept the machine busy {QUIET_MAX_WAIT_S / 60:.0f} min")
            cleanup = Cleanup()  # each section leaves nothing behind for the next
            load_before, meter = loadavg(), MachineMeter().start()
            try:
                block = runners[name](cleanup, plan)
                cleanup.run()  # every worker reaped, so that its CPU is counted as ours
                line, share = meter.measure()
            except KeyboardInterrupt:
                log("interrupted; cleaning up")
                return 130
            except Exception as exc:  # report it, and still measure the other sections
                log(f"{name}: failed: {type(exc).__name__}: {exc}")
                blocks.append(f"{name}: FAILED ({type(exc).__name__}: {exc})")
                failed.append(name)
                break
            finally:
                cleanup.run()
            busy = args.wait_quiet is not None and share >= args.wait_quiet / 100
            if busy and attempt < attempts:
                log(f"{name}: others used {100 * share:.0f} % of the cores meanwhile; again")
                continue
            tries = f"; attempt {attempt} of {attempts}" if attempts > 1 else ""
            blocks.append(
                f"{block}\n(load average: {load_before} at start, {loadavg()} at end; "
                f"{line}{tries})"
            )
            break
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
