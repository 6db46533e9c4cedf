"""Is the process that wrote a record still the one running under that pid? (R-A5)

A record names its owner by pid *and* process start time, so a recycled pid
never keeps a dead process's slots alive. The start time is an opaque value
only compared for equality: where there is a /proc (Linux) the ``starttime``
field of ``/proc/PID/stat`` (``platform.proc_start_ticks``: clock ticks since
boot, three times cheaper than psutil and checked often), elsewhere (macOS, and
the darwin test mode) psutil's ``create_time()``. A zombie counts as dead.
"""

from __future__ import annotations

import errno
import os

from shm_layout import platform


def _psutil_start(pid: int) -> float | None:
    import psutil  # where there is no /proc only: a handler on Linux never loads it

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(proc.create_time())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied as exc:  # exists, but we may not look: not "dead"
        raise PermissionError(f"cannot read the start time of pid {pid}") from exc


def process_start(pid: int) -> float | None:
    """The start time of a living ``pid``, or None when there is no such (live) process."""
    if pid <= 0:
        return None
    return platform.proc_start_ticks(pid) if platform.has_proc() else _psutil_start(pid)


def my_identity() -> tuple[int, float]:
    pid = os.getpid()
    start = process_start(pid)
    if start is None:  # pragma: no cover - we are alive by definition
        raise RuntimeError("cannot read this process's own start time")
    return pid, start


def is_alive(pid: int, start: float) -> bool:
    """True when ``pid`` runs and is the same process that recorded ``start``.

    Errs on the side of "alive": taking a live process for dead would reclaim
    its slots or break the lock, while a dead one is simply found next time.
    """
    if pid <= 0:
        return False
    someone_elses = False
    try:
        os.kill(pid, 0)  # cheap first answer for the common "gone" case
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return False
        someone_elses = exc.errno == errno.EPERM  # exists, belongs to another user
    try:
        now = process_start(pid)
    except OSError:
        return True
    if now is None:
        # Invisible to us (hidepid on /proc) although kill() says it exists: alive.
        # kill() may succeed on a process /proc hides (CAP_KILL without CAP_SYS_PTRACE,
        # a non-dumpable process of our own user): ask it again rather than take a live
        # process for dead; a process that really exited is gone for this second ask.
        # A zombie (dead) is visible in /proc, with no start time: not asked again.
        hidden = platform.has_proc() and not os.path.exists(platform.proc_path(str(pid)))
        return someone_elses or (hidden and _exists(pid))
    return now == start


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True


class ParentWatch:
    """``--parent-pid``: is the process that started us gone? (the sidecar as a child of
    the gateway's supervisor, docs/macos.md).

    When the pid is our own parent, the answer is ``getppid()``: a child whose parent
    ends is handed to another (launchd or init, or a subreaper), at once and for good,
    so no pid reuse can fool it. Otherwise (started through a wrapper) the pid and its
    start time (:func:`is_alive`). Polled from the sidecar's housekeeping, twice a second,
    the same way on every platform (``platform.py`` says why not a death signal)."""

    def __init__(self, pid: int) -> None:
        start = process_start(pid)
        if start is None:
            raise ProcessLookupError(pid)
        self.pid = pid
        self.start = start
        self.direct = os.getppid() == pid

    def gone(self) -> bool:
        if self.direct:
            return os.getppid() != self.pid
        return not is_alive(self.pid, self.start)


class LivenessCache:
    """Answers :func:`is_alive` once per (pid, start) for the life of one sweep."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, float], bool] = {}

    def alive(self, pid: int, start: float) -> bool:
        key = (pid, start)
        answer = self._seen.get(key)
        if answer is None:
            answer = self._seen[key] = is_alive(pid, start)
        return answer
