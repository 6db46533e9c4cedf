"""The upgrade drill: one admission budget across real gateway generations.

    python drill/upgrade_drill.py [--short] [--plot PNG] [--json]

Real processes throughout, all on loopback: two simulated ten-slot workers,
the reference router in front of them, a fake upstream that counts the
completions in flight (``drill/fake_upstream.py``), the sidecar, and the
example gateway (``examples/openai_gateway.py``) under gunicorn with uvicorn
workers. The drill, in order:

1. **legacy**: the gateway without the middleware (``app_without_admission``)
   serves long requests; the sidecar starts with ``--await-legacy`` on that
   gunicorn master's pidfile, so the opted-in provider publishes
   ``legacy_drain`` (limit 0).
2. **drain**: generation A (the gateway with the middleware, 2 workers) starts
   under load: its requests queue (at most 32; the rest are answered 429) until
   the legacy master, sent SIGTERM, has finished its requests and exited. Then
   the discovered budget (20) applies.
3. **gen-A**: load; then a **sidecar upgrade** (a new sidecar fences the old
   one, which exits 0, R-G4); then a **router fence** of one worker (20 -> 10)
   with a burst of extra requests (overflow: 429), and its **unfence** (-> 20).
4. **HUP**: the gunicorn config now names generation B and the master gets
   ``SIGHUP``: B's workers start while A's finish the requests they hold.
5. **stop**: the load stops; every request ends; gunicorn, the sidecar, the
   router, the workers and the upstream are stopped; the segment is removed.

An observer samples ``availability --json`` (the same document, built in
process, 10 times a second, and the real CLI every few seconds) and the
upstream's counts. The invariants: the completions in flight at the upstream
never above the limit in force (R-A1; when the limit is lowered, requests
already running finish, so a count above the new limit may only go down),
waiting never above 32 (R-A2), overflow answered 429 with ``Retry-After``,
nothing lost (every request answered 200 with its whole stream, or 429; the
segment's admitted and rejected counters equal what the clients and the
upstream saw), and at the end running = waiting = 0 with no holder records
and no registered handler process. It prints a timeline and a summary, and
with ``--plot`` draws them (matplotlib PNG). Exit 0 when every invariant held.

This file is the scenario (:func:`upgrade`, its phases in order) and the command line.
What it stands on is beside it, one module a concern: ``drill_rig`` (the processes
and the timeline: :class:`drill_rig.Drill`), ``drill_observer`` (the samples),
``drill_load`` (the clients), ``drill_checks`` (the invariants), ``drill_plot`` (the
picture) and, below them all, ``drill_records`` (the samples and the outcomes).
Another scenario is another function like :func:`upgrade` over the same
:class:`drill_rig.Drill`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from drill_checks import final_checks
from drill_load import RELOAD_PHASE, burst, clients
from drill_observer import observe
from drill_plot import plot
from drill_records import GEN_A, GEN_B, DrillFailed, Sample
from drill_rig import Drill

from gateway_capacity.scenario import always_cleaned_up

__all__ = ["Drill", "Sample", "main", "upgrade"]


def upgrade(drill: Drill) -> None:
    """The upgrade, phase by phase: legacy, drain, gen-A, sidecar upgrade, router fence
    and unfence, HUP to gen-B, stop; then the final checks."""
    t = drill.timing
    drill.setup()
    drill.phase = "legacy"
    legacy_url = drill.start_gunicorn("legacy", "openai_gateway:app_without_admission", None)
    legacy_pidfile = drill.tmp / "legacy.pid"
    legacy_master = int(legacy_pidfile.read_text())
    legacy_load = clients(drill, t.legacy_clients, legacy_url, "legacy", 15, 25, drill.legacy_stop)
    drill.mark(f"legacy generation (no middleware) serving, master pid {legacy_master}")
    sidecar1 = drill.start_sidecar("sidecar-1", "--await-legacy", str(legacy_pidfile))
    drill.wait_for("legacy_drain", lambda: drill.source() == "legacy_drain", 30)
    threading.Thread(target=observe, args=(drill,), daemon=True).start()
    time.sleep(t.legacy_s)

    drill.phase = "drain"
    gen_url = drill.start_gunicorn("gateway", "openai_gateway:app", GEN_A)
    gen_master = int((drill.tmp / "gateway.pid").read_text())
    drill.mark(f"generation A up (master {gen_master}); its requests queue", "gen-A up")
    load = clients(drill, t.clients, gen_url, "new", 3, 10, drill.load_stop)
    time.sleep(t.drain_s)
    drill.legacy_stop.set()
    # Every legacy request already sent must be in the server before it stops
    # accepting: those are the active requests that finish during the drain.
    drill.wait_for("the legacy requests to reach the upstream", drill.legacy_arrived, 30)
    os.kill(legacy_master, signal.SIGTERM)
    drill.mark("legacy master sent SIGTERM: it finishes its requests, then exits", "legacy TERM")
    legacy_load.join(timeout=60)
    legacy = drill.procs["legacy"]
    drill.wait_for("the legacy master to exit", lambda: legacy.poll() is not None, 60)
    drill.mark("legacy master exited", "legacy exited")
    drill.wait_for("the discovered limit", lambda: drill.limit() == (20, "discovered"), 30)
    drill.figures["legacy_exit_to_budget_s"] = round(drill.now() - drill.marks[-1][0], 2)
    drill.phase = "gen-A"
    drill.mark("discovered budget in force: 20")
    time.sleep(t.gen_a_s)

    drill.phase = "sidecar upgrade"
    epoch = drill.epoch()
    sidecar2 = drill.start_sidecar("sidecar-2")
    drill.mark("new sidecar started", "sidecar upgrade")
    try:
        code = sidecar1.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise DrillFailed("the old sidecar did not retire within 30 s") from None
    drill.figures["old_sidecar_exit"] = code
    if code != 0:
        drill.problems.append(f"the fenced sidecar exited {code}, not 0 (R-G4)")
    new_epoch = drill.epoch()
    drill.mark(f"old sidecar fenced (writer epoch {epoch} -> {new_epoch}), exited {code}")
    time.sleep(t.sidecar_s)

    drill.phase = "fenced w2"
    seen = drill.router("fence", 10)
    drill.mark("router: w2 fenced, limit 10 first seen", "fence w2", at=seen)
    time.sleep(t.fence_s / 2)
    drill.mark(f"burst of {t.burst} extra requests (overflow)", "burst")
    burst(drill, gen_url, t.burst)
    time.sleep(t.fence_s / 2)
    drill.phase = "unfenced w2"
    seen = drill.router("unfence", 20)
    drill.mark("router: w2 unfenced, limit 20 first seen", "unfence w2", at=seen)
    time.sleep(t.unfence_s)

    drill.phase = RELOAD_PHASE
    (drill.tmp / "gateway.conf.py").write_text(f"raw_env = ['GATEWAY_GENERATION={GEN_B}']\n")
    os.kill(gen_master, signal.SIGHUP)
    drill.mark("gunicorn master sent SIGHUP with generation B in its config", "HUP (gen-B)")
    hup = drill.now()
    drill.wait_for("generation B's workers", lambda: drill.members(GEN_B) == 2, 60)
    drill.figures["hup_to_gen_b_attached_s"] = round(drill.now() - hup, 2)
    drill.mark("generation B's workers attached")
    drill.wait_for("generation A's workers to finish", lambda: drill.members(GEN_A) == 0, 90)
    drill.figures["hup_to_gen_a_detached_s"] = round(drill.now() - hup, 2)
    drill.mark("generation A's workers finished and detached")
    time.sleep(t.gen_b_s)

    drill.phase = "stop"
    drill.load_stop.set()
    drill.mark("load stopped: running requests finish", "load stops")
    load.join(timeout=120)
    drill.wait_for("running = waiting = 0", lambda: drill.counts() == (0, 0), 30)
    time.sleep(0.5)
    drill.stop_sampling.set()
    final_checks(drill, sidecar2)


def keep_evidence(drill: Drill, summary: dict[str, object], into: Path | None) -> Path:
    """A failed run's evidence, whole: its scratch directory (the logs of every process it
    started, the config), with the observer's samples, the marks and the summary written
    beside them (the upstream's events are there already, ``final_checks`` wrote them);
    moved to ``into`` when given. Its path."""
    (drill.tmp / "samples.json").write_text(
        json.dumps([dataclasses.astuple(s) for s in drill.samples])
    )
    (drill.tmp / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if into is None:
        return drill.tmp
    into.parent.mkdir(parents=True, exist_ok=True)
    return Path(shutil.move(drill.tmp, into))


def main() -> int:
    ap = argparse.ArgumentParser(description="The upgrade drill.")
    ap.add_argument("--short", action="store_true", help="the short form (make test)")
    ap.add_argument("--plot", type=Path, help="write the timeline as a PNG here")
    ap.add_argument(
        "--json", action="store_true", help="timeline on stderr, the summary as JSON on stdout"
    )
    ap.add_argument(
        "--evidence",
        type=Path,
        help="when the drill fails, move its scratch directory (every process's whole log, "
        "the samples, the upstream's events, the summary) here; by default it stays where "
        "it is, and its path is printed",
    )
    args = ap.parse_args()
    out = sys.stderr if args.json else sys.stdout
    drill = Drill(short=args.short, out=out)
    with always_cleaned_up(drill.cleanup, drill.problems) as ending:
        try:
            upgrade(drill)
        except DrillFailed as exc:
            drill.problems.append(str(exc))
    if args.plot and drill.samples:
        plot(drill, args.plot)
    summary = {
        "form": "short" if args.short else "long",
        "duration_s": round(drill.now(), 1),
        "marks": [[round(t, 1), text] for t, text, _ in drill.marks],
        **drill.figures,
        "cleaned_up": not ending.left,
        "problems": drill.problems,
        "ok": not drill.problems,
    }
    print("\nsummary", file=out)
    for key, value in summary.items():
        if key != "marks":
            print(f"  {key}: {value}", file=out)
    print("  result: " + ("OK" if summary["ok"] else "FAILED"), file=out)
    if summary["ok"]:
        shutil.rmtree(drill.tmp, ignore_errors=True)
    else:
        for name in ("sidecar-1", "sidecar-2", "gateway", "legacy"):
            tail = drill.log_of(name)[-1500:]
            if tail:
                print(f"\n--- {name} log (tail) ---\n{tail}", file=sys.stderr)
        kept = keep_evidence(drill, summary, args.evidence)
        print(f"\nevidence kept in {kept}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
