"""What a test session starts ends with it, however the session ends (imported as ``owned``).

Each pytest process (the one of ``-n 0``, and each xdist worker and their controller)
calls :func:`own_what_starts` as it is configured. It puts ``GWCAP_TEST_OWNER=<token>``
in its environment, so every process it starts through ``subprocess`` (and every
process those start: gunicorn's workers, a wrapper's program) carries the token in
``/proc/PID/environ``; and it starts a reaper, ``python tests/owned.py --reap TOKEN FD``,
in a session of its own, holding the read end of a pipe whose write end only the
pytest process holds. However the pytest process ends (its last hook, a crash, a
SIGKILL), the pipe reads end-of-file, and the reaper SIGKILLs every process that
carries the token, removes what libfaketime left in /dev/shm for them, and exits.

At the session's end :func:`sweep_leftovers` does the same in process first and
names what it killed (a test that left a process running is a bug of that test), and
at the start :func:`sweep_orphans` kills what carries the token of a pytest process
that is gone (its reaper killed with it, ``kill -9`` of the whole tree).

What it cannot reach: a process started with an environment of the test's own making
without the token (``env={"PATH": ...}``; extend ``os.environ`` instead), and one
forked without an exec (``/proc/PID/environ`` is the forking process's at its start).
Linux only (``/proc``); elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

OWNER_ENV = "GWCAP_TEST_OWNER"
_PROC = Path("/proc")
_write_end: int | None = None  # held by the pytest process until it ends


def _start_time(pid: int) -> str | None:
    """Process ``pid``'s start time (clock ticks after boot), or None when it is gone."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def token_of(pid: int) -> str | None:
    """The owner token in process ``pid``'s environment (None without one, or gone)."""
    try:
        environ = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    prefix = f"{OWNER_ENV}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def _owner_alive(token: str) -> bool:
    """A token is ``PID.START.RANDOM``: its owner lives while that pid has that start."""
    pid, start, _ = [*token.split("."), "", ""][:3]
    return pid.isdigit() and _start_time(int(pid)) == start


def _pids() -> list[int]:
    me = os.getpid()
    return [int(p.name) for p in _PROC.iterdir() if p.name.isdigit() and int(p.name) != me]


def kill_carrying(wanted: str | None = None) -> list[str]:
    """SIGKILL every process that carries ``wanted`` (None: any token whose owner is
    gone), until none is left (a process may start another as it is killed); what
    libfaketime left for each is removed. Their command lines, one a process."""
    killed: list[str] = []
    pids: list[int] = []
    for _ in range(20):
        found = []
        for pid in _pids():
            token = token_of(pid)
            if token is None:
                continue
            if (wanted is None and not _owner_alive(token)) or token == wanted:
                found.append(pid)
        if not found:
            break
        for pid in found:
            with contextlib.suppress(OSError):
                cmdline = (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ")
                os.kill(pid, signal.SIGKILL)
                killed.append(f"pid {pid}: {cmdline.decode(errors='replace').strip()}")
                pids.append(pid)
        time.sleep(0.05)
    for pid in pids:
        for name in (f"faketime_shm_{pid}", f"sem.faketime_sem_{pid}"):
            Path("/dev/shm", name).unlink(missing_ok=True)
    return killed


def _own_token() -> str | None:
    return os.environ.get(OWNER_ENV) if _write_end is not None else None


def own_what_starts() -> None:
    """Tag what this process starts with a token of its own, and start its reaper."""
    global _write_end
    if _write_end is not None or not _PROC.joinpath("self", "environ").exists():
        return
    me = os.getpid()
    token = f"{me}.{_start_time(me)}.{secrets.token_hex(4)}"
    read_end, write_end = os.pipe()  # neither inherited by what the tests start
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}
    subprocess.Popen(
        [sys.executable, __file__, "--reap", token, str(read_end)],
        pass_fds=(read_end,),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a kill of this process group does not reach it
    )
    os.close(read_end)
    os.environ[OWNER_ENV] = token
    _write_end = write_end


def sweep_leftovers() -> list[str]:
    """Kill what this process started that still runs; what was killed, to be named."""
    token = _own_token()
    return [] if token is None else kill_carrying(token)


def let_go() -> None:
    """The session's last word: its reaper reads end-of-file now, sweeps, and exits."""
    global _write_end
    if _write_end is not None:
        os.close(_write_end)
        _write_end = None


def sweep_orphans() -> list[str]:
    """Kill what carries the token of a pytest process that is gone."""
    return kill_carrying(None) if _PROC.joinpath("self", "environ").exists() else []


def _reap(token: str, fd: int) -> None:
    """The reaper: wait for end-of-file on ``fd`` (its owner ended), then kill what
    carries ``token``."""
    while True:
        try:
            if not os.read(fd, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    kill_carrying(token)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--reap":
        _reap(sys.argv[2], int(sys.argv[3]))
