"""The router's bearer key, read from a key file (R-K5 auth, R-P7 hygiene).

A minimal standard-library reader of our own: the router may share only the
contract types with ``sidecar`` (the project's layering), and its key file is
stricter than a provider's ``credentialFile``: this process *serves* with the
key, so a file that others can read is refused, not merely warned about.

Rules: a regular file (symlinks to one are followed), owner-only permissions
(no group/other bits), at most 4 KiB; the content rules are the probe's
(``capacity_contract.bearer_key``: trailing CR/LF/space stripped, non-empty,
printable ASCII without spaces). The key never appears in an error message or
a repr.
"""

from __future__ import annotations

import os
import stat

from capacity_contract import bearer_key
from shm_layout.errors import GatewayCapacityError

from .watched import FileStamp, open_regular

MAX_KEY_BYTES = 4096


class KeyFileError(GatewayCapacityError, ValueError):
    """The key file cannot be used. ``str()`` names the file, never the key."""


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    path = os.fspath(path)
    fd, st = open_regular(path, "key file", KeyFileError, os.O_NONBLOCK)
    try:
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"key file {path} is accessible by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it"
            )
        raw = os.read(fd, MAX_KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_KEY_BYTES:
        raise KeyFileError(f"key file {path} is larger than {MAX_KEY_BYTES} bytes")
    try:
        return bearer_key(raw)
    except ValueError as exc:
        raise KeyFileError(f"key file {path} {exc}") from None


class KeyFile:
    """The current key, re-read when the file changes (rotation without restart).

    A rotation to an unusable file keeps the previous key; the reason is in
    :attr:`last_error`. ``repr`` shows the path only.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._stamp = self._stat()
        self._key = read_key_file(self.path)
        self.last_error: str | None = None

    def __repr__(self) -> str:
        return f"KeyFile({self.path!r})"

    def _stat(self) -> FileStamp | None:
        try:
            return FileStamp.of(os.stat(self.path))
        except OSError:
            return None

    @property
    def key(self) -> bytes:
        return self._key

    def refresh(self) -> bool:
        """Re-read on change. True when a new key was taken."""
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            key = read_key_file(self.path)
        except KeyFileError as exc:
            self.last_error = str(exc)
            return False
        self.last_error = None
        changed = key != self._key
        self._key = key
        return changed
