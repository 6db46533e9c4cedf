"""Every difference between the hosts we run on, in one place (R-A10).

Linux and macOS differ in what their kernels offer the segment: the lock
(a robust mutex needs Linux), timed semaphore waits (macOS has none), futexes,
how shared-memory objects are listed (``/dev/shm`` on Linux, nothing on macOS),
``posix_fallocate``, how often an object may be ``ftruncate``d (once on macOS),
parent-death signals, ``/proc``, and how a named semaphore's owner is seen (a
file in ``/dev/shm`` on Linux; not at all on macOS). Everything else in the
project asks this module; nothing else calls a Linux-only function.

``GATEWAY_CAPACITY_PLATFORM=darwin`` (for tests only) makes this module behave
as on macOS while running on Linux: the macOS answers everywhere, and the
calls macOS does not have raise :class:`NotOnThisPlatform` instead of quietly
working, so a Linux-only call that slips into shared code fails the suite. The
compiled core is told the same (``core_flags``).
"""

from __future__ import annotations

import os
import stat
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Final

from shm_layout.errors import GatewayCapacityError

PLATFORM_ENV: Final = "GATEWAY_CAPACITY_PLATFORM"
FORCE_LOCK_FILE_ENV: Final = "GATEWAY_CAPACITY_LOCK_FILE"
FORCE_NO_TIMEOUT_ENV: Final = "GATEWAY_CAPACITY_NO_SEM_TIMEOUT"
LOCK_DIR_ENV: Final = "GATEWAY_CAPACITY_LOCK_DIR"

SHM_DIR: Final = "/dev/shm"  # Linux: where POSIX shared memory and semaphores live


class NotOnThisPlatform(GatewayCapacityError):
    """A call the platform (or the darwin test mode) does not have."""


def name() -> str:
    """``linux`` or ``darwin``: the real platform, or the test mode."""
    forced = os.environ.get(PLATFORM_ENV, "")
    if forced:
        if forced not in ("linux", "darwin"):
            raise NotOnThisPlatform(f"${PLATFORM_ENV} must be linux or darwin, not {forced!r}")
        if forced == "linux" and sys.platform != "linux":
            raise NotOnThisPlatform(f"${PLATFORM_ENV}=linux on {sys.platform}")
        return forced
    return "darwin" if sys.platform == "darwin" else "linux"


def is_darwin() -> bool:
    return name() == "darwin"


def _linux_only(what: str) -> None:
    if is_darwin():
        raise NotOnThisPlatform(f"{what} does not exist on macOS")


# --- the lock and waiting ---------------------------------------------------------------
def lock_file_forced() -> bool:
    """The lock-file kind of lock: macOS's only kind; on Linux when asked for (tests)."""
    return is_darwin() or os.environ.get(FORCE_LOCK_FILE_ENV, "") not in ("", "0")


def semaphore_timeouts() -> bool:
    """Can a thread wait on a semaphore with a timeout? (macOS: no ``sem_timedwait``.)"""
    if is_darwin() or os.environ.get(FORCE_NO_TIMEOUT_ENV, "") not in ("", "0"):
        return False
    import posix_ipc

    return bool(posix_ipc.SEMAPHORE_TIMEOUT_SUPPORTED)


def futex_waits() -> bool:
    """Can a waiting thread sleep on its record's state word itself? (Linux futexes)."""
    return not is_darwin() and sys.platform == "linux"


# Flags for the compiled core (``_core.Core(..., flags)``); the same bits in _core.c.
CORE_NO_FUTEX: Final = 1
CORE_NO_SEM_TIMEOUT: Final = 2
CORE_NO_SEM_OWNER: Final = 4  # a named semaphore's owner cannot be seen (macOS)


def core_flags() -> int:
    flags = 0
    if not futex_waits():
        flags |= CORE_NO_FUTEX
    if not semaphore_timeouts():
        flags |= CORE_NO_SEM_TIMEOUT
    if is_darwin():
        flags |= CORE_NO_SEM_OWNER
    return flags


# --- clocks -----------------------------------------------------------------------------
_DEADLINE_CLOCK: Final = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def deadline_now() -> float:
    """The host's deadline clock, the one the compiled core reads: monotonic, one clock
    for every process of the host, and counting time the host spent suspended (Linux
    ``CLOCK_BOOTTIME``; macOS ``CLOCK_MONOTONIC``, which counts sleep). A step of the
    wall clock (NTP at boot, an operator's ``date -s``) never moves it (R-L7)."""
    return time.clock_gettime(_DEADLINE_CLOCK)


# --- shared-memory objects ---------------------------------------------------------------
def list_shared_memory() -> list[str] | None:
    """Names (with the leading ``/``) of the host's POSIX shared-memory objects, or None
    where the platform cannot list them (macOS)."""
    if is_darwin():
        return None
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return None
    return ["/" + e for e in entries if not e.startswith("sem.")]


def shared_memory_stat(name: str) -> os.stat_result | None:
    """``lstat`` of a shared-memory object by name without opening it (Linux), or None
    where that cannot be done (macOS, or no such object)."""
    if is_darwin():
        return None
    try:
        return os.lstat(SHM_DIR + name)
    except OSError:
        return None


_sized: set[tuple[int, int]] = set()


def size_object(fd: int, size: int) -> None:
    """Give a new shared-memory object its size. macOS allows this once per object (a
    second ``ftruncate`` fails), so the darwin mode refuses a second one too."""
    if is_darwin():
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
        if key in _sized:
            raise NotOnThisPlatform("macOS allows one ftruncate per shared-memory object")
        _sized.add(key)
    os.ftruncate(fd, size)


def reserve(fd: int, size: int) -> bool:
    """Allocate the object's memory now (Linux ``posix_fallocate``), so a full
    ``/dev/shm`` is an error at creation instead of a SIGBUS at the first write. False
    where the platform has no way (macOS). Raises ``OSError`` (ENOSPC...)."""
    if is_darwin():
        return False
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:
        return False
    fallocate(fd, 0, size)
    return True


# --- named semaphores (doorbells) --------------------------------------------------------
def semaphore_path(name: str) -> str:
    """Linux: the file behind a named semaphore (glibc keeps them in /dev/shm)."""
    _linux_only("a named semaphore's file")
    return f"{SHM_DIR}/sem.{name.lstrip('/')}"


def semaphore_owner(name: str) -> tuple[int, int] | None:
    """(uid, gid) of a named semaphore, or None where that cannot be known (macOS)."""
    if is_darwin():
        return None
    try:
        info = os.lstat(semaphore_path(name))
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    return info.st_uid, info.st_gid


def set_semaphore_mode(name: str, mode: int, gid: int | None = None) -> bool:
    """Give a semaphore this process just created its final mode (and group), whatever
    the umask (sem_open applies the process umask). False where that cannot be done
    (macOS: the semaphore keeps what the umask allowed, 0600 at most; the process umask
    is never changed, so a grant from another user's process reaches a macOS waiter
    at its next tick instead of at once)."""
    if is_darwin():
        return False
    path = semaphore_path(name)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if gid is not None and os.fstat(fd).st_gid != gid:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return True


# --- processes ---------------------------------------------------------------------------
def has_proc() -> bool:
    return not is_darwin() and os.path.isdir("/proc/self")


def proc_path(*parts: str) -> str:
    """A path under /proc (Linux only)."""
    _linux_only("/proc")
    return "/".join(("/proc", *parts))


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` when the parent dies (Linux ``PR_SET_PDEATHSIG``).
    False where there is no such thing (macOS): the caller watches the parent instead."""
    if is_darwin() or sys.platform != "linux":
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    return bool(libc.prctl(pr_set_pdeathsig, sig, 0, 0, 0) == 0)


# --- the lock file's directory -------------------------------------------------------------
def default_lock_dir() -> str:
    """Where lock files live unless ``$GATEWAY_CAPACITY_LOCK_DIR`` says otherwise.

    Linux: ``/dev/shm`` (shared exactly like the segment, also under systemd's
    ``PrivateTmp=``; sticky, so a file there is owner-checked, never trusted by name).
    macOS: ``/var/run/gateway-capacity`` when it exists (created by the operator for a
    service, never cleaned), else ``$TMPDIR``/``/tmp`` (see docs/macos.md for why a
    directory of the service's own is better: the periodic cleaner)."""
    if not is_darwin():
        return SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp"
    if os.path.isdir("/var/run/gateway-capacity"):
        return "/var/run/gateway-capacity"
    return os.environ.get("TMPDIR") or "/tmp"


def lock_dir() -> str:
    return os.environ.get(LOCK_DIR_ENV) or default_lock_dir()
