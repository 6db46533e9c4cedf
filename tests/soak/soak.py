"""The chaos soak: real processes, real kills, one budget.

    .venv/bin/python tests/soak/soak.py [--seconds 240] [--workers 12] [--hammers 2]
        [--seed N] [--json REPORT]

Runs, on loopback and a fresh segment: the sidecar (``gateway-capacity sidecar``);
a capacity router whose answers flip between valid, incomplete, invalid, stale,
future, slow, failing, redirecting and oversized; an upstream server that counts
the requests in flight; and handler processes of two generations (``gen-A``, then
``gen-B``) doing short and long requests through ``Admission.slot`` and
``slot_blocking`` (``soak_worker.py``). Meanwhile it SIGKILLs random workers
(some aimed at the moment one holds the segment lock), SIGKILLs and restarts the
sidecar, and edits the config (limits, discovery toggled, a broken edit).

What is checked, and how it is observed honestly across processes:

* **R-A1 at the upstream.** Each request carries when its slot was asked for
  and when it was entered. The latest-admitted request in flight was admitted
  while every other request in flight was already running, so at every arrival
  ``in flight <= the limit in force at some instant of [asked, entered]`` of one
  of the requests in flight. The limit in force is sampled from the segment every
  few ms (its published and fallback values; the larger of the two, clamped as
  the ledger clamps, so expiry never makes the check stricter than the product).
  A request is counted in flight from its arrival until the upstream answers
  (it stops counting *before* answering, so a released slot is never still
  counted) or until its client process is dead (a socket closed by the kernel,
  or a pid that is gone or a zombie: only then may its slot be reclaimed).
* **R-A1 in the segment.** At every observation, the RUNNING records (dead
  owners included: the ledger counts them until reaped) are at most the limit
  in force at some instant between the newest record's admission and the
  observation.
* **R-A2**: waiting never above the queue bound (32), stored or live.
* **Counters are derived**: in every consistent copy taken while no repair is
  pending, the stored running/waiting equal the RUNNING/WAITING records.
* **At the end** (through ``gateway-capacity inspect --json``, as an operator):
  running = waiting = 0, no holder records, nothing in flight; every worker
  that ended cleanly had each request it entered answered by the upstream; no
  worker saw any error other than ``QueueFull``/``AdmissionTimeout``.

It prints a report (operations, kills by what the victim was doing, lock
recoveries, reclaim time, bad answers served, sidecar restarts, config edits,
anything lost) and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import json
import os
import random
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


from gwtest import start_sidecar  # noqa: E402
from soak_sampler import record_format  # noqa: E402
from soak_worker import ARRIVING, RUNNING, STATE_SIZE, read_state  # noqa: E402

from handler_shim import Admission  # noqa: E402
from shm_layout import rows  # noqa: E402
from shm_layout.layout import (  # noqa: E402
    HEADER,
    HOLDER,
    HOLDER_RUNNING,
    HOLDER_WAITING,
    PROVIDER,
    PROVIDER_COUNTERS,
)
from shm_layout.segment import map_readonly, unlink_segment  # noqa: E402
from shm_layout.view import parse_view, snapshot_bytes  # noqa: E402

EXE = str(Path(sys.executable).with_name("gateway-capacity"))
PROVIDERS = ("p1", "p2")
QUEUE_BOUND = 32
SAMPLE_S = 0.005  # limit sampling period
SLACK_S = 0.05  # added on both sides of an admission window when looking up the limit
OBSERVE_S = 0.05


def _pid_dead(pid: int) -> bool:
    """Gone or a zombie: its sockets are closed and its slots may be reclaimed (psutil:
    the same answer on Linux and macOS)."""
    import psutil

    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


# --- the limit in force, over time ---------------------------------------------------------
def lock_holder_pid(segment: str, header: Any) -> int | None:
    """The pid of the process holding the segment lock now, or None (observation only).

    Robust-mutex kind: the mutex word holds the owner thread's id (glibc, Linux);
    /proc maps it to its process. Lock-file kind: F_GETLK names the holder.
    """
    import fcntl
    import struct

    from shm_layout import layout as lay
    from shm_layout import lock as lk

    if HEADER["lock_kind"].get(header) == lay.LOCK_ROBUST:
        tid = struct.unpack_from("<I", header, lay.MUTEX_OFFSET)[0] & 0x3FFFFFFF
        if not tid:
            return None
        try:
            with open(f"/proc/{tid}/status") as f:
                for line in f:
                    if line.startswith("Tgid:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None
    try:
        fd = os.open(lk.lock_file_path(segment), os.O_RDONLY)
    except OSError:
        return None
    try:  # (this soak process holds no lock on that file, so closing it costs nothing)
        got = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 1, 0))
    finally:
        os.close(fd)
    kind, _, _, _, pid = struct.unpack("hhqqi4x", got)
    return pid if kind != fcntl.F_UNLCK else None


class LimitTimeline:
    """The limits in force over time, as ``soak_sampler.py`` (its own process) samples them.

    A lookup over an interval is honest only when the samples around it are dense:
    where two neighbouring samples are more than ``MAX_GAP_S`` apart (the sampler was
    descheduled), a change could hide between them and :meth:`bound` answers None
    (the check is counted as unverifiable, not as passed).
    """

    MAX_GAP_S = 0.1

    def __init__(self, segment: str, indexes: dict[str, int], path: Path, understate: int) -> None:
        self.names = list(indexes)
        self.indexes = indexes
        self.rec = record_format(len(indexes))
        self.path = path
        path.write_bytes(b"")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("soak_sampler.py")),
                segment,
                str(path),
                str(SAMPLE_S),
                *(str(indexes[n]) for n in self.names),
                "--understate",
                str(understate),
            ],
        )
        self.f = open(path, "rb")  # noqa: SIM115 (read incrementally for the whole run)
        self.times: list[float] = []
        self.values: list[dict[str, int]] = []
        self._lock = threading.Lock()

    def _catch_up(self) -> None:
        data = self.f.read()
        whole = len(data) - len(data) % self.rec.size
        self.f.seek(whole - len(data), os.SEEK_CUR)
        for t, *vals in self.rec.iter_unpack(data[:whole]):
            self.times.append(t)
            self.values.append(dict(zip(self.names, vals, strict=True)))

    def wait_first(self) -> None:
        deadline = time.monotonic() + 30
        while not self.times and time.monotonic() < deadline:
            with self._lock:
                self._catch_up()
            time.sleep(0.01)

    def bound(self, provider: str, start: float, end: float) -> int | None:
        """The highest limit in force at any instant of [start, end]; None if unknowable."""
        with self._lock:
            self._catch_up()
            lo = bisect.bisect_left(self.times, start - SLACK_S) - 1
            hi = bisect.bisect_right(self.times, end + SLACK_S) + 1
            if lo < 0 or hi > len(self.times):
                return None  # no sample yet after the interval (or none before it)
            window = self.times[lo:hi]
            if any(b - a > self.MAX_GAP_S for a, b in itertools.pairwise(window)):
                return None
            return max(v[provider] for v in self.values[lo:hi])

    def sample_count(self) -> int:
        with self._lock:
            self._catch_up()
            return len(self.times)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.f.close()


# --- the upstream: counts requests in flight ------------------------------------------------
@dataclass
class InFlight:
    pid: int
    asked: float
    entered: float


@dataclass(frozen=True)
class Claim:
    """``count`` slots were held at ``at``; the newest admission among them happened inside
    one of ``windows`` (which one is not known), so the limit in force then allowed it."""

    what: str
    provider: str
    count: int
    at: float
    windows: tuple[tuple[float, float], ...]


class Checker:
    """Verifies claims once the limit samples cover their windows (R-A1)."""

    def __init__(self, timeline: LimitTimeline) -> None:
        self.timeline = timeline
        self.pending: list[Claim] = []
        self.lock = threading.Lock()
        self.verified: Counter[str] = Counter()
        self.unverifiable: Counter[str] = Counter()
        self.violations: list[str] = []  # the first 50
        self.violation_count = 0
        self.diagnostics: list[dict[str, Any]] = []

    def claim(self, claim: Claim) -> None:
        with self.lock:
            self.pending.append(claim)

    def verify(self, final: bool = False) -> None:
        with self.lock:
            claims, self.pending = self.pending, []
        keep = []
        horizon = time.time() - 2 * SLACK_S - LimitTimeline.MAX_GAP_S
        for c in claims:
            if not final and max(e for _, e in c.windows) > horizon:
                keep.append(c)  # its samples may not be written yet
                continue
            bounds = [self.timeline.bound(c.provider, a, b) for a, b in c.windows]
            known = [b for b in bounds if b is not None]
            if known and max(known) >= c.count:
                self.verified[c.what] += 1
            elif None in bounds:
                self.unverifiable[c.what] += 1
            else:
                self.violation_count += 1
                if len(self.violations) >= 50:
                    continue
                self.violations.append(
                    f"R-A1: {c.provider}: {c.count} {c.what} at t={c.at:.3f}, but the limit "
                    f"in force was at most {max(known)}"
                )
                if len(self.diagnostics) < 5:
                    self.diagnostics.append(self.explain(c))
        with self.lock:
            self.pending[:0] = keep

    def explain(self, c: Claim) -> dict[str, Any]:
        """What the checker saw at a violation: the windows and the limit samples around them."""
        tl = self.timeline
        first = min(a for a, _ in c.windows)
        with tl._lock:
            lo = max(bisect.bisect_left(tl.times, first - 1.0), 0)
            hi = bisect.bisect_right(tl.times, c.at + 0.5)
            samples = [
                (round(t, 3), v[c.provider])
                for t, v in zip(tl.times[lo:hi], tl.values[lo:hi], strict=True)
            ]
        changes = [s for i, s in enumerate(samples) if i == 0 or s[1] != samples[i - 1][1]]
        gaps = [round(b[0] - a[0], 3) for a, b in itertools.pairwise(samples)]
        return {
            "claim": c.what,
            "provider": c.provider,
            "count": c.count,
            "at": round(c.at, 3),
            "windows": [(round(a, 3), round(b, 3)) for a, b in c.windows],
            "limit_changes": changes,
            "largest_sample_gap_s": max(gaps, default=None),
        }


@dataclass
class Upstream:
    checker: Checker
    inflight: dict[str, dict[int, InFlight]] = field(
        default_factory=lambda: {p: {} for p in PROVIDERS}
    )
    lock: threading.Lock = field(default_factory=threading.Lock)
    arrived: Counter[str] = field(default_factory=Counter)
    completed: Counter[str] = field(default_factory=Counter)
    by_pid: Counter[int] = field(default_factory=Counter)
    client_gone: int = 0
    peak: Counter[str] = field(default_factory=Counter)
    next_id: int = 0

    def arrive(self, provider: str, pid: int, asked: float, entered: float) -> int:
        with self.lock:
            table = self.inflight[provider]
            for rid in [r for r, f in table.items() if _pid_dead(f.pid)]:
                del table[rid]
            self.next_id += 1
            rid = self.next_id
            table[rid] = InFlight(pid, asked, entered)
            self.arrived[provider] += 1
            self.peak[provider] = max(self.peak[provider], len(table))
            claim = Claim(
                "requests in flight at the upstream",
                provider,
                len(table),
                time.time(),
                tuple((f.asked, f.entered) for f in table.values()),
            )
        self.checker.claim(claim)
        return rid

    def leave(self, provider: str, rid: int, pid: int, answered: bool) -> None:
        with self.lock:
            self.inflight[provider].pop(rid, None)
            if answered:
                self.completed[provider] += 1
                self.by_pid[pid] += 1
            else:
                self.client_gone += 1

    def in_flight_live(self) -> int:
        with self.lock:
            return sum(
                1 for t in self.inflight.values() for f in t.values() if not _pid_dead(f.pid)
            )


def start_upstream(upstream: Upstream) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            q = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
            provider, pid = q["provider"], int(q["pid"])
            rid = upstream.arrive(provider, pid, float(q["asked"]), float(q["entered"]))
            deadline = time.monotonic() + int(q["hold_ms"]) / 1000
            sock = self.connection
            while (remaining := deadline - time.monotonic()) > 0:
                ready, _, _ = select.select([sock], [], [], remaining)
                if ready and not sock.recv(1, socket.MSG_PEEK):
                    upstream.leave(provider, rid, pid, answered=False)  # the client died
                    return
            upstream.leave(provider, rid, pid, answered=True)  # before answering: see above
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 256

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a killed client leaves a reset connection: expected

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    ).start()
    return server


# --- the capacity router: answers flip ------------------------------------------------------
def _snapshot(
    models: Any, complete: bool = True, observed: float | None = None, **extra: Any
) -> bytes:
    doc = {
        "object": "inference_capacity",
        "version": 1,
        "complete": complete,
        "observed_at": time.time() if observed is None else observed,
        "models": models,
        **extra,
    }
    return json.dumps(doc).encode()


def _row(n: Any, model: str = "workhorse") -> list[dict[str, Any]]:
    return [{"id": model, "max_concurrent_requests": n}]


INVALID_BODIES: dict[str, Any] = {
    "not JSON": lambda: b"{not json",
    "JSON array": lambda: b"[]",
    "wrong object": lambda: _snapshot(_row(5)).replace(b"inference_capacity", b"capacity"),
    "version 2": lambda: _snapshot(_row(5)).replace(b'"version": 1', b'"version": 2'),
    "count is a bool": lambda: _snapshot(_row(True)),
    "count is a float": lambda: _snapshot(_row(5.0)),
    "count is a string": lambda: _snapshot(_row("5")),
    "count negative": lambda: _snapshot(_row(-1)),
    "count 4097": lambda: _snapshot(_row(4097)),
    "duplicate model id": lambda: _snapshot(_row(5) + _row(6)),
    "129 rows": lambda: _snapshot(
        [{"id": f"m{i}", "max_concurrent_requests": 1} for i in range(129)]
    ),
    "observed_at NaN": lambda: _snapshot(_row(5)).replace(
        b'"observed_at": ', b'"observed_at": NaN, "x": '
    ),
    "observed_at a string": lambda: _snapshot(_row(5), observed="now"),  # type: ignore[arg-type]
    "complete missing": lambda: json.dumps(
        {
            "object": "inference_capacity",
            "version": 1,
            "observed_at": time.time(),
            "models": _row(5),
        }
    ).encode(),
    "body over 64 KiB": lambda: _snapshot(_row(5), padding="x" * 70_000),
    "not UTF-8": lambda: b'{"object": "\xff\xfe"}',
}


class ChaosRouter:
    """Serves ``GET /v1/capacity`` with the bearer check; ``flip()`` picks the next answer."""

    KINDS = (
        "valid",
        "valid",
        "valid",
        "incomplete",
        "invalid",
        "stale",
        "future",
        "slow",
        "failing",
        "redirect",
    )

    def __init__(self, key: str, rng: random.Random) -> None:
        self.key = key
        self.rng = rng
        self.kind = "valid"
        self.value = 6
        self.detail = ""
        self.served: Counter[str] = Counter()
        self.deck: list[str] = []
        self.stopping = threading.Event()
        router = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                kind, value, detail = router.kind, router.value, router.detail
                if self.headers.get("Authorization") != f"Bearer {router.key}":
                    self._send(401, b"")
                    return
                router.served[f"{kind}: {detail}" if detail else kind] += 1
                if kind == "slow":
                    router.stopping.wait(3.5)  # past the probe's 3 s deadline (R-P5)
                    self._send(200, _snapshot(_row(value)))
                elif kind == "valid":
                    self._send(200, _snapshot(_row(value)))
                elif kind == "incomplete":
                    self._send(200, _snapshot(_row(value), complete=False))
                elif kind == "stale":
                    self._send(200, _snapshot(_row(value), observed=time.time() - 120))
                elif kind == "future":
                    self._send(200, _snapshot(_row(value), observed=time.time() + 60))
                elif kind == "failing":
                    self._send(int(detail), b"")
                elif kind == "redirect":
                    self._send(302, b"", {"Location": "http://127.0.0.1:1/v1/capacity"})
                else:
                    self._send(200, INVALID_BODIES[detail]())

            def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                with contextlib.suppress(OSError):
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def flip(self) -> None:
        """The next answer: every kind once per round, in a shuffled order."""
        if not self.deck:
            self.deck = list(self.KINDS)
            self.rng.shuffle(self.deck)
        kind = self.deck.pop()
        detail = ""
        if kind == "invalid":
            detail = self.rng.choice(sorted(INVALID_BODIES))
        elif kind == "failing":
            detail = str(self.rng.choice((500, 502, 503, 401, 403, 404, 429)))
        self.kind, self.value, self.detail = kind, self.rng.randint(0, 12), detail

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


# --- the soak ---------------------------------------------------------------------------
@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    state: str
    gen: str
    hammer: bool
    err: str


@dataclass
class Report:
    seconds: float = 0.0
    workers_started: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    sidecar_kills: int = 0
    config_edits: Counter[str] = field(default_factory=Counter)
    repairs: int = 0
    reclaim_max_s: float = 0.0
    reclaims_timed: int = 0
    reclaim_over_2s: int = 0
    slow_reclaims: list[str] = field(default_factory=list)
    lock_outage_max_s: float = 0.0
    hammer_entered: int = 0
    checks: Counter[str] = field(default_factory=Counter)
    observations: int = 0
    violations: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.rng = random.Random(args.seed)
        self.report = Report()
        self.segment = "/gws-" + secrets.token_hex(5)
        self.key = "sk-soak-" + secrets.token_hex(12)
        self.key_file = tmp / "router.key"
        self.key_file.write_text(self.key + "\n")
        self.key_file.chmod(0o600)
        self.config = tmp / "gateway.json"
        self.router = ChaosRouter(self.key, random.Random(args.seed + 1))
        self.doc: dict[str, Any] = {
            "maxConcurrent": 4,
            "providers": [
                {
                    "id": "p1",
                    "type": "chat-completions-api",
                    "baseUrl": self.router.base_url,
                    "credentialFile": str(self.key_file),
                    "capacityDiscovery": True,
                    "maxConcurrent": 10,
                    "models": {"w": "workhorse"},
                },
                {"id": "p2", "maxConcurrent": 3},
            ],
        }
        self.write_config(json.dumps(self.doc))
        self.workers: dict[int, Worker] = {}
        self.finished: list[tuple[Worker, int]] = []
        self.killed_at: dict[int, tuple[float, str]] = {}
        self.stop = threading.Event()
        self.wlock = threading.Lock()
        self.sidecar: subprocess.Popen[bytes] | None = None
        self.sidecar_logs: list[Path] = []
        self.generation = "gen-A"
        self.n_workers = 0
        self.stderr_lines: list[str] = []

    # -- setup ---------------------------------------------------------------------------
    def write_config(self, text: str) -> None:
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.config)  # as an editor saves: the sidecar never reads half a file

    def start_sidecar(self) -> None:
        self.served_at_sidecar_start = sum(self.router.served.values())
        self.sidecar_started = time.monotonic()
        log = self.tmp / f"sidecar-{len(self.sidecar_logs)}.log"
        self.sidecar_logs.append(log)
        # --parent-pid: a soak that dies takes its sidecar with it
        parent = ("--parent-pid", str(os.getpid()))
        self.sidecar = start_sidecar(self.config, self.segment, log, *parent, refresh=0.3)

    def start_worker(self, hammer: bool) -> None:
        self.n_workers += 1
        state = self.tmp / f"w{self.n_workers}.state"
        state.write_bytes(b"\0" * STATE_SIZE)
        err = self.tmp / f"w{self.n_workers}.err"
        with open(err, "wb") as errf:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).with_name("soak_worker.py")),
                    "--segment",
                    self.segment,
                    "--gen",
                    self.generation,
                    "--upstream",
                    self.upstream_url,
                    "--state",
                    str(state),
                    "--clients",
                    "2" if hammer else "6",
                    "--seed",
                    str(self.n_workers),
                    *(["--hammer"] if hammer else []),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=errf,
            )
        with self.wlock:
            self.workers[proc.pid] = Worker(proc, str(state), self.generation, hammer, str(err))
        self.report.workers_started += 1

    # -- chaos ---------------------------------------------------------------------------
    def kill_worker(self, pid: int, why: str) -> None:
        with self.wlock:
            worker = self.workers.pop(pid, None)
        if worker is None:
            return
        phases, _ = read_state(worker.state)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        t = time.time()
        worker.proc.wait()
        if why == "lock":
            what = "aimed at the lock holder"
        elif RUNNING in phases:
            what = "running"
        elif ARRIVING in phases:
            what = "arriving or waiting"
        else:
            what = "idle"
        self.report.kills[what] += 1
        self.killed_at[pid] = (t, what)
        self.finished.append((worker, -9))
        self.start_worker(worker.hammer)

    def killer(self) -> None:
        header = map_readonly(self.segment)
        try:
            while not self.stop.wait(self.rng.uniform(0.1, 0.6)):
                if self.args.no_worker_kills:
                    continue
                if self.rng.random() < self.args.lock_kills:
                    # aim at the lock: kill whichever worker holds it right now
                    deadline = time.monotonic() + 0.3
                    while time.monotonic() < deadline:
                        owner = lock_holder_pid(self.segment, header)
                        if owner and owner in self.workers:
                            self.kill_worker(owner, "lock")
                            break
                else:
                    with self.wlock:
                        pids = list(self.workers)
                    if pids:
                        self.kill_worker(self.rng.choice(pids), "random")
        finally:
            header.close()

    def sidecar_chaos(self) -> None:
        while not self.stop.wait(self.rng.uniform(2.5, 5.0)):
            assert self.sidecar is not None
            if self.args.no_sidecar_kills:
                continue
            # A sidecar that starts slowly on a loaded machine gets the chance to probe
            # once (up to 8 s) before it is killed again, so the router's answers are
            # really tried; kills during start-up still happen whenever it probes quickly.
            while (
                sum(self.router.served.values()) == self.served_at_sidecar_start
                and time.monotonic() - self.sidecar_started < 8.0
                and not self.stop.wait(0.2)
            ):
                pass
            self.sidecar.kill()
            self.sidecar.wait()
            self.report.sidecar_kills += 1
            if self.stop.wait(self.rng.uniform(0.0, 1.5)):
                break
            self.start_sidecar()

    def router_chaos(self) -> None:
        while not self.stop.wait(self.rng.uniform(0.3, 1.0)):
            self.router.flip()

    def config_chaos(self) -> None:
        while not self.stop.wait(self.rng.uniform(1.0, 3.0)):
            p1, p2 = self.doc["providers"]
            what = self.rng.choice(
                ("p1 ceiling", "p2 limit", "gateway limit", "discovery", "broken")
            )
            if what == "broken":
                self.write_config(json.dumps(self.doc)[:-7] + ' "oops')
            else:
                if what == "p1 ceiling":
                    p1["maxConcurrent"] = self.rng.randint(1, 10)
                elif what == "p2 limit":
                    p2["maxConcurrent"] = self.rng.randint(1, 6)
                elif what == "gateway limit":
                    self.doc["maxConcurrent"] = self.rng.randint(1, 8)
                else:
                    p1["capacityDiscovery"] = not p1["capacityDiscovery"]
                self.write_config(json.dumps(self.doc))
            self.report.config_edits[what] += 1

    def generations(self) -> None:
        # halfway through, new workers are generation B; A's are replaced as they are killed
        if not self.stop.wait(self.args.seconds / 2):
            self.generation = "gen-B"

    # -- observation ---------------------------------------------------------------------
    def sampler(self) -> None:
        """Watches the lock itself: how long it stays taken (R-A6).

        An outage is a stretch during which the lock is held and ``lock_seq`` does not
        move: nobody new got the lock (a holder that is slow, or one that died and
        whose lock the kernel has not handed on yet). Mutual exclusion itself is
        checked where it matters, by the running counts at the upstream (R-A1).
        """
        header = map_readonly(self.segment)
        seq, since = HEADER["lock_seq"].get(header), time.monotonic()
        try:
            while not self.stop.wait(0.01):
                held = lock_holder_pid(self.segment, header) is not None
                now_seq, now = HEADER["lock_seq"].get(header), time.monotonic()
                if not held or now_seq != seq:
                    seq, since = now_seq, now
                else:
                    self.report.lock_outage_max_s = max(self.report.lock_outage_max_s, now - since)
        finally:
            header.close()

    def verifier(self) -> None:
        while not self.stop.wait(0.5):
            self.checker.verify()

    def observe(self, buf: Any) -> None:
        data, consistent = snapshot_bytes(buf)
        now = time.time()
        view = parse_view(self.segment, data, consistent=consistent, now=now)
        self.report.observations += 1
        present = {h.pid for h in view.holders}
        for pid, (t, what) in list(self.killed_at.items()):
            if pid not in present:
                took = now - t
                del self.killed_at[pid]
                self.report.reclaims_timed += 1
                self.report.reclaim_max_s = max(self.report.reclaim_max_s, took)
                if took > 2.0:
                    self.report.reclaim_over_2s += 1
                    self.report.slow_reclaims.append(
                        f"{took:.2f} s after a kill {what} (lock recoveries so far: "
                        f"{view.lock_repairs})"
                    )
        for p in view.providers:
            if p.id not in PROVIDERS:
                continue
            self.report.checks["waiting vs bound"] += 1
            if p.waiting > QUEUE_BOUND or (consistent and p.stored_waiting > p.queue_bound):
                self.fail(f"R-A2: {p.id}: waiting {p.waiting} (stored {p.stored_waiting}) > 32")
            records = [h for h in view.holders if h.provider == p.id]
            running = [h for h in records if h.state == "running"]
            if consistent and running:
                self.checker.claim(
                    Claim(
                        "RUNNING records",
                        p.id,
                        len(running),
                        now,
                        ((max(h.since for h in running), now),),
                    )
                )
            if consistent and not HEADER["dirty"].get(data):
                self.report.checks["counters vs records"] += 1
                base = rows.provider_base(p.index)
                n_run = sum(
                    1
                    for h in range(128)
                    if HOLDER["state"].get(data, rows.holder_base(p.index, h)) == HOLDER_RUNNING
                )
                n_wait = sum(
                    1
                    for h in range(128)
                    if HOLDER["state"].get(data, rows.holder_base(p.index, h)) == HOLDER_WAITING
                )
                stored = (PROVIDER["running"].get(data, base), PROVIDER["waiting"].get(data, base))
                if stored != (n_run, n_wait):
                    self.fail(
                        f"counters: {p.id}: stored running/waiting {stored} but the records "
                        f"say {(n_run, n_wait)}"
                    )

    def observer(self) -> None:
        buf = map_readonly(self.segment)
        try:
            while not self.stop.wait(OBSERVE_S):
                self.observe(buf)
        finally:
            buf.close()

    def fail(self, message: str) -> None:
        if len(self.report.violations) < 50:
            self.report.violations.append(message)

    # -- run -----------------------------------------------------------------------------
    def run(self) -> Report:
        Admission.attach(config=self.config, segment=self.segment, generation="soak-setup").close()
        buf = map_readonly(self.segment)
        indexes = {name: rows.find_provider(buf, name) for name in PROVIDERS}
        repairs_before = HEADER["repairs"].get(buf)
        buf.close()
        self.timeline = LimitTimeline(
            self.segment,
            {k: v for k, v in indexes.items() if v is not None},
            self.tmp / "limits.bin",
            understate=self.args.understate,
        )
        self.timeline.wait_first()
        self.checker = Checker(self.timeline)
        self.upstream = Upstream(self.checker)
        self.upstream_server = start_upstream(self.upstream)
        self.upstream_url = f"http://127.0.0.1:{self.upstream_server.server_address[1]}"
        self.start_sidecar()
        for i in range(self.args.workers + self.args.hammers):
            self.start_worker(hammer=i >= self.args.workers)
        threads = [
            threading.Thread(target=f, daemon=True)
            for f in (
                self.sampler,
                self.verifier,
                self.observer,
                self.killer,
                self.sidecar_chaos,
                self.router_chaos,
                self.config_chaos,
                self.generations,
            )
        ]
        started = time.monotonic()
        for t in threads:
            t.start()
        try:
            self.stop.wait(self.args.seconds)
        finally:
            self.stop.set()
            for t in threads:
                t.join(timeout=30)
        self.report.seconds = time.monotonic() - started
        self.finish(repairs_before)
        return self.report

    def finish(self, repairs_before: int) -> None:
        rep = self.report
        # calm: a valid router, a good config, a sidecar; then the workers stop by themselves
        self.router.kind, self.router.detail = "valid", ""
        self.write_config(json.dumps(self.doc))
        if self.sidecar is None or self.sidecar.poll() is not None:
            self.start_sidecar()
        with self.wlock:
            workers = list(self.workers.values())
            self.workers.clear()
        for w in workers:
            Path(w.state + ".stop").touch()
        for w in workers:
            try:
                code = w.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                code = w.proc.wait()
                rep.lost.append(f"worker {w.proc.pid} did not stop within 60 s after being asked")
            self.finished.append((w, code))
        # the killed workers' records must be gone too
        deadline = time.monotonic() + 10
        while self.killed_at and time.monotonic() < deadline:
            buf = map_readonly(self.segment)
            try:
                self.observe(buf)
            finally:
                buf.close()
            time.sleep(OBSERVE_S)
        for pid in self.killed_at:
            rep.lost.append(f"R-A5: records of killed worker {pid} still there 10 s after the kill")
        for w, code in self.finished:
            _, counters = read_state(w.state)
            rep.outcomes.update(counters)
            if w.hammer:
                rep.hammer_entered += counters["entered"]
            err = Path(w.err).read_text(errors="replace").strip()
            self.stderr_lines.extend(
                f"{w.proc.pid}: {line}"
                for line in err.splitlines()
                if "Error" in line or "Exception" in line or "Warning" in line
            )
            if code != -9:
                if code != 0:
                    rep.lost.append(f"worker {w.proc.pid} exited {code}: {err[-300:]}")
                if not w.hammer and counters["completed"] != self.upstream.by_pid[w.proc.pid]:
                    rep.lost.append(
                        f"worker {w.proc.pid}: {counters['completed']} requests answered, the "
                        f"upstream answered {self.upstream.by_pid[w.proc.pid]}"
                    )
                if counters["entered"] != counters["completed"] and not w.hammer:
                    rep.lost.append(
                        f"worker {w.proc.pid}: entered {counters['entered']} slots but "
                        f"{counters['completed']} requests were answered"
                    )
            if counters["error"] or counters["upstream_error"]:
                rep.lost.append(f"worker {w.proc.pid}: unexpected errors: {err[-500:]}")
        out = subprocess.run(
            [EXE, "inspect", "--segment", self.segment, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            rep.lost.append(f"inspect failed: {out.stderr.strip()}")
        else:
            doc = json.loads(out.stdout)
            self.inspect = doc
            for p in doc["providers"]:
                if p["running"] or p["waiting"]:
                    rep.lost.append(
                        f"{p['id']}: running {p['running']}, waiting {p['waiting']} at the end"
                    )
            if doc.get("holders"):
                rep.lost.append(f"holder records left at the end: {doc['holders']}")
        if self.upstream.in_flight_live():
            rep.lost.append(f"{self.upstream.in_flight_live()} requests still in flight upstream")
        time.sleep(2 * SLACK_S + LimitTimeline.MAX_GAP_S)  # let the samples cover the last claims
        self.checker.verify(final=True)
        rep.violations.extend(self.checker.violations)
        buf = map_readonly(self.segment)
        rep.repairs = HEADER["repairs"].get(buf) - repairs_before
        self.counters = {
            name: {k: PROVIDER[k].get(buf, rows.provider_base(p)) for k in PROVIDER_COUNTERS}
            for name, p in self.timeline.indexes.items()
        }
        buf.close()
        # Accounting: every request the upstream saw was answered or its client was killed
        # mid-request; the ledger admitted at least every slot a worker entered.
        up = self.upstream
        arrived, answered = sum(up.arrived.values()), sum(up.completed.values())
        if arrived != answered + up.client_gone:
            rep.lost.append(
                f"upstream: {arrived} requests arrived, {answered} answered, "
                f"{up.client_gone} cut by a kill: {arrived - answered - up.client_gone} unaccounted"
            )
        admitted = sum(c["admitted_total"] for c in self.counters.values())
        if admitted < rep.outcomes["entered"]:
            rep.lost.append(
                f"workers entered {rep.outcomes['entered']} slots but the segment admitted "
                f"only {admitted}"
            )

    def close(self) -> None:
        if self.sidecar is not None and self.sidecar.poll() is None:
            self.sidecar.kill()
            self.sidecar.wait()
        with self.wlock:
            for w in self.workers.values():
                w.proc.kill()
                w.proc.wait()
        self.router.stop()
        if hasattr(self, "upstream_server"):
            self.upstream_server.shutdown()
            self.upstream_server.server_close()
        if hasattr(self, "timeline"):
            self.timeline.close()
        unlink_segment(self.segment)


def summary(soak: Soak) -> dict[str, Any]:
    rep = soak.report
    bad = {k: v for k, v in soak.router.served.items() if k != "valid"}
    return {
        "seconds": round(rep.seconds, 1),
        "workers_started": rep.workers_started,
        "operations": {
            "slots_asked": rep.outcomes["asked"],
            "admitted": rep.outcomes["entered"],
            "upstream_requests": sum(soak.upstream.arrived.values()),
            "upstream_answered": sum(soak.upstream.completed.values()),
            "queue_full": rep.outcomes["queue_full"],
            "timeouts": rep.outcomes["timeout"],
            "entered_by_hammers": rep.hammer_entered,
            "upstream_cut_by_a_kill": soak.upstream.client_gone,
            "granted_but_never_entered": sum(c["admitted_total"] for c in soak.counters.values())
            - rep.outcomes["entered"],
            "segment_counters": soak.counters,
            "upstream_peak_in_flight": dict(soak.upstream.peak),
        },
        "kills_survived": {"workers": dict(rep.kills), "sidecar": rep.sidecar_kills},
        "lock_recoveries": rep.repairs,
        "longest_lock_outage_s": round(rep.lock_outage_max_s, 2),
        "reclaim": {
            "timed": rep.reclaims_timed,
            "max_s": round(rep.reclaim_max_s, 2),
            "over_2s": rep.reclaim_over_2s,
            "slow": rep.slow_reclaims,
        },
        "bad_answers_served": sum(bad.values()),
        "bad_answers": dict(sorted(bad.items())),
        "valid_answers_served": soak.router.served["valid"],
        "config_edits": dict(rep.config_edits),
        "observations": rep.observations,
        "checks": dict(rep.checks),
        "limit_samples": soak.timeline.sample_count(),
        "r_a1_claims": {
            "verified": dict(soak.checker.verified),
            "unverifiable (limit samples too sparse)": dict(soak.checker.unverifiable),
        },
        "violations": rep.violations,
        "r_a1_violations": soak.checker.violation_count,
        "diagnostics": soak.checker.diagnostics,
        "worker_stderr": soak.stderr_lines[:40],
        "lost": rep.lost,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--hammers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--json", metavar="PATH", help="also write the report here")
    ap.add_argument("--no-worker-kills", action="store_true", help="(to narrow a failure down)")
    ap.add_argument("--no-sidecar-kills", action="store_true", help="(to narrow a failure down)")
    ap.add_argument(
        "--lock-kills",
        type=float,
        default=0.4,
        help="share of the worker kills aimed at the lock holder (default 0.4)",
    )
    ap.add_argument(
        "--understate",
        type=int,
        default=0,
        help="self-test of the checker: take every limit in force as this much lower "
        "(the soak must then report R-A1 violations)",
    )
    args = ap.parse_args(argv)
    # SIGTERM (a test's timeout, an operator) cleans up like Ctrl-C: processes, segment
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="gwsoak-") as tmp:
        soak = Soak(args, Path(tmp))
        try:
            soak.run()
            result = summary(soak)
        finally:
            soak.close()
    result["seed"] = args.seed
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if result["violations"] or result["lost"]:
        print("soak: FAILED (see violations / lost above)", file=sys.stderr)
        return 1
    print("soak: passed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
