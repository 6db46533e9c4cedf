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

The lock file's directory is ``$GATEWAY_CAPACITY_LOCK_DIR``, else the platform's
default (``platform.default_lock_dir``: ``/dev/shm`` on Linux, shared exactly like
the segment, also under systemd's ``PrivateTmp=``). A directory another user can
write is refused unless it is sticky; the file itself is created exclusively with
its mode set on the descriptor, and an existing one is used only when its owner
(and group) is one the segment trusts (``owners``, R-G6).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Sequence

from shm_layout import _core, layout, platform
from shm_layout.errors import CoreError as CoreError
from shm_layout.errors import ForeignObject
from shm_layout.layout import HEADER
from shm_layout.owners import OwnerPolicy, check_directory

FORCE_LOCK_FILE_ENV = platform.FORCE_LOCK_FILE_ENV
LOCK_DIR_ENV = platform.LOCK_DIR_ENV


class LockSetupError(Exception):
    """The lock target cannot be used (its message says what to fix)."""


def kind_for_new_segment() -> int:
    if platform.lock_file_forced():
        return layout.LOCK_FILE
    return layout.LOCK_ROBUST if _core.HAVE_ROBUST else layout.LOCK_FILE


def lock_file_path(segment: str) -> str:
    return os.path.join(platform.lock_dir(), segment.lstrip("/") + ".lock")


STAMP_AT = layout.STAMP_AT  # offset of the stamp in the lock file


def stamp(buf: mmap.mmap | bytes) -> bytes:
    """What ties a lock file to its segment: the creator's fields of the header."""
    fields = ("created_at", "creator_pid", "creator_start")
    return b"gwcap-lock:" + b"".join(HEADER[k].codec.pack(HEADER[k].get(buf)) for k in fields)


def prepare(buf: mmap.mmap, segment: str, kind: int, mode: int, policy: OwnerPolicy) -> None:
    """At creation, before the init mark: make the lock usable for everyone to come."""
    if kind == layout.LOCK_ROBUST:
        _core.init_mutex(buf, layout.MUTEX_OFFSET)
    else:
        ensure_lock_file(segment, mode, stamp(buf), policy)


def ensure_lock_file(segment: str, mode: int, mark: bytes, policy: OwnerPolicy) -> str:
    """Create the segment's lock file, or take over one left by an earlier segment of the
    same name, only when it is ours; then stamp it with this segment (R-G6)."""
    path = lock_file_path(segment)
    directory = os.path.dirname(path)
    try:
        check_directory(os.path.realpath(directory), policy, "lock")
    except ForeignObject as exc:
        raise LockSetupError(f"{exc}; or set ${LOCK_DIR_ENV}") from None
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    created = True
    try:
        # Exclusively, with a mode the umask can only narrow; the final mode is set on the
        # descriptor (never by changing the process umask, which other threads share).
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        fd, created = _replace_lock_file(path, flags, policy)
    except OSError as exc:
        raise LockSetupError(
            f"cannot create the lock file {path} ({exc.strerror}); set ${LOCK_DIR_ENV} to a "
            "directory every process of this gateway can write"
        ) from None
    try:
        info = os.fstat(fd)
        if not created:
            problem = "is not a regular file" if not stat.S_ISREG(info.st_mode) else None
            problem = problem or policy.problem(info)
            if problem is not None:  # checked before anything is written to it
                raise LockSetupError(
                    f"lock file {path} {problem}: another user made it first, or the wrong "
                    f"owner is configured. Remove it (as root if need be) once you know who "
                    f"made it, or set ${LOCK_DIR_ENV} to a directory of this service's own"
                )
        os.fchmod(fd, mode)
        if policy.gid is not None and info.st_gid != policy.gid:
            os.fchown(fd, -1, policy.gid)
        os.pwrite(fd, mark, STAMP_AT)  # attachers check it (see open_core)
    except OSError as exc:
        raise LockSetupError(
            f"cannot write the lock file {path} ({exc.strerror}); set ${LOCK_DIR_ENV} to a "
            "directory every process of this gateway can write"
        ) from None
    finally:
        if created:
            os.close(fd)  # a new file: no lock of this process lives on it yet
        else:
            _kept.append(fd)  # see _replace_lock_file: closing it could drop our locks
    return path


# Descriptors of lock files taken over rather than replaced (_replace_lock_file), kept
# open for the life of the process: closing one would drop every record lock this
# process holds on that file.
_kept: list[int] = []


def _replace_lock_file(path: str, flags: int, policy: OwnerPolicy) -> tuple[int, bool]:
    """A lock file is already under the name: one left by an earlier instance of the
    segment (removed by hand, or abandoned before its init mark), whose processes may
    still lock through it, this one among them. Replace it: looked at by ``lstat`` only
    (to open and close a descriptor of a file would drop every record lock this process
    holds on it, its member locks in the old instance included), then unlinked and
    created anew, so that two instances never share lock bytes (R-A5, R-A15). One of
    another user's is refused untouched (R-G6). One this user may not unlink (the
    configured other owner's, in a sticky directory) is taken over as before, its
    descriptor kept open. Returns (descriptor, created)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise LockSetupError(_lock_file_refusal(path, exc)) from None
    if info is not None:
        if stat.S_ISLNK(info.st_mode):
            raise LockSetupError(_lock_file_refusal(path, OSError(errno.ELOOP, "symlink")))
        problem = "is not a regular file" if not stat.S_ISREG(info.st_mode) else None
        problem = problem or policy.problem(info)
        if problem is not None:
            raise LockSetupError(
                f"lock file {path} {problem}: another user made it first, or the wrong "
                f"owner is configured. Remove it (as root if need be) once you know who "
                f"made it, or set ${LOCK_DIR_ENV} to a directory of this service's own"
            )
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except PermissionError:
            try:
                return os.open(path, flags), False
            except OSError as exc:
                raise LockSetupError(_lock_file_refusal(path, exc)) from None
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
    except OSError as exc:
        raise LockSetupError(
            f"lock file {path} was made again while this process replaced it "
            f"({exc.strerror}): another process races for the name; find out which, or set "
            f"${LOCK_DIR_ENV} to a directory of this service's own"
        ) from None


def _lock_file_refusal(path: str, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return (
            f"lock file {path} is a symbolic link: refused (another user may have planted "
            "it). Remove the link, or set $GATEWAY_CAPACITY_LOCK_DIR to a directory of this "
            "service's own"
        )
    return f"cannot open the lock file {path} ({exc.strerror}): remove it, or set ${LOCK_DIR_ENV}"


def check_lock_file(segment: str, policy: OwnerPolicy) -> None:
    """An attacher's look at the lock file before the core opens it: ours, or refused."""
    path = lock_file_path(segment)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return  # the core says it is gone, with the recovery
    except OSError as exc:
        raise LockSetupError(f"cannot look at the lock file {path}: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise LockSetupError(_lock_file_refusal(path, OSError(errno.ELOOP, "symlink")))
    problem = policy.problem(info)
    if problem is not None:
        raise LockSetupError(
            f"lock file {path} {problem}: refusing to lock through it. Remove it once you "
            f"know who made it, or set ${LOCK_DIR_ENV}"
        )


def _target(segment: str, kind: int) -> tuple[str, bool]:
    if kind == layout.LOCK_ROBUST:
        return segment, True
    return lock_file_path(segment), False


def open_core(
    segment: str,
    buf: mmap.mmap,
    kind: int,
    policy: OwnerPolicy | None = None,
    identity: tuple[int, int] | None = None,
) -> _core.Core:
    """The compiled core for a writable mapping of ``segment``. ``policy``: whose
    doorbells it may post (R-G6); ``identity``: (device, inode) of the object mapped, for
    noticing that the name leads elsewhere (R-A15)."""
    policy = policy or OwnerPolicy.for_process()
    target, is_shm = _target(segment, kind)
    mark = stamp(buf) if kind == layout.LOCK_FILE else b""
    if kind == layout.LOCK_FILE:
        check_lock_file(segment, policy)
    try:
        return _core.Core(
            buf,
            layout.core_offsets(),
            kind,
            target,
            is_shm,
            segment,
            mark,
            platform.core_flags(),
            policy.uids,
            -1 if policy.gid is None else policy.gid,
            identity,
        )
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
