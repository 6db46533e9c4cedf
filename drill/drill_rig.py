"""The drill's world: real processes on loopback, and what a scenario does with them.

A :class:`Drill` starts the simulated workers, the router, the fake upstream and
the config (:meth:`Drill.setup`), then gunicorn generations and sidecars on
demand; it keeps the timeline (:meth:`Drill.say`, :meth:`Drill.mark`), reads the
segment the way an operator does, and removes everything at the end
(:meth:`Drill.cleanup`). A scenario (``upgrade_drill.upgrade``) is the order in
which it calls these; the observer, the load, the checks and the plot are the
modules beside this one (``drill_observer``, ``drill_load``, ``drill_checks``,
``drill_plot``); what they record is ``drill_records``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any, TextIO

import httpx
from drill_records import DrillFailed, Outcomes, Sample

ROOT = Path(__file__).resolve().parent.parent
EXE = str(Path(sys.executable).with_name("gateway-capacity"))
PROVIDER = "local-inference"
MODEL_ALIAS = "local-workhorse"
MODEL = "workhorse"
# How long a CLI the drill runs may take. At load 40 on two cores the CLI's start alone
# took over 30 s; a CLI is given the time it needs, and the drill waits on its effect.
CLI_TIMEOUT_S = 180.0


def _no_control_socket() -> list[str]:
    """No control socket: newer gunicorns put one at ~/.gunicorn/gunicorn.ctl, shared by every
    gunicorn of the user, and the drill runs two masters at once. The 23.x that
    ``litellm[proxy]`` pins has neither the socket nor the option."""
    from gunicorn.config import KNOWN_SETTINGS

    flag = "--no-control-socket"
    return [flag] if any(flag in (s.cli or ()) for s in KNOWN_SETTINGS) else []


GUNICORN = [sys.executable, "-m", "gunicorn", "-k", "uvicorn.workers.UvicornWorker"]
GUNICORN += _no_control_socket()


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
    def of(cls, *, short: bool) -> Timing:
        if short:
            return cls(3, 4, 4, 4, 5, 4, 6, clients=36, legacy_clients=4, burst=30)
        return cls(8, 10, 15, 12, 20, 15, 25, clients=40, legacy_clients=6, burst=40)


def listening_socket() -> socket.socket:
    """A socket listening on 127.0.0.1, port 0, for a server process to inherit."""
    sock = socket.create_server(("127.0.0.1", 0), backlog=256)  # SO_REUSEADDR on POSIX
    sock.set_inheritable(True)
    return sock


class Drill:
    def __init__(self, *, short: bool, out: TextIO) -> None:
        self.timing = Timing.of(short=short)
        self.short = short
        self.provider = PROVIDER  # the config's one provider, opted in to discovery
        self.model_alias = MODEL_ALIAS  # what the load asks for
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
        self.cli_unfinished = 0  # CLI checks past the time a CLI is given (not judged)
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

    def mark(self, text: str, tag: str = "", at: float | None = None) -> None:
        """A line of the timeline (and a tag on the plot) at ``at``, drill seconds (now)."""
        self.marks.append((self.now() if at is None else at, text, tag))
        self.say(f"--- {text}" + ("" if at is None else f" (at {at:.2f}s)"))

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

    def cli(self, *args: str, stop: threading.Event | None = None) -> CompletedProcess[str]:
        """``gateway-capacity ARGS``, as an operator runs it, given the time it needs."""
        return self.cli_finished(self.cli_started(*args), stop=stop)

    def cli_started(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [EXE, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )

    def cli_finished(
        self, proc: subprocess.Popen[str], stop: threading.Event | None = None
    ) -> CompletedProcess[str]:
        """Wait for a CLI the drill started: up to ``CLI_TIMEOUT_S`` (a slow CLI on a loaded
        machine judges the machine, not the product: past that the run is inconclusive, a
        :class:`DrillFailed` that says so), or until ``stop`` is set (then it is killed and
        its answer is exit status -9)."""
        deadline = time.monotonic() + CLI_TIMEOUT_S
        while True:
            try:
                out, err = proc.communicate(timeout=0.25)
                return CompletedProcess(proc.args, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                stopped = stop is not None and stop.is_set()
                if not stopped and time.monotonic() < deadline:
                    continue
                proc.kill()
                out, err = proc.communicate()
                if stopped:
                    return CompletedProcess(proc.args, -9, out, err)
                argv = proc.args if isinstance(proc.args, list) else [proc.args]
                what = " ".join(str(a) for a in argv[1:3])
                raise DrillFailed(
                    f"inconclusive: `gateway-capacity {what}` took over {CLI_TIMEOUT_S:g} s "
                    "(the machine was too slow for the drill to judge)"
                ) from None

    def wait_for(self, what: str, predicate: Callable[[], object], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise DrillFailed(f"timed out after {timeout:g} s waiting for {what}")

    # --- set-up -------------------------------------------------------------------------
    def setup(self) -> None:
        """Key file, two simulated workers, the router, the fake upstream, the config."""
        self.key_file = self.tmp / "provider.key"
        fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
        simworkers = [sys.executable, str(ROOT / "drill" / "simworkers.py")]
        workers = self.spawn(
            "simworkers", [*simworkers, "--count", "2", "--slots", "10"], stdout=subprocess.PIPE
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
        serve = [EXE, "router", "serve", "--workers", str(registry)]
        serve += ["--key-file", str(self.key_file), "--listen", "127.0.0.1:0", "--poll", "0.25"]
        router = self.spawn("router", serve, stdout=subprocess.PIPE)
        assert router.stdout is not None
        line = router.stdout.readline().decode()
        if not line.startswith("serving "):
            raise DrillFailed(f"the router did not start: {self.log_of('router')}")
        self.router_url = line.split()[1].removesuffix("/v1/capacity")
        sock = listening_socket()
        self.upstream_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        upstream = [sys.executable, str(ROOT / "drill" / "fake_upstream.py")]
        upstream += ["--fd", str(sock.fileno()), "--key-file", str(self.key_file)]
        upstream += ["--router", self.router_url, "--chunk-s", "0.2"]
        self.spawn("upstream", upstream, pass_fds=(sock.fileno(),))
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
        """The example gateway's ``app`` under gunicorn (2 workers), labelled
        ``generation`` by its config file (a HUP rereads it); its URL once healthy."""
        sock = listening_socket()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        pidfile = self.tmp / f"{name}.pid"
        conf = self.tmp / f"{name}.conf.py"
        env_lines = [f"GATEWAY_GENERATION={generation}"] if generation else []
        conf.write_text(f"raw_env = {env_lines!r}\n")
        args = [*GUNICORN, "-w", "2", "--bind", f"fd://{sock.fileno()}"]
        args += ["--chdir", str(ROOT / "examples"), "--pid", str(pidfile), "-c", str(conf)]
        args += ["--graceful-timeout", "60", "--keep-alive", "2", app]
        self.spawn(name, args, env=self.gateway_env(), pass_fds=(sock.fileno(),))
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
            name, [EXE, "sidecar", "--config", str(self.config), "--refresh", "0.5", *extra]
        )

    def router(self, action: str, limit: int, worker: str = "w2") -> float:
        """``gateway-capacity router fence|unfence WORKER``, as an operator runs it, and its
        effect: the drill time at which the discovered ``limit`` was first seen (see
        :meth:`limit_seen`). The wait is on the effect, for as long as the CLI may take; the
        CLI must then have exited 0."""
        asked = self.now()
        proc = self.cli_started(
            "router", action, worker, "--key-file", str(self.key_file), "--url", self.router_url
        )
        try:
            seen = self.limit_seen(limit, asked, CLI_TIMEOUT_S, gave_up=proc.poll)
        except DrillFailed as exc:
            proc.kill()
            out = self.cli_finished(proc)
            raise DrillFailed(f"router {action} {worker}: {exc}: {out.stderr.strip()}") from None
        out = self.cli_finished(proc)
        if out.returncode != 0:
            raise DrillFailed(f"router {action} {worker} exited {out.returncode}: {out.stderr}")
        return seen

    # --- the segment and the upstream, as the phases ask ---------------------------------
    def provider_doc(self) -> tuple[dict[str, Any], Any] | None:
        """The provider's ``availability --json`` entry (built in process) and the view."""
        from gateway_capacity.cmd_views import availability_doc
        from shm_layout.errors import SegmentError
        from shm_layout.view import read_view

        try:
            view = read_view(self.segment)
        except SegmentError:
            return None
        doc = availability_doc(view)
        for p in doc["providers"]:
            if p["id"] == self.provider:
                return p, view
        return None

    def upstream_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.http.get(f"{self.upstream_url}/_drill/stats").json()
        return stats

    def legacy_arrived(self) -> bool:
        """Every legacy request sent has reached the upstream."""
        return int(self.upstream_stats()["total"]["legacy"]) == self.legacy_sent

    def source(self) -> str | None:
        got = self.provider_doc()
        return None if got is None else str(got[0]["source"])

    def limit(self) -> tuple[int, str] | None:
        got = self.provider_doc()
        return None if got is None else (got[0]["effective_limit"], got[0]["source"])

    def limit_seen(
        self,
        limit: int,
        since: float,
        timeout: float,
        gave_up: Callable[[], int | None] = lambda: None,
    ) -> float:
        """Wait until the segment holds the discovered ``limit``; the drill time at which a
        read that saw it first began, this wait's or the observer's, not before ``since``.
        ``gave_up`` is the exit status of what was to bring the change (None while it runs):
        one that exited non-zero without it ends the wait at once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            began = self.now()
            if self.limit() == (limit, "discovered"):
                seen = [s.t for s in self.samples[-100:] if s.t >= since and s.limit == limit]
                return min([began, *seen])
            code = gave_up()
            if code:
                raise DrillFailed(f"exited {code} before the limit became {limit}")
            time.sleep(0.05)
        raise DrillFailed(f"timed out after {timeout:g} s waiting for limit {limit}")

    def counts(self) -> tuple[int, int] | None:
        got = self.provider_doc()
        return None if got is None else (got[0]["running"], got[0]["waiting"])

    def epoch(self) -> int:
        """The sidecar's writer epoch (R-G4), read in process (the CLI's view of it is the
        observer's, :func:`drill_observer.check_cli`)."""
        got = self.provider_doc()
        sidecar = None if got is None else got[1].sidecar
        return 0 if sidecar is None else int(sidecar.writer_epoch)

    def members(self, generation: str) -> int:
        got = self.provider_doc()
        if got is None:
            return 0
        return sum(1 for m in got[1].members if m.alive and m.generation == generation)

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
