"""Every difference between the hosts we run on, in one place (R-A10).

Linux and macOS differ in what their kernels offer the segment: the lock
(a robust mutex needs Linux), timed semaphore waits (macOS has none), futexes,
how shared-memory objects are listed (``/dev/shm`` on Linux, nothing on macOS),
``posix_fallocate``, how often an object may be ``ftruncate``d (once on macOS),
``/proc``, whether a shared-memory object's mode can be changed after it was made
(Linux: ``fchmod`` on the descriptor; macOS: never, XNU's shm objects have no chmod, so
the mode is given at creation, where XNU applies no umask), how a named semaphore's
owner is seen (a file in ``/dev/shm`` on Linux; not at all on macOS), whether a
shared-memory object has a device and inode (not on macOS), and where the lock file
lives. Watching ``--parent-pid`` is the same poll on both (see below). Everything
else in the project asks this module; nothing else calls a Linux-only function
(``tests/repo/test_platform_names.py`` keeps it so).

``GATEWAY_CAPACITY_PLATFORM=darwin`` (for tests only) makes this module behave
as on macOS while running on Linux: the macOS answers everywhere, and the
calls macOS does not have raise :class:`NotOnThisPlatform` instead of quietly
working, so a Linux-only call that slips into shared code fails the suite. The
compiled core is told the same (``core_flags``). What the test mode cannot be is a
macOS kernel: the calls that do exist on both (``shm_open``, ``sem_open``, ``fcntl``
record locks, ``mmap``) run Linux's implementation; docs/macos.md says what only a Mac
can confirm, and ``make mac-check`` confirms it there.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Final

from shm_layout.errors import NotOnThisPlatform as NotOnThisPlatform

PLATFORM_ENV: Final = "GATEWAY_CAPACITY_PLATFORM"
FORCE_LOCK_FILE_ENV: Final = "GATEWAY_CAPACITY_LOCK_FILE"
FORCE_NO_TIMEOUT_ENV: Final = "GATEWAY_CAPACITY_NO_SEM_TIMEOUT"
LOCK_DIR_ENV: Final = "GATEWAY_CAPACITY_LOCK_DIR"

SHM_DIR: Final = "/dev/shm"  # Linux: where POSIX shared memory and semaphores live


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


def shared_memory_identity(info: os.stat_result) -> tuple[int, int] | None:
    """(device, inode) of a shared-memory object from its ``fstat``, or None where the
    platform gives it none: macOS's fstat of a shm object fills in mode, owner, group and
    size only (XNU ``pshm_stat``), so every object there is device 0, inode 0. The segment
    is then told by its creation stamp instead (``segment.py``, ``_core.c``)."""
    if is_darwin() or (info.st_dev == 0 and info.st_ino == 0):
        return None
    return info.st_dev, info.st_ino


def shared_memory_create_mode(mode: int) -> int:
    """The mode to create a shared-memory object with (``O_CREAT|O_EXCL``), given the mode
    it must end with. Linux applies the process umask at creation (the object is a file
    in /dev/shm), so it is made 0600, which a umask can only narrow, and given ``mode``
    on the descriptor after (:func:`set_shared_memory_mode`). macOS applies no umask
    (XNU's ``shm_open`` stores the mode as given) and can never change it later: the
    final mode at once."""
    return mode if sys.platform == "darwin" else 0o600


def set_shared_memory_mode(fd: int, mode: int, gid: int | None) -> None:
    """Give a shared-memory object this process just created its final mode and group.

    Linux: ``fchmod``/``fchown`` on the descriptor. macOS has neither for a shm object
    (EINVAL: XNU registers no chmod or chown for it): the mode was given at creation
    (:func:`shared_memory_create_mode`) and the group is the creator's effective group,
    so a group-shared segment whose configured group is another one cannot be made
    there: :class:`NotOnThisPlatform` says what to do instead. The darwin test mode on
    Linux sets the mode here, standing in for macOS's mode-at-creation (Linux's umask
    narrowed it), and refuses the ``fchown`` as macOS would."""
    if is_darwin():
        if gid is not None and gid != os.getegid():
            raise NotOnThisPlatform(
                f"macOS cannot give a shared-memory object another group than its "
                f"creator's (gid {os.getegid()}, wanted {gid}): start the process that "
                "creates the segment with that group as its effective group, or use the "
                "default group"
            )
        if sys.platform != "darwin":
            os.fchmod(fd, mode)  # the test mode: what creating with ``mode`` gives on macOS
        return
    os.fchmod(fd, mode)
    if gid is not None and os.fstat(fd).st_gid != gid:
        os.fchown(fd, -1, gid)


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


def proc_start_ticks(pid: int) -> float | None:
    """Linux: the ``starttime`` field of ``/proc/PID/stat`` (clock ticks since boot), an
    opaque start time three times cheaper than psutil's; None when there is no such live
    process (gone, or a zombie). Other errors (EMFILE, EACCES...) propagate: not knowing
    is not "dead". Raises :class:`NotOnThisPlatform` where there is no /proc."""
    try:
        fd = os.open(proc_path(str(pid), "stat"), os.O_RDONLY)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        data = os.read(fd, 1024)
    finally:
        os.close(fd)
    # comm may contain spaces and parentheses: fields start after the last ')'
    tail = data[data.rfind(b")") + 2 :].split()
    if len(tail) < 20 or tail[0] in (b"Z", b"X"):
        return None
    return float(int(tail[19]))


def tcp_socket_tables() -> list[str] | None:
    """Linux: the text of ``/proc/net/tcp`` and ``/proc/net/tcp6`` (the kernel's table of
    TCP sockets, with each one's owner); None where there is no such thing (macOS, or a
    /proc that cannot be read): a listener's owner cannot be checked there."""
    if not has_proc():
        return None
    texts = []
    for name in ("tcp", "tcp6"):
        try:
            with open(proc_path("net", name), encoding="ascii", errors="replace") as f:
                texts.append(f.read())
        except FileNotFoundError:
            continue  # tcp6 is absent on a kernel without IPv6
        except OSError:
            return None
    return texts or None


_CAP_SYS_PTRACE = 19


def sees_all_procs() -> bool:
    """Does this process hold CAP_SYS_PTRACE (which sees through ``hidepid``)? Linux:
    the ``CapEff`` mask of ``/proc/self/status``; elsewhere there is no hidepid: True."""
    if not has_proc():
        return True
    try:
        with open(proc_path("self", "status"), encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError):
        pass
    return False


def proc_mount_options() -> list[str] | None:
    """The options of the /proc mount on top (``/proc/self/mountinfo``), or None where
    there is no /proc (macOS). Raises ``OSError`` when it cannot be read."""
    if not has_proc():
        return None
    with open(proc_path("self", "mountinfo"), encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    options: list[str] = []
    for line in lines:  # the last /proc mount is the one on top
        fields = line.split()
        if len(fields) > 4 and fields[4] == "/proc" and " - proc " in line:
            options = line.rsplit(" ", 1)[-1].split(",")
    return options


# The parent of ``--parent-pid`` is watched the same way everywhere: by polling, from a
# loop that runs twice a second anyway. Not Linux's PR_SET_PDEATHSIG: it fires when the
# parent *thread* that forked us ends, not the process (a gateway that starts the sidecar
# from a short-lived thread would lose it, and its SIGTERM exit 0 would read as
# "superseded" to the supervisor). Not macOS's kqueue EVFILT_PROC/NOTE_EXIT either: a
# second mechanism that only a Mac could run, for no gain over a 0.5 s poll.


# --- the lock file's directory -------------------------------------------------------------
MACOS_LOCK_DIR: Final = "/var/tmp"


def default_lock_dir() -> str:
    """Where lock files live unless ``$GATEWAY_CAPACITY_LOCK_DIR`` says otherwise: one
    directory that every process of every user on the host names the same way, whatever
    its environment, and that nothing empties while the segment lives.

    Linux: ``/dev/shm`` (shared exactly like the segment, also under systemd's
    ``PrivateTmp=``; sticky, so a file there is owner-checked, never trusted by name).
    macOS: ``/var/tmp`` (sticky and shared like ``/dev/shm``). Not ``/tmp``: macOS's
    daily cleaner (``/etc/periodic/daily/110.clean-tmps``; ``tmp_cleaner`` since macOS 14)
    deletes files there not accessed and not modified for 3 days, and a lock file is
    neither while the gateway runs: after three quiet days new handlers would find it
    gone. Not ``$TMPDIR``: per user and per environment (a process started without it
    would lock another file), and emptied the same way after 3 days. Not a directory used
    only "when it exists": two processes could then disagree. docs/macos.md has the
    sources."""
    if not is_darwin():
        return SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp"
    return MACOS_LOCK_DIR


def lock_dir() -> str:
    return os.environ.get(LOCK_DIR_ENV) or default_lock_dir()
