"""The segment lock and holder liveness: kernel-held, never guessed (R-A5, R-A6, R-A11).

The lock and every admission step under it live in the compiled core
(``_core.c``, whose comment is the full story); this module chooses the lock's
kind when a segment is created, finds its lock target, and opens the core.

Two kinds, recorded in the header so that every process of a segment uses the
same one:

* ``LOCK_ROBUST`` (Linux): a process-shared robust mutex in the header. When its
  owner dies the kernel hands it to the next waiter with ``EOWNERDEAD``; a live
  owner keeps it however long it is paused. Members (registered processes) hold
  an OFD record lock on byte ``1 + m`` of the shm object itself.
* ``LOCK_FILE`` (macOS, where a ``shm_open`` descriptor cannot be locked and robust
  mutexes do not exist): an fcntl record lock on byte 0 of a lock file beside the
  segment, members on bytes ``1 + m`` of the same file. Set
  ``GATEWAY_CAPACITY_LOCK_FILE=1`` to use it on Linux (the tests run both).

Either way a record is alive exactly while its owner's member byte is locked,
which the kernel undoes when the process dies, and never because of a pid: a
process paused for minutes, or in another PID namespace, is alive; a recycled
pid cannot make a dead one look alive.

The lock file's directory is ``$GATEWAY_CAPACITY_LOCK_DIR``, else ``/dev/shm``
where it exists (it is shared exactly like the segment, also under systemd's
``PrivateTmp=``), else ``/tmp``.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Sequence

from shm_layout import _core, ipc, layout
from shm_layout.layout import HEADER

FORCE_LOCK_FILE_ENV = "GATEWAY_CAPACITY_LOCK_FILE"
LOCK_DIR_ENV = "GATEWAY_CAPACITY_LOCK_DIR"

CoreError = _core.CoreError


class LockSetupError(Exception):
    """The lock target cannot be used (its message says what to fix)."""


def kind_for_new_segment() -> int:
    if os.environ.get(FORCE_LOCK_FILE_ENV, "") not in ("", "0"):
        return layout.LOCK_FILE
    return layout.LOCK_ROBUST if _core.HAVE_ROBUST else layout.LOCK_FILE


def lock_file_path(segment: str) -> str:
    directory = os.environ.get(LOCK_DIR_ENV) or (
        "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    )
    return os.path.join(directory, segment.lstrip("/") + ".lock")


STAMP_AT = 4096  # offset of the stamp in the lock file (_core.c reads it there)


def stamp(buf: mmap.mmap | bytes) -> bytes:
    """What ties a lock file to its segment: the creator's fields of the header."""
    fields = ("created_at", "creator_pid", "creator_start")
    return b"gwcap-lock:" + b"".join(HEADER[k].codec.pack(HEADER[k].get(buf)) for k in fields)


def prepare(buf: mmap.mmap, segment: str, kind: int, mode: int) -> None:
    """At creation, before the init mark: make the lock usable for everyone to come."""
    if kind == layout.LOCK_ROBUST:
        _core.init_mutex(buf, layout.MUTEX_OFFSET)
    else:
        ensure_lock_file(segment, mode, stamp(buf))


def ensure_lock_file(segment: str, mode: int, mark: bytes) -> str:
    path = lock_file_path(segment)
    try:
        with ipc.exact_mode(mode):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        raise LockSetupError(
            f"cannot open the lock file {path} ({exc.strerror}); set ${LOCK_DIR_ENV} to a "
            "directory every process of this gateway can write"
        ) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode):
            os.pwrite(fd, mark, STAMP_AT)  # attachers check it (see open_core)
    except OSError as exc:
        raise LockSetupError(
            f"cannot write the lock file {path} ({exc.strerror}); set ${LOCK_DIR_ENV} to a "
            "directory every process of this gateway can write"
        ) from None
    finally:
        os.close(fd)  # no lock is held through it yet; the core keeps its own descriptor
    if not stat.S_ISREG(info.st_mode) or info.st_mode & stat.S_IRWXO:
        raise LockSetupError(
            f"lock file {path} is not a private regular file (mode {info.st_mode & 0o777:o}); "
            "remove it and let gateway-capacity create it again"
        )
    return path


def _target(segment: str, kind: int) -> tuple[str, bool]:
    if kind == layout.LOCK_ROBUST:
        return segment, True
    return lock_file_path(segment), False


def open_core(segment: str, buf: mmap.mmap, kind: int) -> _core.Core:
    """The compiled core for a writable mapping of ``segment``."""
    target, is_shm = _target(segment, kind)
    mark = stamp(buf) if kind == layout.LOCK_FILE else b""
    try:
        return _core.Core(buf, layout.core_offsets(), kind, target, is_shm, segment, mark)
    except CoreError as exc:
        if kind == layout.LOCK_FILE and not os.path.exists(target):
            raise LockSetupError(
                f"its lock file {target} is gone (removed by hand or by a cleaner of "
                f"{os.path.dirname(target)}); stop this gateway's handlers and sidecar, then "
                f"'gateway-capacity inspect --segment {segment} --unlink --force' and start "
                "them again"
            ) from None
        raise LockSetupError(str(exc)) from None


def members_alive(
    segment: str, kind: int, members: Sequence[tuple[int, int]], mark: bytes = b""
) -> list[bool]:
    """For readers: is the process registered as each (member, serial) alive?

    When the lock target cannot be opened, or (with ``mark``, the segment's
    :func:`stamp`) is not the file the segment was created with, the answer is
    "alive" for all: not knowing is never "dead" (R-A5).
    """
    if not members:
        return []
    target, is_shm = _target(segment, kind)
    try:
        return list(_core.probe(target, is_shm, kind, list(members), mark))
    except CoreError:
        return [True] * len(members)


def kind_name(kind: int) -> str:
    return layout.LOCK_KINDS.get(kind, f"unknown({kind})")
