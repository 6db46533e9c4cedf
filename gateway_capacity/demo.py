"""``gateway-capacity demo``: two ten-slot workers advertise twenty (REQUIREMENTS.md section 11).

Everything runs on loopback from this package alone: two simulated
llama.cpp-style workers, the reference router in front of them, a temporary
config and 0600 key file, the sidecar with a short refresh, and handler load
from two generations sharing one segment. It shows the limit, running and
waiting live while one worker is drained and restored, checks what it saw,
and removes every process and shared-memory object it made.

At the end it draws what it showed (limit, advertised, running and waiting
over time) into a PNG when matplotlib is installed (the ``plot`` extra, which
``make demo`` installs) and prints where; without matplotlib it says so and
carries on. When its segment cannot be read, or the sidecar stops, it says why
and exits 1 at once instead of waiting in silence.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO

from gateway_capacity.scenario import always_cleaned_up
from gateway_capacity.schemas import SCHEMA_VERSION
from shm_layout.layout import Source

if TYPE_CHECKING:
    from capacity_router import RouterServer
    from capacity_router.simworker import SimWorker

PROVIDER = "local-inference"
MODEL = "workhorse"
# reads of the segment failing this long (once it was there) end the demo with the reason
READ_GRACE_S = 2.0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="self-contained demo: 20 advertised, one worker drained to 10, restored to 20",
    )
    p.add_argument("--fast", action="store_true", help="shorter phases (for tests)")
    p.add_argument(
        "--json", action="store_true", help="live lines on stderr, a JSON summary on stdout"
    )
    p.add_argument(
        "--png",
        metavar="PATH",
        help="where to draw the picture (default: a new gateway-capacity-demo-*.png in the "
        "temporary directory)",
    )
    p.set_defaults(func=run)


@dataclass
class Sample:
    t: float
    phase: str
    advertised: int | None
    limit: int
    source: str
    running: int
    waiting: int
    interactive: int = 0  # running requests of the interactive class (the classes phase)


@dataclass
class Phase:
    name: str
    action: str | None  # "fence" / "unfence" worker w2, "classes" (see below), or nothing
    expect: int
    seconds: float  # how long the phase holds once its expected limit is reached
    reached_s: float | None = None
    samples: list[Sample] = field(default_factory=list)

    def expect_index(self) -> int:
        """The first sample at the expected limit (all of them when none was: the phase
        then shows everything it saw)."""
        for i, s in enumerate(self.samples):
            if s.limit == self.expect:
                return i
        return 0


class Demo:
    def __init__(self, *, fast: bool, out: TextIO) -> None:
        self.fast = fast
        self.out = out
        self.tmp = Path(tempfile.mkdtemp(prefix="gwcap-demo-"))
        self.refresh = 0.3 if fast else 0.5
        self.clients = 14 if fast else 18
        self.hold = 3.0 if fast else 6.0
        self.started = time.monotonic()
        self.children: list[subprocess.Popen[str]] = []
        self.sidecar: subprocess.Popen[str] | None = None
        self.loads: list[subprocess.Popen[str]] = []
        self.workers: list[SimWorker] = []
        self.router: RouterServer | None = None
        self.segment = ""
        self.problems: list[str] = []
        self.seen_segment = False
        self.read_error: tuple[float, str] | None = None  # since (monotonic), why

    # --- set-up -----------------------------------------------------------------------
    def _say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:5.1f}s] {text}", file=self.out, flush=True)

    def setup(self) -> Path:
        from capacity_router.app import RouterServer
        from capacity_router.simworker import SimWorker
        from shm_layout.names import segment_name_for_config

        key_file = self.tmp / "router.key"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
        for _ in range(2):
            worker = SimWorker(slots=10)
            worker.start()
            self.workers.append(worker)
        registry = self.tmp / "workers.json"
        registry.write_text(
            json.dumps(
                {
                    "workers": [
                        {
                            "id": f"w{i + 1}",
                            "urls": [w.url],
                            "models": [MODEL],
                            "slots": {"source": "props"},
                        }
                        for i, w in enumerate(self.workers)
                    ]
                }
            )
        )
        router = self.router = RouterServer(registry, key_file, poll_interval=0.25)
        router.start()
        config = self.tmp / "gateway.json"
        config.write_text(
            json.dumps(
                {
                    "maxConcurrent": 4,
                    "providers": [
                        {
                            "id": PROVIDER,
                            "type": "chat-completions-api",
                            "baseUrl": f"{self.router.url}/v1",
                            "credentialFile": str(key_file),
                            "capacityDiscovery": True,
                            "models": {"local-workhorse": MODEL},
                        }
                    ],
                },
                indent=2,
            )
        )
        self.segment = segment_name_for_config(config)
        self._say(
            f"2 simulated workers (10 slots each), router {self.router.url}/v1/capacity, "
            f"segment {self.segment}"
        )
        return config

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[str]:
        log = open(self.tmp / log_name, "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        log.close()
        self.children.append(proc)
        return proc

    def start_processes(self, config: Path) -> None:
        parent = str(os.getpid())
        self.sidecar = self._spawn(
            [
                "-m",
                "gateway_capacity",
                "sidecar",
                "--config",
                str(config),
                "--segment",
                self.segment,
                "--refresh",
                str(self.refresh),
                "--parent-pid",
                parent,
            ],
            "sidecar.log",
        )
        self._say(f"sidecar pid {self.sidecar.pid}, refresh {self.refresh}s")
        if not self._wait_for_limit(20, timeout=20):
            raise DemoFailed("the sidecar did not publish 20 within 20 s (see its log above)")
        for generation in ("handler-1.0", "handler-2.0"):
            proc = self._spawn(
                [
                    "-m",
                    "gateway_capacity.demo_load",
                    "--config",
                    str(config),
                    "--segment",
                    self.segment,
                    "--generation",
                    generation,
                    "--provider",
                    PROVIDER,
                    "--clients",
                    str(self.clients),
                    "--stop-file",
                    str(self.tmp / "stop"),
                    "--parent-pid",
                    parent,
                    "--seed",
                    str(len(self.loads)),
                ],
                f"{generation}.log",
            )
            self.loads.append(proc)
        self._say(
            f"load: 2 handler generations x {self.clients} concurrent requests, one shared budget"
        )

    # --- observing ----------------------------------------------------------------------
    def _advertised(self) -> int | None:
        assert self.router is not None  # started before any phase runs
        snap = self.router.snapshot()
        if snap is None:
            return None
        for row in snap.models:
            if row.id == MODEL:
                return int(row.max_concurrent_requests)
        return 0

    def _sample(self, phase: str) -> Sample | None:
        from shm_layout.errors import SegmentError, SegmentMissing
        from shm_layout.view import read_view

        try:
            view = read_view(self.segment)
        except SegmentError as exc:
            if isinstance(exc, SegmentMissing) and not self.seen_segment:
                return None  # the sidecar is still starting: it creates the segment
            if self.read_error is None:
                self.read_error = (time.monotonic(), str(exc))
            return None
        self.seen_segment = True
        self.read_error = None
        p = view.provider(PROVIDER)
        if p is None:
            return None
        return Sample(
            time.monotonic() - self.started,
            phase,
            self._advertised(),
            p.effective_limit,
            p.source,
            p.running,
            p.waiting,
            next((c.running for c in p.classes if c.name == "interactive"), 0),
        )

    def _still_working(self) -> None:
        """Raise ``DemoFailed`` with the reason when the sidecar stopped or the segment
        has not been readable for ``READ_GRACE_S``: never wait in silence."""
        if self.sidecar is not None and self.sidecar.poll() is not None:
            last = self.sidecar_log().strip().splitlines()
            why = f": {last[-1]}" if last else ""
            raise DemoFailed(f"the sidecar exited with status {self.sidecar.returncode}{why}")
        if self.read_error is not None and time.monotonic() - self.read_error[0] >= READ_GRACE_S:
            raise DemoFailed(f"cannot read the segment {self.segment}: {self.read_error[1]}")

    def _wait_for_limit(self, expect: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._still_working()
            s = self._sample("start")
            if s is not None and s.limit == expect and s.source == Source.DISCOVERED:
                return True
            time.sleep(0.1)
        return False

    def enable_classes(self, config: Path) -> None:
        """The classes phase: the config gains an interactive class reserving 4 slots
        (batch, the default, is everything the load generations send); once the sidecar
        has written it, a third handler process sends interactive requests into the
        batch flood (docs/classes.md)."""
        doc = json.loads(config.read_text())
        doc["providers"][0]["classes"] = [
            {"name": "interactive", "reserve": INTERACTIVE_RESERVE},
            {"name": "batch"},
        ]
        doc["providers"][0]["defaultClass"] = "batch"
        config.write_text(json.dumps(doc, indent=2))
        from shm_layout.view import read_view

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self._still_working()
            p = read_view(self.segment).provider(PROVIDER)
            if p is not None and p.classes:
                break
            time.sleep(0.1)
        else:
            raise DemoFailed("the sidecar did not write the admission classes within 10 s")
        self._say(
            f"classes: interactive reserves {INTERACTIVE_RESERVE} slots; the load above is "
            "batch; a third process sends 2 interactive clients"
        )
        self.loads.append(
            self._spawn(
                [
                    "-m", "gateway_capacity.demo_load", "--config", str(config),
                    "--segment", self.segment, "--generation", "interactive",
                    "--provider", PROVIDER, "--clients", "2", "--cls", "interactive",
                    "--body", "0.2", "0.5", "--stop-file", str(self.tmp / "stop"),
                    "--parent-pid", str(os.getpid()), "--seed", "7",
                ],
                "interactive.log",
            )
        )  # fmt: skip

    def run_phase(self, phase: Phase, config: Path | None = None) -> None:
        if phase.action == "classes":
            assert config is not None
            self.enable_classes(config)
        elif phase.action is not None:
            getattr(self.router, phase.action)("w2")
        self._say(f"--- {phase.name} (expect {phase.expect}) ---")
        began = time.monotonic()
        last_line = 0.0
        until = began + 30.0  # generous bound to reach the expected limit
        while True:
            self._still_working()
            now = time.monotonic()
            s = self._sample(phase.name)
            if s is not None:
                phase.samples.append(s)
                if phase.reached_s is None and s.limit == phase.expect:
                    phase.reached_s = now - began
                    until = now + phase.seconds
                if now - last_line >= 0.5:
                    last_line = now
                    self._say(
                        f"advertised {s.advertised if s.advertised is not None else '-':>2}  "
                        f"limit {s.limit:>2} ({s.source})  running {s.running:>2}  "
                        f"waiting {s.waiting:>2}/32"
                        + (
                            f"  interactive running {s.interactive}"
                            if phase.action == "classes"
                            else ""
                        )
                    )
            if now >= until:
                break
            time.sleep(0.1)
        if phase.reached_s is None:
            self.problems.append(f"{phase.name}: the limit never reached {phase.expect}")

    def finish_load(self) -> list[dict[str, Any]]:
        (self.tmp / "stop").touch()
        self._say("stopping the load: no new requests; running ones finish")
        totals = []
        for proc in self.loads:
            out, _ = proc.communicate(timeout=30)
            if proc.returncode != 0:
                self.problems.append(f"a load process exited {proc.returncode}")
            with contextlib.suppress(ValueError, IndexError):
                totals.append(json.loads(out.strip().splitlines()[-1]))
        return totals

    # --- checking -----------------------------------------------------------------------
    def check(self, phases: list[Phase], totals: list[dict[str, Any]]) -> dict[str, Any]:
        from shm_layout.errors import SegmentError
        from shm_layout.view import read_view

        samples = [s for ph in phases for s in ph.samples]
        peak_waiting = max((s.waiting for s in samples), default=0)
        if peak_waiting > 32:
            self.problems.append(f"waiting reached {peak_waiting} > 32")
        # Above the limit in force, running may only go down (R-A1: lowering the limit
        # cancels nothing, and nothing new is admitted until running is below it).
        for prev, cur in itertools.pairwise(samples):
            if cur.running > cur.limit and cur.running > prev.running:
                self.problems.append(
                    f"running rose to {cur.running} above limit {cur.limit} at {cur.t:.1f}s"
                )
        try:
            view = read_view(self.segment)
        except SegmentError as exc:
            raise DemoFailed(f"cannot read the segment {self.segment}: {exc}") from None
        p = view.provider(PROVIDER)
        if p is None:
            raise DemoFailed(f"the segment {self.segment} has no provider {PROVIDER}")
        leftover = [h for h in view.holders]
        if p.running or p.waiting or p.stored_running or p.stored_waiting or leftover:
            self.problems.append(
                f"left behind: running {p.running}, waiting {p.waiting}, records {len(leftover)}"
            )
        if p.counters["peak_running"] > 20:
            self.problems.append(f"peak running {p.counters['peak_running']} > 20")
        for load in totals:
            if load.get("generation") == "interactive":
                if not load.get("admitted"):
                    self.problems.append("no interactive request was admitted")
                elif load.get("wait_p50_ms", 0) > INTERACTIVE_P50_MS:
                    self.problems.append(
                        f"interactive requests waited {load['wait_p50_ms']} ms (median) in the "
                        f"batch flood: more than {INTERACTIVE_P50_MS} ms"
                    )
        return {
            "phases": [phase_summary(ph) for ph in phases],
            "peak_running": p.counters["peak_running"],
            "peak_waiting": p.counters["peak_waiting"],
            "admitted": p.counters["admitted_total"],
            "rejected": p.counters["rejected_total"],
            "timeouts": p.counters["timeouts_total"],
            "final_running": p.running,
            "final_waiting": p.waiting,
            "holder_records_left": len(leftover),
        }

    # --- tear-down -------------------------------------------------------------------------
    def cleanup(self) -> list[str]:
        """Stop everything; returns what could not be cleaned (empty when all is gone)."""
        from shm_layout.segment import doorbells_of, objects_left, unlink_segment

        bells = doorbells_of(self.segment) if self.segment else []  # while registered
        (self.tmp / "stop").touch()
        if self.sidecar is not None and self.sidecar.poll() is None:
            self.sidecar.send_signal(signal.SIGTERM)
        for proc in self.children:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self.router is not None:
            self.router.stop()
        for worker in self.workers:
            worker.stop()
        if self.segment:
            unlink_segment(self.segment)
        left = objects_left(self.segment, bells) if self.segment else []
        left += [f"pid {c.pid}" for c in self.children if c.poll() is None]
        shutil.rmtree(self.tmp, ignore_errors=True)
        return left

    def sidecar_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.tmp / "sidecar.log").read_text()
        return ""


def phase_summary(ph: Phase) -> dict[str, Any]:
    """One phase's row: what held once its limit was reached, and apart from it the
    changeover before (the previous phase's limit still in force, its queue draining)."""
    reached = ph.expect_index()
    after, before = ph.samples[reached:], ph.samples[:reached]
    return {
        "name": ph.name,
        "expected_limit": ph.expect,
        "reached_after_s": None if ph.reached_s is None else round(ph.reached_s, 2),
        "limits_seen": sorted({s.limit for s in after}),
        "advertised_seen": sorted({s.advertised for s in ph.samples if s.advertised is not None}),
        "peak_running": max((s.running for s in after), default=0),
        "peak_waiting": max((s.waiting for s in after), default=0),
        "over_limit_running": max(
            (s.running for s in ph.samples if s.running > s.limit), default=0
        ),
        "changeover_limits_seen": sorted({s.limit for s in before}),
        "changeover_peak_running": max((s.running for s in before), default=0),
        "changeover_peak_waiting": max((s.waiting for s in before), default=0),
    }


def draw_picture(phases: list[Phase], png: str | None) -> tuple[str | None, str]:
    """Draw limit, advertised, running and waiting over time: (path or None, a line to say).

    ``png`` None: a new ``gateway-capacity-demo-*.png`` in the temporary directory.
    """
    samples = [s for ph in phases for s in ph.samples]
    if not samples:
        return None, "picture: not drawn: nothing was sampled"
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None, (
            "picture: not drawn: matplotlib is not installed "
            "(pip install 'gateway-capacity[plot]'; make demo installs it)"
        )
    if png is None:
        fd, png = tempfile.mkstemp(prefix="gateway-capacity-demo-", suffix=".png")
        os.close(fd)
    t = [s.t for s in samples]
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=100)
    # Running sits at the limit whenever the farm is full: the limit is a wide pale band
    # under the thin running line, so that both show where they meet.
    ax.step(
        t,
        [s.limit for s in samples],
        where="post",
        label="limit in force",
        lw=7,
        alpha=0.35,
        color=LIMIT_COLOR,
        zorder=1,
        solid_capstyle="butt",
    )
    ax.step(
        t,
        [s.advertised if s.advertised is not None else float("nan") for s in samples],
        where="post",
        label="advertised by the router",
        ls="--",
        lw=1.5,
        color=ADVERTISED_COLOR,
        zorder=4,
    )
    ax.plot(t, [s.running for s in samples], label="running", lw=1.5, color=RUNNING_COLOR, zorder=3)
    ax.plot(
        t,
        [s.waiting for s in samples],
        label="waiting (bound 32)",
        lw=1.5,
        color=WAITING_COLOR,
        zorder=2,
    )
    ax.plot(
        t,
        [s.interactive for s in samples],
        label=f"interactive running (reserve {INTERACTIVE_RESERVE})",
        lw=1.5,
        color=INTERACTIVE_COLOR,
        zorder=3,
    )
    for ph in phases:
        if ph.samples:
            ax.axvline(ph.samples[0].t, color="grey", lw=0.8, ls=":")
            ax.annotate(
                ph.name,
                (ph.samples[0].t, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -12),
                textcoords="offset points",
                fontsize=9,
                color="dimgrey",
            )
    ax.set_xlabel("seconds since the demo started")
    ax.set_ylabel("requests")
    ax.set_ylim(bottom=0, top=max(34, *(s.waiting + 2 for s in samples)))
    ax.set_title(
        "gateway-capacity demo: two 10-slot workers, w2 drained and restored, then "
        "interactive requests in a batch flood"
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower center", fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(png)
    except OSError as exc:
        return None, f"picture: not drawn: cannot write {png}: {exc.strerror or exc}"
    finally:
        plt.close(fig)
    return png, f"picture: {png} (limit, advertised, running and waiting over time)"


# one colour a series, lines and legend alike
LIMIT_COLOR: Final = "tab:blue"
RUNNING_COLOR: Final = "tab:green"
ADVERTISED_COLOR: Final = "tab:orange"
WAITING_COLOR: Final = "tab:red"
INTERACTIVE_COLOR: Final = "tab:purple"


class DemoFailed(Exception):
    pass


INTERACTIVE_RESERVE = 4  # slots the classes phase reserves for interactive requests
INTERACTIVE_P50_MS = 500  # "admitted at once": their median wait in the batch flood, at most


def run(args: argparse.Namespace) -> int:
    from gateway_capacity.common import require_router_extra

    require_router_extra("the demo (it runs the reference router)")
    out = sys.stderr if args.json else sys.stdout
    demo = Demo(fast=args.fast, out=out)
    summary: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
    phases: list[Phase] = []
    with always_cleaned_up(demo.cleanup, demo.problems) as ending:
        try:
            config = demo.setup()
            demo.start_processes(config)
            phases = [
                Phase("two workers", None, 20, demo.hold),
                Phase("w2 drained (fenced)", "fence", 10, demo.hold),
                Phase("w2 restored", "unfence", 20, demo.hold),
                Phase("batch flood + interactive", "classes", 20, demo.hold),
            ]
            for phase in phases:
                demo.run_phase(phase, config)
            summary["load"] = demo.finish_load()
            summary.update(demo.check(phases, summary["load"]))
        except DemoFailed as exc:
            demo.problems.append(str(exc))
            log = demo.sidecar_log().strip().splitlines()
            if log:
                print("the sidecar's last log lines:", file=sys.stderr)
                print("\n".join(f"  {line}" for line in log[-10:]), file=sys.stderr)
    summary["segment"] = demo.segment
    summary["picture"], picture_line = draw_picture(phases, args.png)
    summary["cleaned_up"] = not ending.left
    summary["problems"] = demo.problems
    summary["ok"] = not demo.problems
    _print_summary(summary, out)
    print(picture_line, file=out, flush=True)
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def _print_summary(summary: dict[str, Any], out: TextIO) -> None:
    print("\nsummary", file=out)
    phases = summary.get("phases", [])
    width = max([22, *(len(ph["name"]) for ph in phases)])
    if phases:
        print(
            "  per phase: what the router advertised -> the limit in force ([...]: every "
            "value seen in the phase)",
            file=out,
        )
    for ph in phases:
        print(
            f"  {ph['name']:<{width}} advertised {ph['advertised_seen']} -> limit "
            f"{ph['limits_seen']} "
            f"(reached {ph['expected_limit']} after {ph['reached_after_s']}s); peak running "
            f"{ph['peak_running']}, peak waiting {ph['peak_waiting']}",
            file=out,
        )
        if ph.get("changeover_limits_seen"):
            print(
                f"  {'':<{width}} until then limit {ph['changeover_limits_seen']}: peak running "
                f"{ph['changeover_peak_running']}, peak waiting {ph['changeover_peak_waiting']}",
                file=out,
            )
    if "admitted" in summary:
        print(
            f"  admitted {summary['admitted']}, queue-full {summary['rejected']}, timeouts "
            f"{summary['timeouts']}; peak running {summary['peak_running']} (at most the limit "
            f"in force when each was admitted), peak waiting {summary['peak_waiting']} (bound 32)",
            file=out,
        )
        rose = any(problem.startswith("running rose") for problem in summary.get("problems", []))
        for ph in summary.get("phases", []):
            if ph["over_limit_running"] and not rose:
                # check() saw running only fall while above the limit: nothing new came in
                print(
                    f"  {ph['name']}: running {ph['over_limit_running']} over the lowered "
                    f"limit {ph['expected_limit']} only while requests admitted before it "
                    "finished",
                    file=out,
                )
        for load in summary.get("load", []):
            waited = (
                f", median wait {load['wait_p50_ms']} ms (longest {load['wait_max_ms']} ms) "
                "beside the batch flood"
                if "wait_p50_ms" in load
                else ""
            )
            print(f"  {load['generation']}: {load['admitted']} requests admitted{waited}", file=out)
        print(
            f"  at the end: running {summary['final_running']}, waiting "
            f"{summary['final_waiting']}, holder records {summary['holder_records_left']}",
            file=out,
        )
    print(
        "  cleaned up: every process and shared-memory object"
        if summary["cleaned_up"]
        else "  NOT cleaned up",
        file=out,
    )
    for problem in summary["problems"]:
        print(f"  PROBLEM: {problem}", file=out)
    print("  result: " + ("OK" if summary["ok"] else "FAILED"), file=out)
