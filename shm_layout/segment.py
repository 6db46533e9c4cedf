"""Create, attach and remove the segment (R-G2, R-G5, R-G6, R-A15).

Create-or-attach is race-free: ``shm_open(O_CREAT|O_EXCL)`` decides the one
creator; it sets the final mode on the descriptor, sizes the object once, writes
the header and the static tables, and writes the init mark last. Everyone else
opens the existing object, **checks its owner first** (an object another user
made under our name is refused with one line, before anything of it is
believed or waited for: ``owners.py``), then waits (bounded) for the mark, then
checks the magic, the major version and the geometry. A segment of ours whose
creator died before the mark is removed and created again.

The segment is never unlinked when a process exits (unlike
``multiprocessing.shared_memory``, whose resource tracker does: CPython
gh-82300); only :func:`unlink_segment` removes it. A handler that finds the name
leading to another object than the one it mapped (removed or replaced by hand)
notices it within one sweep (``Segment.still_named``, R-A15).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import time

import posix_ipc

from shm_layout import _core, ipc, layout, lock, names, platform
from shm_layout.errors import DamagedSegment as DamagedSegment
from shm_layout.errors import ForeignSegment as ForeignSegment
from shm_layout.errors import IncompatibleLayout as IncompatibleLayout
from shm_layout.errors import NotOnThisPlatform
from shm_layout.errors import NotOurSegment as NotOurSegment
from shm_layout.errors import SegmentError as SegmentError
from shm_layout.errors import SegmentMissing as SegmentMissing
from shm_layout.errors import SegmentNotReady as SegmentNotReady
from shm_layout.errors import UnsafePermissions as UnsafePermissions
from shm_layout.layout import HEADER, HOLDER, INIT_MARK, MAGIC, MAJOR, MEMBER, MINOR, PROVIDER
from shm_layout.liveness import is_alive, my_identity
from shm_layout.owners import OwnerPolicy, group_name, user_name

log = logging.getLogger("gateway_capacity.segment")

INIT_WAIT_S = 2.0
CLOSE_WAIT_S = 2.0


_warned_disarmed = False  # the guard was found replaced (once per process)


class Mapping(mmap.mmap):
    """A mapping of a segment that a truncation cannot turn into death by SIGBUS.

    Whoever may write the segment may also shrink it (a member of its group in
    group-shared mode, root's own tooling); an access past the new end is a SIGBUS.
    Every mapping of a segment is made here and registered with the core's SIGBUS
    handler for as long as it is mapped: a fault inside it replaces its pages with
    zeros (``damaged`` turns True) and the access goes on; a fault anywhere else is
    left to whatever handled SIGBUS before (the guard: ``shm_layout/_guard.h``)."""

    _guard = -1

    def __new__(cls, fd: int, length: int, *, access: int = mmap.ACCESS_WRITE) -> Mapping:
        self = super().__new__(cls, fd, length, access=access)
        self._guard = _core.guard(self, access != mmap.ACCESS_READ)
        global _warned_disarmed
        if self._guard >= 0 and not _warned_disarmed and not _core.guard_armed():
            _warned_disarmed = True
            log.warning(
                "SIGBUS handling was replaced after this process's first attach (signal.signal "
                "or sigaction): a truncated segment may now kill or hang it; set your own "
                "SIGBUS handling before the first attach (docs/DESIGN.md, the SIGBUS guard)"
            )
        return self

    @property
    def damaged(self) -> bool:
        """Was the object truncated under this mapping (its pages read zeros now)?"""
        return self._guard >= 0 and _core.damaged(self._guard)

    def close(self) -> None:
        if self.damaged:
            _MENDED.append(self)  # never unmapped: see _MENDED
            return
        super().close()  # BufferError while a view of it lives: it stays mapped, and guarded
        self._unguard()

    def _unguard(self) -> None:
        if self._guard >= 0:
            _core.unguard(self._guard)
            self._guard = -1

    def __del__(self) -> None:  # before the mapping goes with the object
        if self.damaged:
            _MENDED.append(self)  # kept alive, so never unmapped
            return
        self._unguard()


# Mappings the SIGBUS handler mended stay mapped (their zero pages) for the life of the
# process. A thread that held the segment's robust mutex when its page turned to zeros
# cannot let it go (glibc sees no owner), so the mutex stays on that thread's robust
# list, whose next lock links through it: were its page unmapped, that lock would write
# into nothing (SIGSEGV). A mapping is about 640 KB; a truncation is rare damage.
_MENDED: list[Mapping] = []


def _recovery(name: str) -> str:
    return f"'gateway-capacity inspect --segment {name} --unlink --force'"


class Segment:
    """A mapped segment. Shared state changes only through ``self.core`` (the compiled
    core takes the lock for each step: Python never holds it)."""

    def __init__(
        self,
        name: str,
        buf: mmap.mmap,
        *,
        created: bool,
        identity: Identity,
        policy: OwnerPolicy,
    ) -> None:
        self.name = name
        self.buf = buf
        self.created = created
        self.identity = identity
        self.policy = policy
        self.mode = (
            ipc.GROUP_SHARED
            if HEADER["flags"].get(buf) & layout.FLAG_GROUP_SHARED
            else ipc.OWNER_ONLY
        )
        self.lock_kind = HEADER["lock_kind"].get(buf)
        try:
            self.core: _core.Core = lock.open_core(
                name, buf, self.lock_kind, policy, _inode(identity)
            )
        except lock.LockSetupError as exc:
            buf.close()
            raise SegmentError(f"segment {name}: {exc}") from None
        self._closed = False
        if not created and damage(buf) is not None:
            # only what the sweep puts right was found (_attach refused the rest): put it
            # right now rather than refuse a new handler for as long as nobody sweeps
            self.core.sweep(0.0)
            problem = damage(buf)
            if problem is not None:
                self.core.close()
                buf.close()
                raise DamagedSegment(
                    f"segment {name} is damaged ({problem}); once no handler uses it, remove "
                    f"it with {_recovery(name)}"
                )

    def still_named(self) -> bool:
        """Is the object under our name still the one we mapped? (No after an
        ``rm /dev/shm/...`` or ``inspect --unlink --force``, and a re-creation.)"""
        return self.core.still_named() != 0  # -1: cannot tell; never claim it was replaced

    # --- open ------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        name: str,
        *,
        create: bool = True,
        group_shared: bool = False,
        owner: str | int | None = None,
        group: str | int | None = None,
        policy: OwnerPolicy | None = None,
    ) -> Segment:
        """Attach to ``name``; with ``create``, create it first if it does not exist.

        ``owner``/``group``: who else may own it (``owners.OwnerPolicy``, R-G6)."""
        names.check_segment_name(name)
        policy = policy or OwnerPolicy.for_process(owner, group_shared=group_shared, group=group)
        for _attempt in range(5):
            if create:
                made = _try_create(name, group_shared=group_shared, policy=policy)
                if made is not None:
                    return cls(name, made[0], created=True, identity=made[1], policy=policy)
            try:
                buf, identity = _attach(name, policy=policy)
                return cls(name, buf, created=False, identity=identity, policy=policy)
            except SegmentMissing:
                if not create:
                    raise
                continue  # removed between our create attempt and our attach: again
            except _Abandoned as abandoned:
                _remove_abandoned(name, abandoned.identity)
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
            time.sleep(0.002)
        if self.core.busy:
            log.warning(
                "segment %s: closed while other threads were still inside it; its mapping "
                "stays until the process exits",
                self.name,
            )
            return
        self.core.close()
        # BufferError: a view of it is still alive somewhere; the mapping goes with it
        with contextlib.suppress(BufferError):
            self.buf.close()

    # --- doorbells: one named semaphore per registration ------------------------------
    def create_doorbell(self) -> int:
        """Create this registration's doorbell under a fresh random name, exclusively,
        with its final mode (and group) set without touching the process umask; returns
        its id for ``Core.register``. Nobody else can have made it: the name is new."""
        for _attempt in range(8):
            bell = names.new_bell()
            name = names.doorbell_name(bell)
            try:
                sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, 0o600, 0)
            except posix_ipc.ExistentialError:
                continue  # 64 random bits taken: try another
            except ipc.DENIED as exc:
                raise SegmentError(f"cannot create a doorbell semaphore ({exc})") from None
            sem.close()
            try:
                platform.set_semaphore_mode(name, self.mode, self.policy.gid)
            except OSError as exc:
                ipc.unlink_semaphore(name)
                raise SegmentError(f"cannot set the mode of doorbell {name}: {exc}") from None
            return bell
        raise SegmentError("could not create a doorbell semaphore under a fresh name")


def remove_doorbell(bell: int) -> None:
    if bell:
        ipc.unlink_semaphore(names.doorbell_name(bell))


# What tells one shm object from another under the same name (R-A15): ("inode", device,
# inode) where the platform gives them (Linux), else ("creation", size, created_at,
# creator pid, creator start) from its header: macOS's fstat of a shm object reports
# only mode, owner, group and size (XNU pshm_stat), its device and inode are 0.
Identity = tuple[object, ...]
_UNKNOWN: Identity = ("unknown",)


def _creation_identity(head: mmap.mmap, size: int) -> Identity:
    if size < layout.HEADER_SIZE or len(head) < layout.HEADER_SIZE:
        return ("creation", size)
    fields = ("created_at", "creator_pid", "creator_start")
    return ("creation", size, *(HEADER[k].get(head) for k in fields))


def _object_identity(fd: int) -> Identity:
    info = os.fstat(fd)
    inode = platform.shared_memory_identity(info)
    if inode is not None:
        return ("inode", *inode)
    if info.st_size < layout.HEADER_SIZE:
        return ("creation", info.st_size)
    head = Mapping(fd, layout.HEADER_SIZE, access=mmap.ACCESS_READ)
    try:
        return _creation_identity(head, info.st_size)
    finally:
        head.close()


def _inode(identity: Identity) -> tuple[int, int] | None:
    """(device, inode) for the core, or None: the core then compares creation stamps."""
    if identity[0] == "inode" and len(identity) == 3:
        dev, ino = identity[1], identity[2]
        assert isinstance(dev, int) and isinstance(ino, int)
        return dev, ino
    return None


def _identity_of(name: str) -> Identity | None:
    """The identity of the shm object now under ``name``; None when there is none."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except posix_ipc.ExistentialError:
        return None
    except (*ipc.DENIED, OSError):  # a symbolic link (ELOOP) is no object of ours either
        return _UNKNOWN
    try:
        return _object_identity(shm.fd)
    finally:
        shm.close_fd()


# --- creation and attachment -----------------------------------------------------------
class _Abandoned(Exception):
    """The object under the name is ours, was never initialised and its creator is gone."""

    def __init__(self, identity: Identity) -> None:
        self.identity = identity


def _remove_abandoned(name: str, identity: Identity) -> None:
    """Unlink an abandoned creation of ours, only while the name still maps the very
    object judged abandoned. Processes that judge it together take turns on a lock of
    that object itself (``flock`` on its descriptor), so the first unlinks it and the
    others, finding the name leads elsewhere by then, never unlink the creation made in
    its place (without the lock, processes racing here can end on two segments). Where
    the platform cannot lock the object, two may still race: the one that unlinks a
    creation just made leaves the other's processes on an unnamed segment, which they
    notice within one sweep and leave (R-A15)."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except (posix_ipc.ExistentialError, *ipc.DENIED, OSError):
        return
    try:
        if _object_identity(shm.fd) != identity:
            return  # replaced already
        with contextlib.suppress(OSError):  # macOS: shm objects take no flock
            fcntl.flock(shm.fd, fcntl.LOCK_EX)
        if _identity_of(name) == identity:
            log.warning("segment %s was abandoned by its creator before init; recreating", name)
            _unlink_shm(name)
    finally:
        shm.close_fd()  # and with it the lock, after the unlink


def _try_create(
    name: str, *, group_shared: bool, policy: OwnerPolicy
) -> tuple[mmap.mmap, Identity] | None:
    mode = ipc.GROUP_SHARED if group_shared else ipc.OWNER_ONLY
    try:
        # Linux: 0600 at creation (the umask can only narrow it), the final mode and group
        # set on the descriptor below; macOS: the final mode at creation, the only moment
        # it can be set. Never by changing the process umask (R-G6).
        shm = posix_ipc.SharedMemory(
            name, posix_ipc.O_CREX, platform.shared_memory_create_mode(mode), 0
        )
    except posix_ipc.ExistentialError:
        return None
    except ipc.DENIED as exc:
        raise SegmentError(f"segment {name}: cannot create it ({exc})") from None
    try:
        platform.set_shared_memory_mode(shm.fd, mode, policy.gid)
        platform.size_object(shm.fd, layout.TOTAL_SIZE)
        _reserve(name, shm.fd)
        info = os.fstat(shm.fd)
        inode = platform.shared_memory_identity(info)
        buf = Mapping(shm.fd, layout.TOTAL_SIZE)
    except SegmentError:
        _unlink_shm(name)
        raise
    except NotOnThisPlatform as exc:
        _unlink_shm(name)
        raise SegmentError(f"segment {name}: cannot create it: {exc}") from None
    except OSError as exc:
        _unlink_shm(name)
        raise SegmentError(f"segment {name}: cannot create it ({exc.strerror})") from None
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
        lock.prepare(buf, name, kind, mode, policy)
    except lock.LockSetupError as exc:
        buf.close()
        _unlink_shm(name)
        raise SegmentError(f"segment {name}: {exc}") from None
    HEADER["lock_kind"].put(buf, kind)
    HEADER["init_complete"].put(buf, INIT_MARK)  # last (R-G2)
    identity = ("inode", *inode) if inode is not None else _creation_identity(buf, info.st_size)
    return buf, identity


def _reserve(name: str, fd: int) -> None:
    """Give the new object its memory now. ``ftruncate`` alone makes a sparse object
    whose pages are found missing only when written: on a full ``/dev/shm`` the first
    write through the mapping would kill the process with SIGBUS, with no word of why."""
    try:
        platform.reserve(fd, layout.TOTAL_SIZE)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise SegmentError(
                f"segment {name}: no room for its {layout.TOTAL_SIZE} bytes of shared memory "
                f"({exc.strerror}); free space in /dev/shm (see df /dev/shm) and start again"
            ) from None
        # EOPNOTSUPP, EINVAL: on a file system without fallocate the object stays sparse


def _symlink_refusal(name: str, policy: OwnerPolicy | None) -> ForeignSegment:
    """The name is a symbolic link (``shm_open`` never follows one: ELOOP). Nothing of
    ours makes links there: another user planted it, to have us map what it points at."""
    link = platform.shared_memory_stat(name)  # lstat: the link's own owner
    found = (
        f"made by {user_name(link.st_uid)} (uid {link.st_uid})"
        if link is not None
        else "owner unknown"
    )
    expected = (policy or OwnerPolicy.for_process()).expected()
    return ForeignSegment(
        f"segment {name} is a symbolic link ({found}, expected a segment of {expected}): "
        f"refused, never followed (another user may have planted it). Remove the link as "
        f"root with {_recovery(name)} (it removes the link, not what it points at) and find "
        "out who made it"
    )


def _open_shm(name: str, *, read_only: bool, policy: OwnerPolicy | None) -> posix_ipc.SharedMemory:
    """``shm_open`` of an existing object; a symbolic link under the name is refused
    (ForeignSegment) rather than left to surface as a bare ELOOP."""
    try:
        return posix_ipc.SharedMemory(name, read_only=read_only)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _symlink_refusal(name, policy) from None
        raise


def _foreign(name: str, problem: str, policy: OwnerPolicy) -> ForeignSegment:
    return ForeignSegment(
        f"segment {name} {problem}: another user made it first, or the wrong owner is "
        f"configured. If it is not meant to be there, remove it as root ({_recovery(name)}) "
        "and find out who made it; if that user is meant to own it (the sidecar and the "
        "handlers run as different users), name them: Admission.attach(..., "
        "group_shared=True, owner=THAT_USER) in the handlers (or $GATEWAY_CAPACITY_OWNER), "
        "and the sidecar with --group-shared --owner HANDLER_USER"
    )


def _attach(
    name: str,
    *,
    read_only: bool = False,
    policy: OwnerPolicy | None = None,
    wait_init: bool = True,
) -> tuple[Mapping, Identity]:
    """Map ``name``. With ``policy``, an object whose owner it does not trust is refused
    before anything else is read from it or waited for (R-G6)."""
    try:
        shm = _open_shm(name, read_only=read_only, policy=policy)
    except posix_ipc.ExistentialError:
        raise SegmentMissing(
            f"no segment {name}: nothing has created it yet (start the sidecar or a handler)"
        ) from None
    except ipc.DENIED:
        owner = platform.shared_memory_stat(name)
        who = f" (it belongs to {user_name(owner.st_uid)})" if owner is not None else ""
        raise SegmentError(
            f"segment {name} exists but this user may not open it{who}: owner-only by "
            "default. To share it between users, start the sidecar with --group-shared "
            "--owner HANDLER_USER and attach with Admission.attach(..., group_shared=True, "
            "owner=SIDECAR_USER)"
        ) from None
    try:
        info = os.fstat(shm.fd)
        if policy is not None:
            problem = policy.problem(info)
            if problem is not None:
                raise _foreign(name, problem, policy)
        if info.st_mode & stat.S_IRWXO:
            raise UnsafePermissions(
                f"segment {name} is accessible to all users (mode {info.st_mode & 0o777:o}); "
                f"refusing to use it. Remove it ({_recovery(name)}) and let gateway-capacity "
                "create it again."
            )
        deadline = time.monotonic() + (INIT_WAIT_S if wait_init else 0.0)
        while True:
            size = os.fstat(shm.fd).st_size
            if size >= layout.HEADER_SIZE:
                head = Mapping(shm.fd, layout.HEADER_SIZE, access=mmap.ACCESS_READ)
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
                if creator[0] == 0 or not _creator_alive(*creator):
                    if size != 0 and not _our_size(size):
                        break
                    raise _Abandoned(_object_identity(shm.fd))
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
        if size < layout.TOTAL_SIZE and geometry_ok:
            raise truncated(name, size)
        if not _our_size(size) or not geometry_ok:
            raise NotOurSegment(
                f"segment {name} is {size} bytes or has other table sizes than layout "
                f"{major}.{minor} of this program ({layout.TOTAL_SIZE} bytes): damaged or "
                "not ours"
            )
        access = mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE
        buf = Mapping(shm.fd, layout.TOTAL_SIZE, access=access)
        problem = damage(buf, lock_word=not read_only, repairable=read_only)
        if buf.damaged:
            buf.close()
            raise truncated(name, os.fstat(shm.fd).st_size)
        if problem is not None:
            buf.close()
            raise DamagedSegment(
                f"segment {name} is damaged ({problem}); once no handler uses it, remove it "
                f"with {_recovery(name)}"
            )
        return buf, _object_identity(shm.fd)
    finally:
        shm.close_fd()


def truncated(name: str, size: int | None = None) -> DamagedSegment:
    """The refusal of a segment that is smaller than its header says."""
    if size is None:
        size = _size_of(name)
    now = f"it is {size} bytes" if size is not None else "it shrank while it was read"
    return DamagedSegment(
        f"segment {name} was truncated: {now}, its header says {layout.TOTAL_SIZE} (by hand, "
        "or by a member of its group, who may write it); handlers treat it as removed. Once "
        f"no handler uses it, remove it with {_recovery(name)}"
    )


def _size_of(name: str) -> int | None:
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except (posix_ipc.ExistentialError, *ipc.DENIED, OSError):
        return None
    try:
        return os.fstat(shm.fd).st_size
    finally:
        shm.close_fd()


def _creator_alive(pid: int, start: float) -> bool:
    try:
        return is_alive(pid, start)
    except (OverflowError, ValueError):
        return False


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


def damage(
    buf: mmap.mmap | bytes, *, lock_word: bool = True, repairable: bool = True
) -> str | None:
    """What makes this initialised segment unusable, or None: values that no writer of
    ours can produce (random bytes over the tables, a scribbling program), and, with
    ``lock_word``, a lock word no lock call of ours wrote (R-A16; readers show that one
    instead of refusing). Counters that disagree with the records are not here: every
    step and sweep repairs them. With ``repairable`` False, what the core's sweep puts
    right is not counted either (an ``in_use`` word that is neither 0 nor 1 on a row
    that is otherwise ours, a record in no known state): a handler that attaches sweeps
    it away instead of refusing the segment (R-A16: damage costs a moment)."""
    kind = HEADER["lock_kind"].get(buf)
    if kind not in layout.LOCK_KINDS:
        return f"unknown lock kind {kind}"
    if lock_word and kind == layout.LOCK_ROBUST and _core.HAVE_ROBUST:
        sane, _, _, _ = _core.mutex_state(buf, layout.MUTEX_OFFSET)
        if not sane:
            return "its lock word holds bytes no lock call of ours wrote"
    from shm_layout.rows import holder_base, member_base, provider_base

    ended = False
    for p in range(layout.PROVIDER_COUNT):
        base = provider_base(p)
        in_use = PROVIDER["in_use"].get(buf, base)
        if (in_use not in (0, 1) and repairable) or (ended and in_use):
            return f"provider row {p} is not a row this program writes"
        ended = ended or not in_use
        if in_use:
            if not _an_id_we_write(PROVIDER["id"].get(buf, base)):
                return f"provider row {p} is not a row this program writes"
            if repairable:
                states = {
                    HOLDER["state"].get(buf, holder_base(p, h))
                    for h in range(layout.HOLDERS_PER_PROVIDER)
                }
                if not states <= set(layout.HOLDER_STATES):
                    return f"provider row {p} has holder records in no known state"
    for m in range(layout.MEMBER_COUNT):
        if MEMBER["in_use"].get(buf, member_base(m)) not in (0, 1) and repairable:
            return f"member row {m} is not a row this program writes"
    return None


def _an_id_we_write(raw: bytes) -> bool:
    """A provider id as the writers store it: 1..64 bytes of UTF-8, NUL-padded."""
    text = raw.rstrip(b"\x00")
    if not text or b"\x00" in text:
        return False
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def owner_of(name: str) -> tuple[int, int] | None:
    """(uid, gid) of the object under ``name`` without trusting it, or None."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except (posix_ipc.ExistentialError, *ipc.DENIED, OSError):  # OSError: a symbolic link
        info = platform.shared_memory_stat(name)
        return None if info is None else (info.st_uid, info.st_gid)
    try:
        info2 = os.fstat(shm.fd)
    finally:
        shm.close_fd()
    return info2.st_uid, info2.st_gid


def describe_owner(name: str) -> str | None:
    owner = owner_of(name)
    if owner is None:
        return None
    return f"{user_name(owner[0])}:{group_name(owner[1])}"


def map_readonly(
    name: str, *, policy: OwnerPolicy | None = None, wait_init: bool = True
) -> Mapping:
    """A read-only mapping for readers (inspect, availability, wait-for-slot). With
    ``policy``, a segment of an untrusted owner is refused (the sibling scan)."""
    names.check_segment_name(name)
    try:
        return _attach(name, read_only=True, policy=policy, wait_init=wait_init)[0]
    except _Abandoned:
        raise SegmentNotReady(
            f"segment {name} is 0 bytes: never initialised (its creator died), or truncated "
            "(by hand, or by a member of its group, who may write it); the next handler or "
            f"sidecar recreates it, or remove it with {_recovery(name)}"
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


def _doorbells_in(name: str) -> list[int]:
    """The doorbell ids of the member rows in use, read from the segment (best effort)."""
    try:
        buf = _attach(name, read_only=True, wait_init=False)[0]
    except (SegmentError, _Abandoned, OSError, ValueError):
        return []
    try:
        from shm_layout.rows import member_base

        return [
            MEMBER["bell"].get(buf, member_base(m))
            for m in range(layout.MEMBER_COUNT)
            if MEMBER["bell"].get(buf, member_base(m))
        ]
    finally:
        buf.close()


def doorbells_of(name: str) -> list[int]:
    """The doorbell ids of the processes registered in segment ``name`` now."""
    return _doorbells_in(name)


def objects_left(name: str, bells: list[int] | tuple[int, ...] = ()) -> list[str]:
    """What of segment ``name`` still exists: the segment, its lock file, and the
    doorbells ``bells``. Each is looked for by opening it by name, which every platform
    can do (macOS has no /dev/shm to list)."""
    left = []
    try:
        posix_ipc.SharedMemory(name, read_only=True).close_fd()
        left.append(name)
    except posix_ipc.ExistentialError:
        pass
    except (*ipc.DENIED, OSError):  # another user's, or a symbolic link under the name
        left.append(name)
    path = lock.lock_file_path(name)
    if os.path.lexists(path):
        left.append(path)
    for bell in bells:
        bell_name = names.doorbell_name(bell)
        try:
            posix_ipc.Semaphore(bell_name).close()
            left.append(bell_name)
        except posix_ipc.ExistentialError:
            pass
        except ipc.DENIED:
            left.append(bell_name)
    return left


def unlink_segment(name: str) -> bool:
    """Remove the segment, its lock file, its whole-reasons file and its members'
    doorbells. True when the segment existed."""
    bells = _doorbells_in(name)
    existed = _unlink_shm(name)
    with contextlib.suppress(FileNotFoundError, PermissionError):
        os.unlink(lock.lock_file_path(name))
    with contextlib.suppress(FileNotFoundError, PermissionError):
        os.unlink(names.reasons_path(name))
    for bell in bells:
        remove_doorbell(bell)
    return existed
