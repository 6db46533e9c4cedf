"""ASGI apps under real servers (uvicorn, gunicorn), for the ASGI and LiteLLM tests
(imported as ``served``).

Each server gets a listening socket the test bound on 127.0.0.1 port 0 and passes as
an inherited file descriptor (``--fd`` / ``--bind fd://N``): the port is known before
the server starts and never raced for. Its output goes to a log file the test reads.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from gwtest import wait_until


def listening_socket(backlog: int = 128) -> socket.socket:
    """A socket listening on 127.0.0.1, port 0, that a child process may inherit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def gunicorn_no_control_socket() -> list[str]:
    """``--no-control-socket`` where this gunicorn has one (newer gunicorns open
    ``~/.gunicorn/gunicorn.ctl``, one path for every gunicorn of the user); the 23.x that
    ``litellm[proxy]`` pins has neither the socket nor the option."""
    from gunicorn.config import KNOWN_SETTINGS

    flag = "--no-control-socket"
    return [flag] if any(flag in (s.cli or ()) for s in KNOWN_SETTINGS) else []


def uvicorn_argv(app: str, app_dir: Path, sock: socket.socket, *options: str) -> list[str]:
    """``uvicorn APP`` from ``app_dir``, serving on the inherited ``sock``."""
    where = ("--app-dir", str(app_dir), "--fd", str(sock.fileno()))
    return [sys.executable, "-m", "uvicorn", app, *where, *options]


def gunicorn_argv(
    app: str, chdir: Path, sock: socket.socket, *options: str, workers: int = 1
) -> list[str]:
    """gunicorn with uvicorn workers running ``app`` from ``chdir`` on the inherited
    ``sock`` (never the per-user control socket); ``options`` go before the app."""
    return [
        *(sys.executable, "-m", "gunicorn", "-k", "uvicorn.workers.UvicornWorker"),
        *gunicorn_no_control_socket(),
        *("-w", str(workers), "--bind", f"fd://{sock.fileno()}", "--chdir", str(chdir)),
        *options,
        app,
    ]


def start(
    argv: Sequence[str],
    sock: socket.socket,
    log: Path,
    env: dict[str, str],
    *,
    cwd: Path | None = None,
    new_session: bool = False,
) -> subprocess.Popen[bytes]:
    """Run a server's ``argv`` with ``sock`` inherited and its output in ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            list(argv),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=(sock.fileno(),),
            cwd=cwd,
            start_new_session=new_session,
        )


@dataclass
class Served:
    """A server process, where it answers, and its log; ``group``: it leads a process
    group of its own (its workers), which :meth:`stop` signals as a whole."""

    proc: subprocess.Popen[bytes]
    base: str
    log: Path
    group: bool = False

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_healthy(
        self, paths: Sequence[str] = ("/healthz",), timeout: float = 30, every: float = 0.1
    ) -> None:
        """Until one of ``paths`` answers 200; fail with the log otherwise."""

        def up() -> bool:
            for path in paths:
                try:
                    if httpx.get(self.base + path, timeout=2).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
            return False

        assert wait_until(up, timeout=timeout, every=every), self.output()[-3000:]

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM, then SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()

    def _signal(self, sig: int) -> None:
        if self.group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)


def serve_app(
    argv_of: Callable[[socket.socket], Sequence[str]],
    log: Path,
    env: dict[str, str],
    *,
    cwd: Path | None = None,
    new_session: bool = False,
    backlog: int = 128,
) -> Served:
    """Bind a socket, start ``argv_of(socket)`` on it and hand the socket over."""
    sock = listening_socket(backlog)
    proc = start(argv_of(sock), sock, log, env, cwd=cwd, new_session=new_session)
    served = Served(proc, f"http://127.0.0.1:{sock.getsockname()[1]}", log, group=new_session)
    sock.close()
    return served


def wait_counts(
    counts: Callable[[], tuple[int, int]],
    expect: tuple[int, int],
    timeout: float = 10,
    every: float = 0.1,
) -> None:
    """Until ``counts()`` (running, waiting) is ``expect``; fail with the last three seen."""
    seen: list[tuple[int, int]] = []

    def check() -> bool:
        seen.append(counts())
        return seen[-1] == expect

    assert wait_until(check, timeout=timeout, every=every), f"want {expect}, last {seen[-3:]}"
