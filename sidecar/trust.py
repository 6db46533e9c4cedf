"""May another user have put this file there? (R-P7 key files, R-G6 pidfiles)

OpenSSH's ``safe_path()`` rule: a file is trusted only when nobody but root or
the user reading it can replace it or any directory leading to it. So every
directory from the file up to ``/`` must be owned by root or that user and not
writable by group or others, unless it has the sticky bit (``/tmp``: others may
write there but not rename or remove what is not theirs). Both the path as
written and the path it resolves to are walked: a symlinked component is then
safe exactly when the directory holding the link is (only who may write there
can swap it), and the directory that really holds the file is checked too.

A refusal is one line naming the component at fault and what to run.

``trusted`` adds users the operator named (``--owner``, the user the segment may
already belong to in group-shared mode): a legacy gateway's pidfile, written by
that user in its own ``RuntimeDirectory=``, is then as trusted as the segment
that user could write anyway. Nobody else is ever added: a user nobody named
stays refused.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Collection
from typing import Final

SAFE_OWNERS_ROOT: Final = 0


def owner_name(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _parents(path: str) -> list[str]:
    """The directories holding ``path``, from its own up to ``/``."""
    out = []
    current = os.path.dirname(path)
    while True:
        out.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            return out
        current = parent


def _trusted_phrase(trusted: Collection[int], uid: int) -> str:
    named = [owner_name(u) for u in trusted if u not in (SAFE_OWNERS_ROOT, uid)]
    if not named:
        return "root or this user"
    return f"root, this user or {' or '.join(named)} (--owner)"


def directory_problem(directory: str, uid: int, trusted: Collection[int] = ()) -> str | None:
    """Why another user than root, ``uid`` or one of ``trusted`` could replace entries of
    ``directory``."""
    try:
        st = os.stat(directory)
    except OSError as exc:
        return f"directory {directory} cannot be checked: {exc.strerror or exc}"
    if st.st_uid not in (SAFE_OWNERS_ROOT, uid, *trusted):
        return (
            f"directory {directory} is owned by {owner_name(st.st_uid)}, not "
            f"{_trusted_phrase(trusted, uid)}"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (
            f"directory {directory} is writable by group or others without the sticky bit "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); run: chmod go-w {directory}"
        )
    return None


def path_problem(path: str, uid: int | None = None, trusted: Collection[int] = ()) -> str | None:
    """``None`` when only root, ``uid`` (default: this process's effective uid) or one of
    ``trusted`` can replace ``path`` or a directory leading to it, else why not (naming
    the component).

    Checks the directories only; the caller checks the file itself on the
    descriptor it opened (owner, mode, type).
    """
    uid = os.geteuid() if uid is None else uid
    written = os.path.abspath(path)
    resolved = os.path.realpath(written)
    checked: set[str] = set()
    for directory in [*_parents(written), *_parents(resolved)]:
        if directory in checked:
            continue
        checked.add(directory)
        problem = directory_problem(directory, uid, trusted)
        if problem is not None:
            return problem
    return None


def file_owner_problem(
    st: os.stat_result, uid: int | None = None, trusted: Collection[int] = ()
) -> str | None:
    """Why a file with this ``fstat`` may not be trusted for its owner: None when it
    belongs to root, ``uid`` (default: this process's effective uid) or one of
    ``trusted``."""
    uid = os.geteuid() if uid is None else uid
    if st.st_uid in (SAFE_OWNERS_ROOT, uid, *trusted):
        return None
    if trusted:
        return f"is owned by {owner_name(st.st_uid)}, not {_trusted_phrase(trusted, uid)}"
    return f"is owned by {owner_name(st.st_uid)}, not root or this user ({owner_name(uid)})"
