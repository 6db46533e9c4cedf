"""Who may own the objects a segment is made of (R-G6).

Every shared object the product opens (the segment, its lock file, the
doorbells) lives under a name another local user could have taken first:
``/dev/shm`` and ``/tmp`` are writable by everyone. A name proves nothing; the
owner does. An existing object is used only when its owner is the opening user
or the configured owner, and, in group-shared mode, its group is the configured
group. Root is no exception: root can open anything, which is exactly why it
must look before it trusts (PostgreSQL's ``checkDataDir()`` in spirit).

The configured owner is for deployments where the sidecar and the handlers run
as different users (group-shared mode): each side names the other
(``owner=`` / ``--owner`` / ``$GATEWAY_CAPACITY_OWNER``). The configured group
defaults to the process's effective group (``$GATEWAY_CAPACITY_GROUP`` or
``group=`` override it), the group a segment it creates would get.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Final

from shm_layout.errors import ForeignObject as ForeignObject
from shm_layout.errors import OwnerError as OwnerError

OWNER_ENV: Final = "GATEWAY_CAPACITY_OWNER"
GROUP_ENV: Final = "GATEWAY_CAPACITY_GROUP"


def user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _lookup(spec: str | int, what: str) -> int:
    """A uid (``what`` "user") or gid ("group") from a name or a number."""
    if isinstance(spec, int):
        return spec
    text = spec.strip()
    if text.isdigit():
        return int(text)
    import grp
    import pwd

    try:
        if what == "user":
            return pwd.getpwnam(text).pw_uid
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise OwnerError(
            f"{'owner' if what == 'user' else 'group'} {text!r} is no {what} of this host "
            f"(a {what} name or {'uid' if what == 'user' else 'gid'})"
        ) from None


class OwnerPolicy:
    """The uids an object may belong to, and (group-shared) the group it must have."""

    __slots__ = ("gid", "uids")

    def __init__(self, uids: tuple[int, ...], gid: int | None) -> None:
        self.uids = uids
        self.gid = gid  # None: owner-only mode, the group is not looked at

    def __repr__(self) -> str:
        return f"OwnerPolicy(uids={self.uids}, gid={self.gid})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OwnerPolicy) and (self.uids, self.gid) == (other.uids, other.gid)

    def __hash__(self) -> int:
        return hash((self.uids, self.gid))

    @classmethod
    def for_process(
        cls,
        owner: str | int | None = None,
        *,
        group_shared: bool = False,
        group: str | int | None = None,
    ) -> OwnerPolicy:
        uids = [os.geteuid()]
        configured = owner if owner is not None else os.environ.get(OWNER_ENV) or None
        if configured is not None:
            extra = _lookup(configured, "user")
            if extra not in uids:
                uids.append(extra)
        gid: int | None = None
        if group_shared:
            wanted = group if group is not None else os.environ.get(GROUP_ENV) or None
            gid = _lookup(wanted, "group") if wanted is not None else os.getegid()
        return cls(tuple(uids), gid)

    def expected(self) -> str:
        who = " or ".join(f"{user_name(u)} (uid {u})" for u in self.uids)
        if self.gid is not None:
            who += f", group {group_name(self.gid)} (gid {self.gid})"
        return who

    def problem(self, info: os.stat_result) -> str | None:
        """Why an object with this ``stat`` is not ours, or None."""
        found = f"{user_name(info.st_uid)} (uid {info.st_uid})"
        if info.st_uid not in self.uids:
            return f"belongs to {found}, expected {self.expected()}"
        if self.gid is not None and info.st_gid != self.gid:
            return (
                f"has group {group_name(info.st_gid)} (gid {info.st_gid}), expected "
                f"{group_name(self.gid)} (gid {self.gid})"
            )
        if info.st_mode & stat.S_IRWXO:
            return f"is accessible to all users (mode {stat.S_IMODE(info.st_mode):o})"
        return None


def check_directory(path: str, policy: OwnerPolicy, what: str) -> None:
    """A directory where our objects live must not let another user replace them: owned
    by root or a trusted user, and not writable by others unless sticky (``/tmp``,
    ``/dev/shm``: then every file in it is owner-checked, never trusted by name)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ForeignObject(f"{what} directory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ForeignObject(f"{what} directory {path} is not a directory")
    if info.st_uid != 0 and info.st_uid not in policy.uids:
        raise ForeignObject(
            f"{what} directory {path} belongs to {user_name(info.st_uid)} (uid {info.st_uid}): "
            "another user could replace what is in it; use a directory of root's or this "
            "service's own"
        )
    writable_by_others = info.st_mode & stat.S_IWOTH or (
        info.st_mode & stat.S_IWGRP and info.st_gid != policy.gid and info.st_gid != os.getegid()
    )
    if writable_by_others and not info.st_mode & stat.S_ISVTX:
        raise ForeignObject(
            f"{what} directory {path} is writable by other users without the sticky bit "
            f"(mode {stat.S_IMODE(info.st_mode):o}): another user could replace what is in "
            "it; use a directory only this service (and its group) can write"
        )
