"""The upgrade drill: one admission budget across real gateway generations (issue 12 s.2).

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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

ROOT = Path(__file__).resolve().parent.parent
PROVIDER = "local-inference"
MODEL_ALIAS = "local-workhorse"
MODEL = "workhorse"


def _no_control_socket() -> list[str]:
    """No control socket: newer gunicorns put one at ~/.gunicorn/gunicorn.ctl, shared by every
    gunicorn of the user, and the drill runs two masters at once. The 23.x that
    ``litellm[proxy]`` pins has neither the socket nor the option."""
    from gunicorn.config import KNOWN_SETTINGS

    flag = "--no-control-socket"
    return [flag] if any(flag in (s.cli or ()) for s in KNOWN_SETTINGS) else []


GUNICORN = [sys.executable, "-m", "gunicorn", "-k", "uvicorn.workers.UvicornWorker"]
GUNICORN += _no_control_socket()
GEN_A, GEN_B = "gen-A", "gen-B"


@dataclass
class Timing:
    legacy_s: float
    drain_s: float
    gen_a_s: float
    sidecar_s: float
    fence_s: float
    unfence_s: float
    gen_b_s: float
    clients: int
    legacy_clients: int
    burst: int

    @classmethod
    def of(cls, short: bool) -> Timing:
        if short:
            return cls(3, 4, 4, 4, 5, 4, 6, clients=36, legacy_clients=4, burst=30)
        return cls(8, 10, 15, 12, 20, 15, 25, clients=40, legacy_clients=6, burst=40)


@dataclass
class Sample:
    t: float
    phase: str
    limit: int
    source: str
    running: int
    waiting: int
    by_generation: dict[str, int]
    waiting_by_generation: dict[str, int]
    inflight: int
    legacy_inflight: int


RELOAD_DROPS = frozenset({"ReadError", "RemoteProtocolError"})  # no answer at all


@dataclass
class Outcomes:
    ok: int = 0
    rejected: int = 0
    timed_out: int = 0
    bad_429: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    legacy_ok: int = 0
    # Connections a stopping gunicorn worker closed before it read the request (the
    # reload's accept race: uvicorn closes connections that have sent nothing yet when
    # it shuts down). Not lost to admission: the exact accounting (segment admitted =
    # upstream = whole answers) proves none of them was admitted; reported apart.
    dropped_by_reload: Counter[str] = field(default_factory=Counter)

    @property
    def lost(self) -> int:
        return sum(self.errors.values())


class DrillFailed(Exception):
    pass


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    sock.set_inheritable(True)
    return sock


class Drill:
    def __init__(self, short: bool, out: TextIO) -> None:
        self.timing = Timing.of(short)
        self.short = short
        self.out = out
        self.tmp = Path(tempfile.mkdtemp(prefix="gwcap-drill-"))
        self.t0 = time.monotonic()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.samples: list[Sample] = []
        self.marks: list[tuple[float, str, str]] = []  # time, text, tag on the plot
        self.problems: list[str] = []
        self.phase = "setup"
        self.segment = ""
        self.bells: list[int] = []  # doorbells of the registered processes, for cleanup
        self.stop_sampling = threading.Event()
        self.cli_checks = 0
        self.outcomes = Outcomes()
        self.load_stop = threading.Event()
        self.legacy_stop = threading.Event()
        self.legacy_sent = 0  # legacy requests sent (one loop thread: no lock needed)
        self.figures: dict[str, Any] = {}

    # --- output ---------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        print(f"[{self.now():6.1f}s] {text}", file=self.out, flush=True)

    def mark(self, text: str, tag: str = "") -> None:
        self.marks.append((self.now(), text, tag))
        self.say(f"--- {text}")

    # --- processes ----------------------------------------------------------------------
    def spawn(
        self,
        name: str,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
        stdout: int | None = None,
    ) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            args,
            stdout=stdout if stdout is not None else log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            pass_fds=pass_fds,
            cwd=str(self.tmp),
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def log_of(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.tmp / f"{name}.log").read_text(errors="replace")
        return ""

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        exe = Path(sys.executable).with_name("gateway-capacity")
        return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=30)

    def wait_for(self, what: str, predicate: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise DrillFailed(f"timed out after {timeout:g} s waiting for {what}")

    # --- set-up -------------------------------------------------------------------------
    def setup(self) -> None:
        self.key_file = self.tmp / "provider.key"
        fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
        workers = self.spawn(
            "simworkers",
            [
                sys.executable,
                str(ROOT / "drill" / "simworkers.py"),
                "--count",
                "2",
                "--slots",
                "10",
            ],
            stdout=subprocess.PIPE,
        )
        assert workers.stdout is not None
        urls = json.loads(workers.stdout.readline())
        registry = self.tmp / "workers.json"
        registry.write_text(
            json.dumps(
                {
                    "workers": [
                        {
                            "id": f"w{i + 1}",
                            "urls": [u],
                            "models": [MODEL],
                            "slots": {"source": "props"},
                        }
                        for i, u in enumerate(urls)
                    ]
                }
            )
        )
        router = self.spawn(
            "router",
            [
                str(Path(sys.executable).with_name("gateway-capacity")),
                "router",
                "serve",
                "--workers",
                str(registry),
                "--key-file",
                str(self.key_file),
                "--listen",
                "127.0.0.1:0",
                "--poll",
                "0.25",
            ],
            stdout=subprocess.PIPE,
        )
        assert router.stdout is not None
        line = router.stdout.readline().decode()
        if not line.startswith("serving "):
            raise DrillFailed(f"the router did not start: {self.log_of('router')}")
        self.router_url = line.split()[1].removesuffix("/v1/capacity")
        sock = free_socket()
        self.upstream_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.spawn(
            "upstream",
            [
                sys.executable,
                str(ROOT / "drill" / "fake_upstream.py"),
                "--fd",
                str(sock.fileno()),
                "--key-file",
                str(self.key_file),
                "--router",
                self.router_url,
                "--chunk-s",
                "0.2",
            ],
            pass_fds=(sock.fileno(),),
        )
        sock.close()
        self.config = self.tmp / "gateway.json"
        self.config.write_text(
            json.dumps(
                {
                    "maxConcurrent": 4,
                    "providers": [
                        {
                            "id": PROVIDER,
                            "type": "chat-completions-api",
                            "baseUrl": f"{self.upstream_url}/v1",
                            "credentialFile": str(self.key_file),
                            "capacityDiscovery": True,
                            "models": {MODEL_ALIAS: MODEL},
                        }
                    ],
                },
                indent=2,
            )
        )
        from shm_layout.names import segment_name_for_config

        self.segment = segment_name_for_config(self.config)
        self.http = httpx.Client(trust_env=False, timeout=5)
        self.wait_for("the upstream", self._upstream_ready, 30)
        self.say(
            f"workers {', '.join(urls)}; router {self.router_url}; "
            f"upstream {self.upstream_url}; segment {self.segment}"
        )

    def _upstream_ready(self) -> bool:
        try:
            return self.http.get(f"{self.upstream_url}/_drill/stats").status_code == 200
        except httpx.HTTPError:
            return False

    def gateway_env(self, generation: str | None = None) -> dict[str, str]:
        env = {
            "GATEWAY_CONFIG": str(self.config),
            "GATEWAY_ADMISSION_TIMEOUT": "60",
            "PYTHONUNBUFFERED": "1",
        }
        if generation is not None:
            env["GATEWAY_GENERATION"] = generation
        return env

    def start_gunicorn(self, name: str, app: str, generation: str | None) -> str:
        sock = free_socket()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        pidfile = self.tmp / f"{name}.pid"
        conf = self.tmp / f"{name}.conf.py"
        env_lines = [f"GATEWAY_GENERATION={generation}"] if generation else []
        conf.write_text(f"raw_env = {env_lines!r}\n")
        self.spawn(
            name,
            [
                *GUNICORN,
                "-w",
                "2",
                "--bind",
                f"fd://{sock.fileno()}",
                "--chdir",
                str(ROOT / "examples"),
                "--pid",
                str(pidfile),
                "-c",
                str(conf),
                "--graceful-timeout",
                "60",
                "--keep-alive",
                "2",
                app,
            ],
            env=self.gateway_env(),
            pass_fds=(sock.fileno(),),
        )
        sock.close()
        self.wait_for(f"{name} to serve", lambda: self._healthy(url), 60)
        self.wait_for(f"{name} pidfile", pidfile.exists, 10)
        return url

    def _healthy(self, url: str) -> bool:
        try:
            return self.http.get(f"{url}/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def start_sidecar(self, name: str, *extra: str) -> subprocess.Popen[bytes]:
        return self.spawn(
            name,
            [
                str(Path(sys.executable).with_name("gateway-capacity")),
                "sidecar",
                "--config",
                str(self.config),
                "--refresh",
                "0.5",
                *extra,
            ],
        )

    # --- observing ----------------------------------------------------------------------
    def provider_doc(self) -> tuple[dict[str, Any], Any] | None:
        from gateway_capacity.cmd_views import availability_doc
        from shm_layout.segment import SegmentError
        from shm_layout.view import read_view

        try:
            view = read_view(self.segment)
        except SegmentError:
            return None
        doc = availability_doc(view)
        for p in doc["providers"]:
            if p["id"] == PROVIDER:
                return p, view
        return None

    def observe(self) -> None:
        last_cli = last_line = 0.0
        while not self.stop_sampling.is_set():
            got = self.provider_doc()
            try:
                stats = self.http.get(f"{self.upstream_url}/_drill/stats").json()
            except (httpx.HTTPError, ValueError):
                stats = None
            if got is not None and stats is not None:
                p, view = got
                running: Counter[str] = Counter()
                waiting: Counter[str] = Counter()
                for h in view.holders:
                    if h.provider == PROVIDER and h.alive:
                        (running if h.state == "running" else waiting)[h.generation or "?"] += 1
                s = Sample(
                    self.now(),
                    self.phase,
                    p["effective_limit"],
                    p["source"],
                    p["running"],
                    p["waiting"],
                    dict(running),
                    dict(waiting),
                    stats["inflight"]["admitted"],
                    stats["inflight"]["legacy"],
                )
                self.samples.append(s)
                if s.waiting > 32:
                    self.problems.append(f"waiting {s.waiting} > 32 at {s.t:.1f}s")
                if s.t - last_line >= 1.0:
                    last_line = s.t
                    gens = " ".join(f"{g} {n}" for g, n in sorted(running.items())) or "-"
                    self.say(
                        f"{self.phase:<16} limit {s.limit:>2} ({s.source:<12}) running "
                        f"{s.running:>2} [{gens}]  waiting {s.waiting:>2}/32  upstream "
                        f"in flight {s.inflight:>2} (legacy {s.legacy_inflight})"
                    )
            if time.monotonic() - last_cli >= 3.0:  # the operator's own view, as a process
                last_cli = time.monotonic()
                out = self.cli("availability", "--segment", self.segment, "--json")
                if out.returncode == 0:
                    self.cli_checks += 1
                    for p in json.loads(out.stdout)["providers"]:
                        if p["id"] == PROVIDER and p["waiting"] > 32:
                            self.problems.append(f"availability --json: waiting {p['waiting']}")
            self.stop_sampling.wait(0.1)

    # --- load ---------------------------------------------------------------------------
    async def _one(self, client: httpx.AsyncClient, url: str, rid: str, chunks: int) -> str:
        body = {
            "model": MODEL_ALIAS,
            "stream": True,
            "max_tokens": chunks,
            "messages": [{"role": "user", "content": "drill"}],
        }
        try:
            async with client.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers={"x-request-id": rid}
            ) as answer:
                data = await answer.aread()
                if answer.status_code == 200:
                    if data.endswith(b"data: [DONE]\n\n") and data.count(b"data: ") == chunks + 1:
                        return "ok"
                    return "truncated"
                if answer.status_code == 429:
                    error = json.loads(data).get("error", {})
                    good = answer.headers.get("retry-after") and error.get("code") == "queue_full"
                    return "429" if good else "bad-429"
                if answer.status_code == 503:
                    return "503"
                return f"http-{answer.status_code}"
        except httpx.HTTPError as exc:
            return type(exc).__name__

    def _tally(self, outcome: str, legacy: bool) -> None:
        o = self.outcomes
        if outcome == "ok":
            if legacy:
                o.legacy_ok += 1
            else:
                o.ok += 1
        elif outcome == "429" and not legacy:
            o.rejected += 1
        elif outcome == "503" and not legacy:
            o.timed_out += 1
            o.errors["503"] += 1
        elif outcome == "bad-429":
            o.bad_429 += 1
            o.errors[outcome] += 1
        elif outcome in RELOAD_DROPS and not legacy and self.phase == "HUP -> gen-B":
            o.dropped_by_reload[outcome] += 1
        else:
            o.errors[f"{'legacy ' if legacy else ''}{outcome}"] += 1

    async def _client_loop(
        self, url_of: Any, prefix: str, lo: int, hi: int, stop: threading.Event, seed: int
    ) -> None:
        rng = random.Random(seed)
        # No keep-alive: each request on its own connection, so a gunicorn reload never
        # races an idle pooled connection (that would be the client's loss, not ours).
        async with httpx.AsyncClient(
            trust_env=False, timeout=120, limits=httpx.Limits(max_keepalive_connections=0)
        ) as c:
            for n in itertools.count():
                if stop.is_set():
                    return
                if prefix == "legacy":
                    self.legacy_sent += 1
                outcome = await self._one(c, url_of(), f"{prefix}-{seed}-{n}", rng.randint(lo, hi))
                self._tally(outcome, prefix == "legacy")
                if outcome == "429":
                    await asyncio.sleep(1.0)  # Retry-After: 1

    async def _burst(self, url: str, count: int) -> None:
        async with httpx.AsyncClient(
            trust_env=False, timeout=120, limits=httpx.Limits(max_keepalive_connections=0)
        ) as c:
            outcomes = await asyncio.gather(
                *(self._one(c, url, f"burst-{i}", 3) for i in range(count))
            )
        for outcome in outcomes:
            self._tally(outcome, False)
        self.figures["burst"] = dict(Counter(outcomes))

    def run_load(self, coro: Any) -> threading.Thread:
        t = threading.Thread(target=lambda: asyncio.run(coro), daemon=True)
        t.start()
        return t

    async def _many(
        self, n: int, url_of: Any, prefix: str, lo: int, hi: int, stop: threading.Event
    ) -> None:
        await asyncio.gather(
            *(self._client_loop(url_of, prefix, lo, hi, stop, i) for i in range(n))
        )

    # --- the drill ------------------------------------------------------------------------
    def run(self) -> None:
        t = self.timing
        self.setup()
        self.phase = "legacy"
        legacy_url = self.start_gunicorn("legacy", "openai_gateway:app_without_admission", None)
        legacy_pidfile = self.tmp / "legacy.pid"
        legacy_master = int(legacy_pidfile.read_text())
        legacy_load = self.run_load(
            self._many(t.legacy_clients, lambda: legacy_url, "legacy", 15, 25, self.legacy_stop)
        )
        self.mark(f"legacy generation (no middleware) serving, master pid {legacy_master}")
        sidecar1 = self.start_sidecar("sidecar-1", "--await-legacy", str(legacy_pidfile))
        self.wait_for("legacy_drain", lambda: self._source() == "legacy_drain", 30)
        threading.Thread(target=self.observe, daemon=True).start()
        time.sleep(t.legacy_s)

        self.phase = "drain"
        gen_url = self.start_gunicorn("gateway", "openai_gateway:app", GEN_A)
        self.gen_master = int((self.tmp / "gateway.pid").read_text())
        self.mark(f"generation A up (master {self.gen_master}); its requests queue", "gen-A up")
        load = self.run_load(self._many(t.clients, lambda: gen_url, "new", 3, 10, self.load_stop))
        time.sleep(t.drain_s)
        self.legacy_stop.set()
        # Every legacy request already sent must be in the server before it stops
        # accepting: those are the active requests that finish during the drain.
        self.wait_for("the legacy requests to reach the upstream", self._legacy_arrived, 30)
        os.kill(legacy_master, signal.SIGTERM)
        self.mark("legacy master sent SIGTERM: it finishes its requests, then exits", "legacy TERM")
        legacy_load.join(timeout=60)
        legacy = self.procs["legacy"]
        self.wait_for("the legacy master to exit", lambda: legacy.poll() is not None, 60)
        self.mark("legacy master exited", "legacy exited")
        self.wait_for("the discovered limit", lambda: self._limit() == (20, "discovered"), 30)
        self.figures["legacy_exit_to_budget_s"] = round(self.now() - self.marks[-1][0], 2)
        self.phase = "gen-A"
        self.mark("discovered budget in force: 20")
        time.sleep(t.gen_a_s)

        self.phase = "sidecar upgrade"
        epoch = self._epoch()
        sidecar2 = self.start_sidecar("sidecar-2")
        self.mark("new sidecar started", "sidecar upgrade")
        try:
            code = sidecar1.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise DrillFailed("the old sidecar did not retire within 30 s") from None
        self.figures["old_sidecar_exit"] = code
        if code != 0:
            self.problems.append(f"the fenced sidecar exited {code}, not 0 (R-G4)")
        new_epoch = self._epoch()
        self.mark(f"old sidecar fenced (writer epoch {epoch} -> {new_epoch}), exited {code}")
        time.sleep(t.sidecar_s)

        self.phase = "fenced w2"
        self._router("fence")
        self.mark("router: w2 fenced (expect 10)", "fence w2")
        self.wait_for("limit 10", lambda: self._limit() == (10, "discovered"), 30)
        time.sleep(t.fence_s / 2)
        self.mark(f"burst of {t.burst} extra requests (overflow)", "burst")
        asyncio.run(self._burst(gen_url, t.burst))
        time.sleep(t.fence_s / 2)
        self.phase = "unfenced w2"
        self._router("unfence")
        self.mark("router: w2 unfenced (expect 20)", "unfence w2")
        self.wait_for("limit 20", lambda: self._limit() == (20, "discovered"), 30)
        time.sleep(t.unfence_s)

        self.phase = "HUP -> gen-B"
        (self.tmp / "gateway.conf.py").write_text(f"raw_env = ['GATEWAY_GENERATION={GEN_B}']\n")
        os.kill(self.gen_master, signal.SIGHUP)
        self.mark("gunicorn master sent SIGHUP with generation B in its config", "HUP (gen-B)")
        hup = self.now()
        self.wait_for("generation B's workers", lambda: self._members(GEN_B) == 2, 60)
        self.figures["hup_to_gen_b_attached_s"] = round(self.now() - hup, 2)
        self.mark("generation B's workers attached")
        self.wait_for("generation A's workers to finish", lambda: self._members(GEN_A) == 0, 90)
        self.figures["hup_to_gen_a_detached_s"] = round(self.now() - hup, 2)
        self.mark("generation A's workers finished and detached")
        time.sleep(t.gen_b_s)

        self.phase = "stop"
        self.load_stop.set()
        self.mark("load stopped: running requests finish", "load stops")
        load.join(timeout=120)
        self.wait_for("running = waiting = 0", lambda: self._counts() == (0, 0), 30)
        time.sleep(0.5)
        self.stop_sampling.set()
        self.final_checks(sidecar2)

    # --- helpers over the segment ------------------------------------------------------
    def _legacy_arrived(self) -> bool:
        stats = self.http.get(f"{self.upstream_url}/_drill/stats").json()
        return int(stats["total"]["legacy"]) == self.legacy_sent

    def _source(self) -> str | None:
        got = self.provider_doc()
        return None if got is None else str(got[0]["source"])

    def _limit(self) -> tuple[int, str] | None:
        got = self.provider_doc()
        return None if got is None else (got[0]["effective_limit"], got[0]["source"])

    def _counts(self) -> tuple[int, int] | None:
        got = self.provider_doc()
        return None if got is None else (got[0]["running"], got[0]["waiting"])

    def _epoch(self) -> int:
        out = self.cli("availability", "--segment", self.segment, "--json")
        sidecar = json.loads(out.stdout).get("sidecar") or {}
        return int(sidecar.get("writer_epoch", 0))

    def _members(self, generation: str) -> int:
        got = self.provider_doc()
        if got is None:
            return 0
        return sum(1 for m in got[1].members if m.alive and m.generation == generation)

    def _router(self, action: str) -> None:
        out = self.cli(
            "router", action, "w2", "--key-file", str(self.key_file), "--url", self.router_url
        )
        if out.returncode != 0:
            raise DrillFailed(f"router {action} w2 failed: {out.stderr.strip()}")

    # --- checks ---------------------------------------------------------------------------
    def final_checks(self, sidecar: subprocess.Popen[bytes]) -> None:
        inspect = json.loads(self.cli("inspect", "--segment", self.segment, "--json").stdout)
        p = next(x for x in inspect["providers"] if x["id"] == PROVIDER)
        left = [h for h in inspect["holders"]]
        if p["running"] or p["waiting"] or left:
            self.problems.append(
                f"left behind: running {p['running']}, waiting "
                f"{p['waiting']}, holder records {len(left)}"
            )
        counters = p["counters"]
        stats = self.http.get(f"{self.upstream_url}/_drill/stats").json()
        events = self.http.get(f"{self.upstream_url}/_drill/events").json()
        o = self.outcomes
        # nothing lost: the segment, the upstream and the clients agree exactly
        if counters["admitted_total"] != stats["total"]["admitted"]:
            self.problems.append(
                f"admitted {counters['admitted_total']} in the segment, "
                f"{stats['total']['admitted']} at the upstream"
            )
        if stats["total"]["admitted"] != o.ok or stats["completed"]["admitted"] != o.ok:
            self.problems.append(
                f"upstream saw {stats['total']['admitted']} admitted "
                f"requests, clients got {o.ok} whole answers"
            )
        if counters["rejected_total"] != o.rejected:
            self.problems.append(
                f"rejected {counters['rejected_total']} in the segment, "
                f"{o.rejected} 429s at the clients"
            )
        if o.lost:
            self.problems.append(f"requests lost or failed: {dict(o.errors)}")
        if counters["peak_waiting"] > 32:
            self.problems.append(f"peak waiting {counters['peak_waiting']} > 32")
        if counters["peak_running"] > 20:
            self.problems.append(f"peak running {counters['peak_running']} > 20")
        if o.rejected == 0:
            self.problems.append("no overflow was answered 429 (the drill must provoke it)")
        self.check_inflight(events)
        self.check_running()
        # stop the gateway: its workers' lifespan shutdown detaches them
        master = self.procs["gateway"]
        master.send_signal(signal.SIGTERM)
        code = master.wait(timeout=60)
        if code != 0:
            self.problems.append(f"gunicorn exited {code}")
        view = self.provider_doc()
        members = [] if view is None else [m for m in view[1].members if m.alive]
        if members:
            self.problems.append(f"{len(members)} handler processes still registered")
        sidecar.send_signal(signal.SIGTERM)
        if sidecar.wait(timeout=30) != 0:
            self.problems.append("the sidecar did not exit 0 on SIGTERM")
        self.check_key_never_logged()
        self.figures.update(
            {
                "admitted": counters["admitted_total"],
                "rejected": counters["rejected_total"],
                "timeouts": counters["timeouts_total"],
                "cancelled": counters["cancelled_total"],
                "peak_running": counters["peak_running"],
                "peak_waiting": counters["peak_waiting"],
                "upstream_peak_inflight": stats["peak"]["admitted"],
                "legacy_requests": stats["total"]["legacy"],
                "legacy_ok": o.legacy_ok,
                "client_ok": o.ok,
                "client_429": o.rejected,
                "lost": o.lost,
                "dropped_by_reload_before_admission": sum(o.dropped_by_reload.values()),
                "final_running": p["running"],
                "final_waiting": p["waiting"],
                "holder_records_left": len(left),
                "registered_after_stop": len(members),
                "samples": len(self.samples),
                "cli_samples": self.cli_checks,
            }
        )

    def check_inflight(self, events: list[list[Any]]) -> None:
        """R-A1 at the upstream, exactly, from its log of in-flight changes and the grants.

        Each admitted request reaches the upstream with its grant (the middleware's
        ``x-gateway-capacity-grant``: when it arrived and when it was admitted, on the
        host's monotonic clock; its slot was granted at some instant of that interval).
        At a rise to ``v``, the ``v`` requests in flight all hold slots; the one granted
        last was granted while the others already ran, so R-A1 says ``v`` is at most the
        limit in force at that grant. Which one was last is not known, so the check is
        that ``v`` is within the highest limit in force during any of their
        [asked, granted] intervals. The limit in force over an interval is read from the
        observer's samples: those inside it, the last one before it and the first one
        after it (a change between two samples shows in the next one). Load delays the
        request on its way to the upstream, but no longer moves the time it is judged at.
        """
        import bisect

        times = [s.t for s in self.samples]
        limits = [s.limit for s in self.samples]
        if not times:
            self.problems.append("no samples")
            return

        def highest_limit(start: float, end: float) -> int:
            lo = max(bisect.bisect_left(times, start) - 1, 0)
            hi = min(bisect.bisect_right(times, end) + 1, len(times))
            return max(limits[lo:hi])

        in_flight: dict[int, tuple[float, float]] = {}
        rises = previous = 0
        for _, kind, value, request, asked, granted in events:
            if kind != "admitted":
                continue
            rising, previous = value > previous, value
            if not rising:
                in_flight.pop(request, None)
                continue
            if asked is None or granted is None:
                self.problems.append(
                    f"admitted request {request} reached the upstream ungranted (no grant header)"
                )
                return
            in_flight[request] = (asked - self.t0, granted - self.t0)
            rises += 1
            allowed = max(highest_limit(a, g) for a, g in in_flight.values())
            if value > allowed:
                newest = max(g for _, g in in_flight.values())
                self.problems.append(
                    f"upstream in flight rose to {value} above the limit in force at its "
                    f"grants ({allowed}), newest grant at {newest:.2f}s (R-A1)"
                )
                return
        self.figures["upstream_rises_checked"] = rises

    def check_key_never_logged(self) -> None:
        """R-P7: the provider's key reaches the upstream, but no log of any process."""
        key = self.key_file.read_text().strip()
        leaked = [p.name for p in self.tmp.glob("*.log") if key in p.read_text(errors="replace")]
        if leaked:
            self.problems.append(f"the provider key appears in: {', '.join(sorted(leaked))}")

    def check_running(self) -> None:
        """Running rises only within the limit in force (R-A1): above it, it may only go down.

        Between two samples either sample's limit may have been in force when the rise
        happened, so a rise is checked against the higher of the two.
        """
        for prev, cur in itertools.pairwise(self.samples):
            if cur.running > prev.running and cur.running > max(prev.limit, cur.limit):
                self.problems.append(
                    f"running rose to {cur.running} above limit {cur.limit} at {cur.t:.1f}s"
                )
                return
        overlap = [
            s
            for s in self.samples
            if s.by_generation.get(GEN_A, 0) and s.by_generation.get(GEN_B, 0)
        ]
        self.figures["overlap_samples_A_and_B_running"] = len(overlap)
        self.figures["peak_inflight_by_phase"] = {
            ph: max(s.inflight for s in self.samples if s.phase == ph)
            for ph in dict.fromkeys(s.phase for s in self.samples)
        }
        self.figures["limits_by_phase"] = {
            ph: sorted({s.limit for s in self.samples if s.phase == ph})
            for ph in dict.fromkeys(s.phase for s in self.samples)
        }

    # --- tear-down ------------------------------------------------------------------------
    def cleanup(self) -> list[str]:
        from shm_layout.segment import doorbells_of

        self.bells = doorbells_of(self.segment) if self.segment else []  # while registered
        self.stop_sampling.set()
        self.load_stop.set()
        self.legacy_stop.set()
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)  # its own session: gunicorn + workers
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        from shm_layout.segment import objects_left, unlink_segment

        if self.segment:
            unlink_segment(self.segment)
        left = [f"{name} pid {p.pid}" for name, p in self.procs.items() if p.poll() is None]
        if self.segment:
            left += objects_left(self.segment, self.bells)
        return left


def plot(drill: Drill, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = drill.samples
    t = [x.t for x in s]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(12, 7), dpi=110, sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    colours = {GEN_A: "tab:blue", GEN_B: "tab:green"}
    top.step(t, [x.limit for x in s], where="post", color="black", lw=2.2, label="limit in force")
    top.plot(
        t,
        [x.inflight for x in s],
        color="tab:red",
        lw=1.0,
        label="in flight at the upstream (admitted)",
    )
    top.plot(
        t,
        [x.legacy_inflight for x in s],
        color="tab:gray",
        lw=1.4,
        ls=":",
        label="in flight at the upstream (legacy, not admitted)",
    )
    for gen in (GEN_A, GEN_B):
        top.plot(
            t,
            [x.by_generation.get(gen, 0) for x in s],
            color=colours[gen],
            lw=1.4,
            label=f"running, {gen}",
        )
    top.set_ylabel("running / in flight")
    top.set_ylim(-1, 24)
    bottom.plot(t, [x.waiting for x in s], color="tab:orange", lw=2.0, label="waiting (all)")
    for gen in (GEN_A, GEN_B):
        bottom.plot(
            t,
            [x.waiting_by_generation.get(gen, 0) for x in s],
            color=colours[gen],
            lw=1.0,
            ls="--",
            label=f"waiting, {gen}",
        )
    bottom.axhline(32, color="tab:orange", lw=0.8, ls="-.", label="queue bound (32)")
    bottom.set_ylabel("waiting")
    bottom.set_ylim(-1, 36)
    bottom.set_xlabel("seconds since the drill started")
    for ax in (top, bottom):
        for when, _, tag in drill.marks:
            if tag:
                ax.axvline(when, color="0.7", lw=0.7)
        ax.legend(loc="upper left", fontsize=7, bbox_to_anchor=(1.01, 1.0))
    for when, _, tag in drill.marks:
        if tag:
            top.annotate(
                tag, (when, 23.5), rotation=90, fontsize=7, va="top", ha="right", color="0.3"
            )
    top.set_title("Upgrade drill: one admission budget across legacy, generation A and B")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description="The upgrade drill (issue 12 section 2).")
    ap.add_argument("--short", action="store_true", help="the short form (make test)")
    ap.add_argument("--plot", type=Path, help="write the timeline as a PNG here")
    ap.add_argument(
        "--json", action="store_true", help="timeline on stderr, the summary as JSON on stdout"
    )
    args = ap.parse_args()
    out = sys.stderr if args.json else sys.stdout
    drill = Drill(args.short, out)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        drill.run()
    except DrillFailed as exc:
        drill.problems.append(str(exc))
    except KeyboardInterrupt:
        drill.problems.append("interrupted")
    finally:
        left = drill.cleanup()
        signal.signal(signal.SIGTERM, previous)
    if left:
        drill.problems.append(f"not cleaned up: {', '.join(left)}")
    if args.plot and drill.samples:
        plot(drill, args.plot)
    summary = {
        "form": "short" if args.short else "long",
        "duration_s": round(drill.now(), 1),
        "marks": [[round(t, 1), text] for t, text, _ in drill.marks],
        **drill.figures,
        "cleaned_up": not left,
        "problems": drill.problems,
        "ok": not drill.problems,
    }
    print("\nsummary", file=out)
    for key, value in summary.items():
        if key != "marks":
            print(f"  {key}: {value}", file=out)
    print("  result: " + ("OK" if summary["ok"] else "FAILED"), file=out)
    if not summary["ok"]:
        for name in ("sidecar-1", "sidecar-2", "gateway", "legacy"):
            tail = drill.log_of(name)[-1500:]
            if tail:
                print(f"\n--- {name} log (tail) ---\n{tail}", file=sys.stderr)
    shutil.rmtree(drill.tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
