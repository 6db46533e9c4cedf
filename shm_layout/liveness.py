"""Is the process that wrote a record still the one running under that pid? (R-A5)

A record names its owner by pid *and* process start time, so a recycled pid
never keeps a dead process's slots alive. The start time is an opaque value
only compared for equality: on Linux the ``starttime`` field of
``/proc/PID/stat`` (clock ticks since boot, read directly because it is three
times cheaper than psutil and checked often), elsewhere psutil's
``create_time()``. A zombie counts as dead.
"""

from __future__ import annotations

import errno
import os
import sys

_LINUX = sys.platform.startswith("linux")


def _linux_start(pid: int) -> float | None:
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Any other error (EMFILE, EACCES...) propagates: not knowing is not "dead".
    try:
        data = os.read(fd, 1024)
    finally:
        os.close(fd)
    # comm may contain spaces and parentheses: fields start after the last ')'
    tail = data[data.rfind(b")") + 2 :].split()
    if len(tail) < 20 or tail[0] in (b"Z", b"X"):
        return None
    return float(int(tail[19]))


def _psutil_start(pid: int) -> float | None:
    import psutil  # off Linux only: a handler on Linux never loads it

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
    return _linux_start(pid) if _LINUX else _psutil_start(pid)


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
        hidden = _LINUX and not os.path.exists(f"/proc/{pid}")
        return someone_elses or (hidden and _exists(pid))
    return now == start


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True


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
