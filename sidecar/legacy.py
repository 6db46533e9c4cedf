"""The legacy drain (R-G3): which processes ``--await-legacy`` waits for, and whether
a pidfile naming them can be trusted.

``parse_legacy`` turns each ``PID|PIDFILE`` into a process (pid and start time,
so a reused pid never counts), refusing what could never end (init, the sidecar,
its parent) and a pidfile another user could have written (R-G6, as OpenSSH
trusts a key). The daemon prunes the list every housekeeping turn and publishes
``legacy_drain`` while any lives (``sidecar.limits``).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shm_layout import platform
from shm_layout.liveness import is_alive, process_start
from sidecar.startup import StartupError
from sidecar.trust import file_owner_problem, path_problem

log = logging.getLogger("gateway_capacity.sidecar")


@dataclass
class Legacy:
    label: str
    pid: int
    start: float


def parse_legacy(
    specs: Sequence[str],
    grace_s: float = 0.0,
    proc_hides: str | None = None,
    forbidden: Mapping[int, str] | None = None,
    trusted: Sequence[int] = (),
) -> list[Legacy]:
    """``--await-legacy PID|PIDFILE``: the processes to wait for, by pid and start time.

    A pidfile that names a process no longer running, or one started after the
    file was last written (its pid was reused), means the legacy process has
    already exited: a sidecar restarted after the upgrade must not wait for an
    unrelated process. A pidfile *path* that does not exist is a typo until
    proven otherwise: it must appear within ``grace_s`` seconds, or start-up
    fails (a drain that silently drains nothing is worse than no start).

    ``proc_hides`` (see :func:`proc_hides_other_users`) says that /proc hides
    other users' processes: a pid that ``kill(pid, 0)`` finds but /proc does
    not show is then awaited, never taken for exited.

    A pidfile is trusted only as OpenSSH trusts a key (R-G6): owned
    by root or this user, not writable by group or others, and in directories
    nobody else can change (:mod:`sidecar.trust`); else another user could
    hold every opted-in provider at 0 by writing a pid into it. ``trusted``: the
    uids the operator named with ``--owner`` (the segment may be theirs), also
    trusted for the pidfile and its directories: a legacy gateway writes it as its
    own user in its own ``RuntimeDirectory=``, and that user could hold the
    providers through the segment anyway. ``forbidden``
    maps pids that may never be awaited (pid 1, the sidecar, its parent: a
    drain that only they could end) to a phrase naming them; see
    :func:`forbidden_legacy_pids`.
    """
    forbidden = forbidden if forbidden is not None else forbidden_legacy_pids(None)
    out = []
    for spec in specs:
        written: float | None = None
        if spec.isdigit():
            pid = int(spec)
        else:
            try:
                text, written = _read_pidfile(spec, grace_s, trusted)
            except FileNotFoundError:
                raise StartupError(
                    f"--await-legacy {spec}: no such pidfile (waited {grace_s:g}s; a typo? "
                    "if the legacy process has already exited, remove --await-legacy)"
                ) from None
            except (OSError, UnicodeDecodeError) as exc:
                raise StartupError(f"--await-legacy {spec}: cannot read pidfile: {exc}") from None
            if not text.isdigit():
                raise StartupError(f"--await-legacy {spec}: pidfile does not hold a pid")
            pid = int(text)
        if pid in forbidden:
            named = "pidfile names" if written is not None else "names"
            raise StartupError(
                f"--await-legacy {spec}: {named} pid {pid}, {forbidden[pid]}: a drain that "
                "only its exit could end (refused)"
            )
        try:
            start = process_start(pid)
        except OSError:
            start = None  # exists, but we may not read it: decided by kill() below
        if start is None:
            if not _exists(pid):
                log.info(
                    "legacy process %s is not running; not waiting for it",
                    legacy_label(spec, pid),
                )
                continue
            # kill() finds it, /proc does not show it (or not its start time): it
            # runs as another user behind hidepid / ProtectProc=invisible.
            log.warning(
                "legacy process %s exists but /proc does not show it%s: waiting for it, "
                "and taking it for exited only when kill(pid, 0) no longer finds it",
                legacy_label(spec, pid),
                f" ({proc_hides})" if proc_hides else "",
            )
            out.append(Legacy(spec, pid, _UNSEEN_START))
            continue
        if written is not None and _started_after(pid, written):
            log.info(
                "legacy pidfile %s names pid %d, which started after the file was written "
                "(a reused pid): not waiting for it",
                spec,
                pid,
            )
            continue
        out.append(Legacy(spec, pid, start))
    return out


# The start time of a legacy process that /proc does not show: is_alive() then
# answers from kill(pid, 0) alone (it never compares a start it cannot read).
_UNSEEN_START = -1.0


def forbidden_legacy_pids(parent_pid: int | None) -> dict[int, str]:
    """Pids ``--await-legacy`` may never name: init, the sidecar itself, and its parent
    (the ``--parent-pid`` process and the real one): the sidecar outlives none of them,
    so a drain on them would never end while it runs."""
    forbidden = {os.getppid(): "the sidecar's parent"}
    if parent_pid is not None:
        forbidden[parent_pid] = "the --parent-pid process"
    forbidden[os.getpid()] = "the sidecar itself"
    forbidden[1] = "init (pid 1)"
    return forbidden


class UntrustedPidfile(StartupError):
    """An ``--await-legacy`` pidfile that another user could have written."""


def _read_pidfile(path: str, grace_s: float, trusted: Sequence[int] = ()) -> tuple[str, float]:
    """The pidfile's text and mtime, waiting up to ``grace_s`` for it to appear and to
    hold something.

    Raises :class:`UntrustedPidfile` when another user than root, this one or one of
    ``trusted`` could have written it (the file or a directory on its path).
    """
    deadline = time.monotonic() + grace_s
    announced = False
    while True:
        try:
            with open(path, encoding="ascii") as f:
                problem = path_problem(path, trusted=trusted) or _pidfile_problem(
                    os.fstat(f.fileno()), trusted
                )
                if problem is not None:
                    if " is owned by " in problem and not trusted:
                        problem += (
                            "; if that is the legacy gateway's user, name it with --owner USER "
                            "(the user group-shared mode trusts with the segment)"
                        )
                    raise UntrustedPidfile(f"--await-legacy {path}: pidfile not trusted: {problem}")
                text = f.read().strip()
                if text or time.monotonic() >= deadline:
                    return text, os.fstat(f.fileno()).st_mtime
            # Empty: made, not written yet (`echo $$ > file` and most daemons create it
            # first, then write). Taken for "no pid" it ended the start with exit 2,
            # which systemd never restarts (seen in the nspawn test under load).
            what = "is empty"
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise
            what = "does not exist yet"
        if not announced:
            announced = True
            log.info("legacy pidfile %s %s: waiting up to %gs", path, what, grace_s)
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _pidfile_problem(st: os.stat_result, trusted: Sequence[int] = ()) -> str | None:
    foreign = file_owner_problem(st, trusted=trusted)
    if foreign is not None:
        return f"it {foreign}"
    if st.st_mode & 0o022:
        return (
            f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            "run: chmod go-w on it"
        )
    return None


def _exists(pid: int) -> bool:
    """``kill(pid, 0)``: does any process (of any user) have this pid?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def proc_hides_other_users() -> str | None:
    """Why this process may not see other users' processes in /proc, or None (also where
    there is no /proc: macOS asks psutil, which sees every process).

    systemd's ``ProtectProc=invisible|noaccess|ptraceable`` and a manual
    ``mount -o hidepid=...`` both show as a ``hidepid=`` super option of the
    /proc mount. The kernel lets a process see through it with CAP_SYS_PTRACE,
    or when it is in the mount's ``gid=`` group (0 unless set): being uid 0 is
    not enough (a unit with ``CapabilityBoundingSet=`` and another group).
    """
    try:
        options = platform.proc_mount_options()
    except OSError as exc:
        return f"cannot read /proc/self/mountinfo ({exc.strerror or exc}) to check"
    if options is None:
        return None
    hidden = [
        o for o in options if o.startswith("hidepid=") and o not in ("hidepid=0", "hidepid=off")
    ]
    if not hidden:
        return None
    gids = [int(o[4:]) for o in options if o.startswith("gid=") and o[4:].isdigit()]
    exempt_gid = gids[-1] if gids else 0
    if exempt_gid == os.getegid() or exempt_gid in os.getgroups() or platform.sees_all_procs():
        return None
    return f"/proc is mounted with {hidden[-1]} (ProtectProc=?)"


def legacy_label(spec: str, pid: int) -> str:
    return f"pid {pid}" if spec == str(pid) else f"{spec} (pid {pid})"


def _started_after(pid: int, when: float) -> bool:
    import psutil

    try:
        return bool(psutil.Process(pid).create_time() > when + 1.0)
    except psutil.Error:
        return False


class LegacyDrain:
    """The legacy processes a sidecar waits for (R-G3), and since when.

    ``since`` is on the deadline clock (a stepped wall clock never moves it), for
    ``availability --check`` to tell a drain that outlasted ``max_s``.
    """

    def __init__(self, processes: list[Legacy], max_s: float) -> None:
        self.processes = processes
        self.max_s = max_s
        self.since = platform.deadline_now() if processes else 0.0
        self._began = time.monotonic()
        self._overdue_warned = False

    def __bool__(self) -> bool:
        return bool(self.processes)

    def __len__(self) -> int:
        return len(self.processes)

    def first_pid(self) -> int:
        return self.processes[0].pid if self.processes else 0

    def prune(self) -> bool:
        """Forget the processes that exited; True when the last one just did."""
        before = len(self.processes)
        self.processes = [x for x in self.processes if is_alive(x.pid, x.start)]
        return bool(before) and not self.processes

    def warn_if_overdue(self) -> None:
        """A drain that outlasts ``--await-legacy-max`` is a WARNING, once (R-G3);
        ``availability --check`` fails on it from the segment's header."""
        if not self.processes or self._overdue_warned:
            return
        lasted = time.monotonic() - self._began
        if lasted <= self.max_s:
            return
        self._overdue_warned = True
        waiting = ", ".join(legacy_label(x.label, x.pid) for x in self.processes)
        log.warning(
            "legacy drain has lasted %.0f min, over --await-legacy-max %g min: %s still "
            "runs and opted-in providers admit nothing new; stop it, or restart the sidecar "
            "without --await-legacy",
            lasted / 60,
            self.max_s / 60,
            waiting,
        )
