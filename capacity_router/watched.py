"""The router's two watched files, its worker registry and its key file: opened the
same careful way (a regular file, or a refusal that names it), and stamped, so that
a change (a new inode, size or timestamp) is noticed without reading the file every
round."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FileStamp:
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def open_regular(
    path: str, what: str, error: type[Exception], flags: int = 0
) -> tuple[int, os.stat_result]:
    """``path`` opened read-only (with ``flags`` too) and its ``fstat``; raises ``error``
    naming ``what`` and the path when it cannot be opened or is not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    except OSError as exc:
        raise error(f"cannot open {what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st
