"""Create, attach and remove the segment (R-G2, R-G5, R-G6).

Create-or-attach is race-free: ``shm_open(O_CREAT|O_EXCL)`` decides the one
creator; it sizes the object, writes the header and the static tables, and
writes the init mark last. Everyone else opens the existing object and waits
(bounded) for the mark, then checks the magic and the major version. A
segment whose creator died before the mark is removed and created again.

The segment and its semaphores are never unlinked when a process exits
(unlike ``multiprocessing.shared_memory``, whose resource tracker does:
CPython gh-82300); only :func:`unlink_segment` removes them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
import time

import posix_ipc

from shm_layout import _core, ipc, layout, lock, names
from shm_layout.errors import GatewayCapacityError
from shm_layout.layout import HEADER, HOLDER, INIT_MARK, MAGIC, MAJOR, MEMBER, MINOR, PROVIDER
from shm_layout.liveness import is_alive, my_identity

log = logging.getLogger("gateway_capacity.segment")

INIT_WAIT_S = 2.0
CLOSE_WAIT_S = 2.0


class SegmentError(GatewayCapacityError):
    """Base of every segment problem; ``str()`` is one line saying what to do."""


class SegmentMissing(SegmentError):
    pass


class NotOurSegment(SegmentError):
    pass


class IncompatibleLayout(SegmentError):
    """The segment speaks another major layout version (R-G2)."""

    def __init__(self, name: str, found: tuple[int, int]) -> None:
        self.found = found
        super().__init__(
            f"segment {name} has layout {found[0]}.{found[1]}, this program speaks "
            f"{MAJOR}.{MINOR}: not compatible (different major version). Stop the other "
            f"generation, or once nothing uses it remove the segment with 'gateway-capacity "
            f"inspect --segment {name} --unlink --force'."
        )


class SegmentNotReady(SegmentError):
    pass


class UnsafePermissions(SegmentError):
    pass


class DamagedSegment(NotOurSegment):
    """Ours by its header, but its tables hold values no writer of ours produces."""


class Segment:
    """A mapped segment. Shared state changes only through ``self.core`` (the compiled
    core takes the lock for each step: Python never holds it)."""

    def __init__(self, name: str, buf: mmap.mmap, created: bool) -> None:
        self.name = name
        self.buf = buf
        self.created = created
        self.mode = (
            ipc.GROUP_SHARED
            if HEADER["flags"].get(buf) & layout.FLAG_GROUP_SHARED
            else ipc.OWNER_ONLY
        )
        self.lock_kind = HEADER["lock_kind"].get(buf)
        try:
            self.core: _core.Core = lock.open_core(name, buf, self.lock_kind)
        except lock.LockSetupError as exc:
            buf.close()
            raise SegmentError(f"segment {name}: {exc}") from None
        self._doorbells: dict[int, posix_ipc.Semaphore] = {}
        self._closed = False
        identity = _identity_of(name)
        self._identity = None if identity == _UNKNOWN else identity

    def still_named(self) -> bool:
        """Is the object under our name still the one we mapped? (No after an
        ``inspect --unlink --force`` and a re-creation by someone else.)"""
        if self._identity is None:
            return True  # could not tell at open: never claim it was replaced
        return _identity_of(self.name) in (self._identity, _UNKNOWN)

    # --- open ------------------------------------------------------------------------
    @classmethod
    def open(cls, name: str, *, create: bool = True, group_shared: bool = False) -> Segment:
        """Attach to ``name``; with ``create``, create it first if it does not exist."""
        names.check_segment_name(name)
        for _attempt in range(5):
            if create:
                buf = _try_create(name, group_shared)
                if buf is not None:
                    return cls(name, buf, created=True)
            try:
                return cls(name, _attach(name), created=False)
            except SegmentMissing:
                if not create:
                    raise
                continue  # removed between our create attempt and our attach: again
            except _Abandoned as abandoned:
                _remove_abandoned(name, abandoned.identity, abandoned.mode)
                if not create:
                    raise SegmentMissing(f"no segment {name}") from None
        raise SegmentNotReady(f"segment {name} could not be created or attached; try again")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Other threads may still be inside the core (a slot() in flight while the
        # handler shuts down): give them a moment; if they stay, leave the mapping to
        # the process rather than pull it from under them.
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self.core.busy and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.core.busy:
            log.warning(
                "segment %s: closed while other threads were still inside it; its mapping "
                "stays until the process exits",
                self.name,
            )
            return
        self.core.close()
        for sem in self._doorbells.values():
            sem.close()
        self._doorbells.clear()
        # BufferError: a view of it is still alive somewhere; the mapping goes with it
        with contextlib.suppress(BufferError):
            self.buf.close()

    # --- doorbells: one semaphore per registered process, posted when it is granted ---
    def doorbell(self, member: int) -> posix_ipc.Semaphore:
        sem = self._doorbells.get(member)
        if sem is None:
            name = names.doorbell_name(self.name, member)
            try:
                # usually it exists (its owner made it when registering): open it without
                # O_CREAT, so no umask change happens on a releasing thread's hot path
                sem = posix_ipc.Semaphore(name)
            except posix_ipc.ExistentialError:
                sem = ipc.open_semaphore(name, self.mode, 0)
            except ipc.DENIED:
                raise SegmentError(
                    f"doorbell {name} belongs to another user; see the group-shared option"
                ) from None
            self._doorbells[member] = sem
        return sem

    def ring(self, members: set[int] | list[int]) -> None:
        for member in members:
            if 0 <= member < layout.MEMBER_COUNT:
                self.doorbell(member).release()


_UNKNOWN = (-1, -1)


def _identity_of(name: str) -> tuple[int, int] | None:
    """(device, inode) of the shm object now under ``name``; None when there is none."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except posix_ipc.ExistentialError:
        return None
    except ipc.DENIED:
        return _UNKNOWN
    try:
        info = os.fstat(shm.fd)
    finally:
        shm.close_fd()
    return info.st_dev, info.st_ino


# --- creation and attachment -----------------------------------------------------------
class _Abandoned(Exception):
    """The object under the name was never initialised and its creator is gone."""

    def __init__(self, identity: tuple[int, int], mode: int) -> None:
        self.identity = identity
        self.mode = mode


def _remove_abandoned(name: str, identity: tuple[int, int], mode: int) -> None:
    """Unlink an abandoned creation, once, whoever else found it at the same time.

    Serialised by the ``.C`` semaphore and done only while the name still maps the
    very object that was judged abandoned: without both, a late attacher would unlink
    the segment another one had just created in its place, and the processes would
    end up on separate segments with separate budgets.
    """
    creation = ipc.open_semaphore(names.creation_name(name), mode, 1)
    try:
        if not ipc.timed_acquire(creation, 2.0, use_timeouts=ipc.timeouts_supported()):
            return  # someone is at it (or died at it): the caller retries from the top
        try:
            if _identity_of(name) == identity:
                log.warning("segment %s was abandoned by its creator before init; recreating", name)
                _unlink_shm(name)
        finally:
            creation.release()
    finally:
        creation.close()


def _try_create(name: str, group_shared: bool) -> mmap.mmap | None:
    mode = ipc.GROUP_SHARED if group_shared else ipc.OWNER_ONLY
    try:
        with ipc.exact_mode(mode):
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode, layout.TOTAL_SIZE)
    except posix_ipc.ExistentialError:
        return None
    try:
        os.fchmod(shm.fd, mode)
        _reserve(name, shm.fd)
        buf = mmap.mmap(shm.fd, layout.TOTAL_SIZE)
    except SegmentError:
        _unlink_shm(name)
        raise
    finally:
        shm.close_fd()
    pid, start = my_identity()
    HEADER["creator_start"].put(buf, start)
    HEADER["creator_pid"].put(buf, pid)
    HEADER["created_at"].put(buf, time.time())
    HEADER["magic"].put(buf, MAGIC)
    HEADER["major"].put(buf, MAJOR)
    HEADER["minor"].put(buf, MINOR)
    HEADER["header_size"].put(buf, layout.HEADER_SIZE)
    HEADER["provider_row_size"].put(buf, layout.PROVIDER_ROW_SIZE)
    HEADER["provider_count"].put(buf, layout.PROVIDER_COUNT)
    HEADER["holder_row_size"].put(buf, layout.HOLDER_ROW_SIZE)
    HEADER["holders_per_provider"].put(buf, layout.HOLDERS_PER_PROVIDER)
    HEADER["member_row_size"].put(buf, layout.MEMBER_ROW_SIZE)
    HEADER["member_count"].put(buf, layout.MEMBER_COUNT)
    HEADER["total_size"].put(buf, layout.TOTAL_SIZE)
    HEADER["flags"].put(buf, layout.FLAG_GROUP_SHARED if group_shared else 0)
    kind = lock.kind_for_new_segment()
    try:
        lock.prepare(buf, name, kind, mode)
    except lock.LockSetupError as exc:
        buf.close()
        _unlink_shm(name)
        raise SegmentError(f"segment {name}: {exc}") from None
    HEADER["lock_kind"].put(buf, kind)
    HEADER["init_complete"].put(buf, INIT_MARK)  # last (R-G2)
    return buf


def _reserve(name: str, fd: int) -> None:
    """Give the new object its memory now. ``ftruncate`` alone makes a sparse object
    whose pages are found missing only when written: on a full ``/dev/shm`` the first
    write through the mapping killed the process with SIGBUS, with no word of why."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # macOS: no posix_fallocate for shm objects
        return
    try:
        fallocate(fd, 0, layout.TOTAL_SIZE)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise SegmentError(
                f"segment {name}: no room for its {layout.TOTAL_SIZE} bytes of shared memory "
                f"({exc.strerror}); free space in /dev/shm (see df /dev/shm) and start again"
            ) from None
        # EOPNOTSUPP, EINVAL: a file system without fallocate keeps the old behaviour


def _attach(name: str, *, read_only: bool = False) -> mmap.mmap:
    try:
        shm = posix_ipc.SharedMemory(name, read_only=read_only)
    except posix_ipc.ExistentialError:
        raise SegmentMissing(
            f"no segment {name}: nothing has created it yet (start the sidecar or a handler)"
        ) from None
    except ipc.DENIED:
        raise SegmentError(
            f"segment {name} exists but this user may not open it (owner-only by default; "
            "see the group-shared option)"
        ) from None
    try:
        info = os.fstat(shm.fd)
        identity = (info.st_dev, info.st_ino)
        if info.st_mode & stat.S_IRWXO:
            raise UnsafePermissions(
                f"segment {name} is accessible to all users (mode {info.st_mode & 0o777:o}); "
                "refusing to use it. Remove it ('gateway-capacity inspect --segment "
                f"{name} --unlink --force') and let gateway-capacity create it again."
            )
        deadline = time.monotonic() + INIT_WAIT_S
        while True:
            size = os.fstat(shm.fd).st_size
            if size >= layout.HEADER_SIZE:
                head = mmap.mmap(shm.fd, layout.HEADER_SIZE, access=mmap.ACCESS_READ)
                try:
                    ready = HEADER["init_complete"].get(head) == INIT_MARK
                    magic, major, minor = (HEADER[k].get(head) for k in ("magic", "major", "minor"))
                    creator = (HEADER["creator_pid"].get(head), HEADER["creator_start"].get(head))
                    geometry_ok = _our_geometry(head)
                finally:
                    head.close()
                if ready:
                    break
                if magic not in (MAGIC, bytes(len(MAGIC))) or not _our_size(size):
                    break  # someone else's object: refused below, never removed
            else:
                creator = (0, 0.0)
                magic, major, minor = b"", 0, 0
                geometry_ok = False
            if time.monotonic() >= deadline:
                if creator[0] == 0 or not is_alive(*creator):
                    if size != 0 and not _our_size(size):
                        break
                    raise _Abandoned(identity, stat.S_IMODE(info.st_mode))
                raise SegmentNotReady(
                    f"segment {name} is still being initialised by pid {creator[0]}; try again"
                )
            time.sleep(0.005)
        if magic != MAGIC:
            raise NotOurSegment(
                f"shared-memory object {name} is not a gateway-capacity segment (bad magic); "
                "choose another name with --segment"
            )
        if major != MAJOR:
            raise IncompatibleLayout(name, (major, minor))
        if not _our_size(size) or not geometry_ok:
            raise NotOurSegment(
                f"segment {name} is {size} bytes or has other table sizes than layout "
                f"{major}.{minor} of this program ({layout.TOTAL_SIZE} bytes): damaged or "
                "not ours"
            )
        access = mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE
        buf = mmap.mmap(shm.fd, layout.TOTAL_SIZE, access=access)
        problem = damage(buf)
        if problem is not None:
            buf.close()
            raise DamagedSegment(
                f"segment {name} is damaged ({problem}); once no handler uses it, remove it "
                f"with 'gateway-capacity inspect --segment {name} --unlink --force'"
            )
        return buf
    finally:
        shm.close_fd()


def _our_size(size: int) -> bool:
    # macOS reports a shm object's size rounded up to its page size (16 KiB on Apple
    # silicon); 64 KiB of slack covers any page size in use.
    return layout.TOTAL_SIZE <= size < layout.TOTAL_SIZE + 65536


def _our_geometry(head: mmap.mmap) -> bool:
    """The header's table sizes are this program's (same major means same geometry)."""
    expected = {
        "header_size": layout.HEADER_SIZE,
        "provider_row_size": layout.PROVIDER_ROW_SIZE,
        "provider_count": layout.PROVIDER_COUNT,
        "holder_row_size": layout.HOLDER_ROW_SIZE,
        "holders_per_provider": layout.HOLDERS_PER_PROVIDER,
        "member_row_size": layout.MEMBER_ROW_SIZE,
        "member_count": layout.MEMBER_COUNT,
        "total_size": layout.TOTAL_SIZE,
    }
    return all(HEADER[k].get(head) == v for k, v in expected.items())


def damage(buf: mmap.mmap | bytes) -> str | None:
    """What makes this initialised segment unusable, or None: values that no writer of
    ours can produce (random bytes over the tables, a scribbling program)."""
    if HEADER["lock_kind"].get(buf) not in layout.LOCK_KINDS:
        return f"unknown lock kind {HEADER['lock_kind'].get(buf)}"
    from shm_layout.ledger import holder_base, member_base, provider_base

    ended = False
    for p in range(layout.PROVIDER_COUNT):
        base = provider_base(p)
        in_use = PROVIDER["in_use"].get(buf, base)
        if in_use not in (0, 1) or (ended and in_use):
            return f"provider row {p} is not a row this program writes"
        ended = ended or not in_use
        # (counters may disagree with the records after a death inside a section: the
        # next lock holder repairs them, so they are no sign of damage)
        if in_use:
            states = {
                HOLDER["state"].get(buf, holder_base(p, h))
                for h in range(layout.HOLDERS_PER_PROVIDER)
            }
            if not states <= set(layout.HOLDER_STATES):
                return f"provider row {p} has holder records in no known state"
    for m in range(layout.MEMBER_COUNT):
        if MEMBER["in_use"].get(buf, member_base(m)) not in (0, 1):
            return f"member row {m} is not a row this program writes"
    return None


def map_readonly(name: str) -> mmap.mmap:
    """A read-only mapping for readers (inspect, availability, wait-for-slot)."""
    names.check_segment_name(name)
    try:
        return _attach(name, read_only=True)
    except _Abandoned:
        raise SegmentNotReady(
            f"segment {name} was never initialised (its creator died); the next handler or "
            "sidecar recreates it, or remove it with inspect --unlink --force"
        ) from None


def _unlink_shm(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    except ipc.DENIED:
        raise SegmentError(
            f"segment {name} belongs to another user: remove it as that user (or root)"
        ) from None
    return True


def unlink_segment(name: str) -> bool:
    """Remove the segment and all its semaphores. True when the segment existed."""
    existed = _unlink_shm(name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock.lock_file_path(name))
    ipc.unlink_semaphore(names.creation_name(name))
    for member in range(layout.MEMBER_COUNT):
        ipc.unlink_semaphore(names.doorbell_name(name, member))
    return existed
