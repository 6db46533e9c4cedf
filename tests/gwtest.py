"""Helpers for the cross-process tests (imported as ``gwtest``)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from handler_shim import Admission

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "tests" / "agent.py"
LOCK_FILE_ENV = "GATEWAY_CAPACITY_LOCK_FILE"
NO_TIMEOUT_ENV = "GATEWAY_CAPACITY_NO_SEM_TIMEOUT"
# The product's packages, as pyproject.toml installs them: what the repo checks scan.
INSTALLED_PACKAGES: tuple[str, ...] = tuple(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
)


class Agent:
    """One tests/agent.py process; its JSON events arrive on a queue."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        command: list[str] | None = None,
    ) -> None:
        self.proc = subprocess.Popen(
            command or [sys.executable, str(AGENT), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._pump, daemon=True).start()

    @classmethod
    def from_command(cls, command: list[str]) -> Agent:
        """An agent started by a wrapper (``unshare ... python tests/agent.py ...``)."""
        return cls([], command=command)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                self.events.put({"event": "garbage", "line": line})
        self.events.put({"event": "eof"})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, event: str | tuple[str, ...], timeout: float = 15.0) -> dict[str, Any]:
        """The next event named ``event`` (or any of a tuple of names), skipping others."""
        wanted = (event,) if isinstance(event, str) else event
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"agent {self.pid}: no {event!r} within {timeout}s: {self.seen}"
                )
            try:
                ev = self.events.get(timeout=remaining)
            except queue.Empty:
                continue
            self.seen.append(ev)
            if ev["event"] in wanted:
                return ev
            if ev["event"] == "eof":
                err = self.proc.stderr.read() if self.proc.stderr else ""
                code = self.proc.wait(timeout=10)
                raise AssertionError(
                    f"agent {self.pid} ended (exit {code}) before {event!r}: {self.seen} {err}"
                )

    def has_seen(self, event: str) -> bool:
        """Whether ``event`` has arrived by now (reads what is queued, waits for nothing)."""
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                break
            self.seen.append(ev)
        return any(ev["event"] == event for ev in self.seen)

    def send(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def finish(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        return self.proc.wait(timeout=timeout)


@dataclass
class P1Segment:
    """A fresh segment and the config its handlers attach with: one provider, p1, with a
    static limit (what most admission tests stand on). Start handler processes on it
    with :meth:`handler`, attach this process with :meth:`attach`."""

    name: str
    config: Path
    agents: Callable[..., Agent]

    def handler(self, *args: str) -> Agent:
        """A handler process (tests/agent.py) of this segment: ``handler("hold")``."""
        return self.agents("--segment", self.name, "--config", str(self.config), *args)

    def locker(self, how: str = "lock") -> Agent:
        """A handler process inside the segment lock, never to leave it (``scribble``: it
        wrote counters that are wrong first)."""
        agent = self.handler(how)
        agent.expect("locked")
        return agent

    def attach(self, generation: str) -> Admission:
        """This process attached to the segment as ``generation`` (the test closes it)."""
        from handler_shim import Admission

        return Admission.attach(config=self.config, segment=self.name, generation=generation)


_C = TypeVar("_C")


def core_hooks(core: _C) -> _C:
    """``core`` (a ``_core.Core``) for a test that drives its test entry points
    (``hold_lock``, ``abandon``, ``die_in_section``): only a test build has them."""
    from shm_layout import _core

    if not _core.TEST_HOOKS:
        raise RuntimeError(
            "this test needs the admission core's test entry points (hold_lock, abandon, "
            "die_in_section), and this core was built without them: rebuild it with "
            "GATEWAY_CAPACITY_TEST_HOOKS=1 (make test and make check do)"
        )
    return core


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run the installed ``gateway-capacity`` as an operator would."""
    exe = Path(sys.executable).with_name("gateway-capacity")
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


# What a test's environment may carry that a process it starts must not take for its own:
# systemd's notify socket and watchdog, a segment override.
SCRUBBED = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "GATEWAY_CAPACITY_SEGMENT")


def scrubbed_env(**added: str) -> dict[str, str]:
    """The test's environment for a process it starts: without ``SCRUBBED``, with ``added``."""
    return {**{k: v for k, v in os.environ.items() if k not in SCRUBBED}, **added}


def start_sidecar(
    config: Path,
    segment: str,
    log: Path,
    *extra: str,
    refresh: float,
    prefix: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``gateway-capacity sidecar`` of a test on ``config`` and ``segment``, every
    ``refresh`` s, its output added to ``log``; ``extra``: more of its options; ``prefix``:
    a wrapper such as faketime; ``env``: its environment (:func:`scrubbed_env`'s)."""
    exe = str(Path(sys.executable).with_name("gateway-capacity"))
    argv = [*prefix, exe, "sidecar", "--config", str(config), "--segment", segment]
    with open(log, "ab") as err:
        return subprocess.Popen(
            [*argv, "--refresh", str(refresh), *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=scrubbed_env() if env is None else env,
        )


def availability(segment: str) -> dict[str, Any]:
    out = run_cli("availability", "--segment", segment, "--json")
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def provider_of(doc: dict[str, Any], provider: str) -> dict[str, Any]:
    """The provider's entry of an ``availability --json`` document (it must be there)."""
    for p in doc["providers"]:
        if p["id"] == provider:
            return dict(p)
    raise AssertionError(f"no provider {provider}")


def provider_doc(segment: str, provider: str = "p1") -> dict[str, Any]:
    return provider_of(availability(segment), provider)


def run_together(script: str, count: int, *args: str, timeout: float = 60) -> list[Any]:
    """``count`` Python processes started at once on ``script`` with ``args``: each must
    exit 0 having printed one JSON document; the documents, in the order started."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    return results


Thing = TypeVar("Thing")


@contextmanager
def stopped_at_exit(stop: Callable[[Thing], object]) -> Iterator[Callable[[Thing], Thing]]:
    """For a fixture that starts things on demand (servers, processes): ``keep(thing)``
    returns ``thing``, and ``stop(thing)`` is called for each one kept, in the order
    kept, when the block ends (the fixture's teardown)."""
    started: list[Thing] = []

    def keep(thing: Thing) -> Thing:
        started.append(thing)
        return thing

    try:
        yield keep
    finally:
        for thing in started:
            stop(thing)


def kill_under_faketime(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a process started under the ``faketime`` wrapper and the program it runs
    (the wrapper forks it: killing the wrapper alone leaves the program running), then
    remove what libfaketime left in /dev/shm for the wrapper."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    remove_faketime_state(proc.pid)


def remove_faketime_state(pid: int) -> None:
    """What libfaketime left in /dev/shm for process ``pid``: the ``faketime`` wrapper, and
    any process it is preloaded into without one, makes a shared-memory object and a
    semaphore named after its pid and removes them only when it exits by itself. Call it
    once ``pid`` has ended, however it ended."""
    for name in (f"faketime_shm_{pid}", f"sem.faketime_sem_{pid}"):
        Path("/dev/shm", name).unlink(missing_ok=True)


class _NotMet(AssertionError):
    """A wait ran out of time (and not an assertion inside the predicate)."""


def wait_for(
    predicate: Callable[[], Any], timeout: float = 10.0, every: float = 0.02, what: str = ""
) -> Any:
    """Poll until ``predicate()`` is truthy and return it; fail the test after ``timeout``
    (naming ``what`` when given)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            if what:
                raise _NotMet(f"{what}: not within {timeout:g}s")
            raise _NotMet(f"condition not met within {timeout} s")
        time.sleep(every)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, every: float = 0.02) -> bool:
    """Like :func:`wait_for`, but answers False after ``timeout`` for the test to assert."""
    try:
        return bool(wait_for(predicate, timeout, every))
    except _NotMet:
        return False


def free_port() -> int:
    """A port nothing listens on now (127.0.0.1, bound and released): for "refused" tests."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# --- another local user (R-G6) --------------------------------------------------------------
NOBODY = "nobody"


def _nobody_ids() -> tuple[int, int]:
    import pwd

    import pytest

    try:
        entry = pwd.getpwnam(NOBODY)
    except KeyError:
        pytest.skip("no user 'nobody' on this machine")
    if os.geteuid() != 0:
        pytest.skip("playing another user needs root")
    return entry.pw_uid, entry.pw_gid


def _become(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def as_nobody(fn: Callable[[], int]) -> tuple[int, str]:
    """Run ``fn`` in a forked child that has become the user nobody: (exit code, output).

    The attacker is a real process of another uid, not a mock. This interpreter lives
    under /root, which nobody may not read, so the child cannot start a new Python; it
    keeps the modules this process has imported already (import what ``fn`` needs
    before calling this).
    """
    uid, gid = _nobody_ids()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 70
        try:
            _become(uid, gid)
            sys.stdout = sys.stderr = os.fdopen(write, "w")  # not pytest's capture
            code = fn()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        output = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output


def segment_made_by_nobody(name: str) -> None:
    """Segment ``name``, created by the user nobody (owner-only): another user's segment."""
    from shm_layout.segment import Segment

    def make() -> int:
        Segment.open(name).close()
        return 0

    code, output = as_nobody(make)
    assert code == 0, output


class NobodyProcess:
    """A process of the user nobody that runs ``fn`` and then stays alive until stopped
    (a squatter that keeps a lock, or a live pid, for as long as a test needs it)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        uid, gid = _nobody_ids()
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child
            try:
                _become(uid, gid)
                fn()
                os.write(write, b"ready\n")
                while True:
                    time.sleep(60)
            except BaseException:
                import traceback

                os.write(write, traceback.format_exc().encode())
            finally:
                os._exit(70)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            first = f.readline().decode()
        if first != "ready\n":
            self.stop()
            raise AssertionError(f"the nobody process failed: {first}")

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        os.waitpid(self.pid, 0)


def publish_token_budget(
    adm: Any, *, limit: int, tokens: int, per_request: int, provider: str = "p1"
) -> None:
    """What a sidecar publishes for ``provider``: the limit and the token budget, for 25 s,
    written through ``adm``'s segment under an epoch of this process."""
    from shm_layout import layout, writer

    seg = adm._seg
    epoch = writer.take_epoch(seg, os.getpid(), 0.0, time.time(), 1.0, "test")
    now = time.time()
    publication = writer.Publication(
        provider,
        True,
        4,
        layout.Source.PROVIDER,
        limit=limit,
        reason="published by the test",
        observed_at=now - 5.0,
        expires_at=now + 25.0,
        token_limit=tokens,
        request_token_limit=per_request,
    )
    writer.publish(seg, epoch, 1, "ok", [publication], now)
