"""Reading a provider's key from its ``credentialFile`` (R-P7).

The key is read afresh for every probe, so rotating the file takes effect at the
next refresh without a restart. ``credentialFile`` is either

- an absolute path, or
- ``systemd-credential:NAME``: the file ``$CREDENTIALS_DIRECTORY/NAME`` that
  systemd provides to the service (``LoadCredential=NAME:/path/to/key`` or
  ``LoadCredentialEncrypted=``). NAME is a single path component.

The file must be a regular file (not a symlink: opened with ``O_NOFOLLOW``; not
a FIFO or device), at most 4 KiB, owned by the reading user or root, and
readable by nobody else: a file its group or all users may read is refused,
like OpenSSH's private keys (R-P7; a gateway that shares the key with a group
gives the sidecar its own copy, or uses systemd's ``LoadCredential=``, whose
private copies are exempt). No other user may be able to replace it:
every directory on its path, as written and as resolved, must be owned by root
or the reading user and not writable by group or others without the sticky bit
(OpenSSH's rule, :mod:`sidecar.trust`); the refusal names the component.
Trailing CR, LF and spaces are trimmed; what is
left must be non-empty printable ASCII with no whitespace or control characters.

The key is only ever held in a :class:`Secret`, whose ``repr``/``str`` never
show it. No error message contains the file's content.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from typing import Final

from capacity_contract import bearer_key
from shm_layout.errors import GatewayCapacityError
from sidecar.trust import file_owner_problem, path_problem

log = logging.getLogger("gateway_capacity.credential")

MAX_KEY_FILE_BYTES: Final = 4096
SYSTEMD_PREFIX: Final = "systemd-credential:"


class CredentialError(GatewayCapacityError):
    """The key cannot be used. ``str()`` names the file and the problem, never the key."""


class Secret:
    """A credential. ``repr``/``str``/``format`` show ``Secret(****)``; use :meth:`reveal`
    only to build the ``Authorization`` header."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret(****)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return "Secret(****)"

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a Secret is not picklable")


def check_credential_spec(spec: str) -> str | None:
    """``None`` when ``spec`` has an accepted form, else why not (no file access)."""
    if spec.startswith(SYSTEMD_PREFIX):
        name = spec[len(SYSTEMD_PREFIX) :]
        if not name or "/" in name or name in (".", ".."):
            return (
                f"credentialFile {spec!r}: the systemd credential name must be one path component"
            )
        return None
    if not os.path.isabs(spec):
        return f"credentialFile {spec!r} must be an absolute path or '{SYSTEMD_PREFIX}NAME'"
    return None


def credential_path(spec: str, credentials_directory: str | None = None) -> str:
    """The file ``spec`` names. ``credentials_directory`` defaults to
    ``$CREDENTIALS_DIRECTORY`` (set by systemd for a service with credentials)."""
    problem = check_credential_spec(spec)
    if problem is not None:
        raise CredentialError(problem)
    if not spec.startswith(SYSTEMD_PREFIX):
        return spec
    directory = (
        credentials_directory
        if credentials_directory is not None
        else os.environ.get("CREDENTIALS_DIRECTORY")
    )
    if not directory:
        raise CredentialError(
            f"credentialFile {spec!r} needs $CREDENTIALS_DIRECTORY (run under systemd with "
            "LoadCredential=)"
        )
    return os.path.join(directory, spec[len(SYSTEMD_PREFIX) :])


def read_credential(
    spec: str, *, credentials_directory: str | None = None, reader: str = "the sidecar"
) -> Secret:
    """Read and check the key ``spec`` names; raise :class:`CredentialError` saying why not.

    ``reader`` names who reads it in the advice for a group-readable file."""
    path = credential_path(spec, credentials_directory)
    systemd_copy = _is_systemd_credential(path, credentials_directory)
    unsafe = path_problem(path)
    if unsafe is not None:
        raise CredentialError(f"credential file {path}: {unsafe}")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CredentialError(f"credential file {path} is a symlink (refused)") from None
        raise CredentialError(
            f"credential file {path} cannot be opened: {exc.strerror or exc}"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CredentialError(f"credential file {path} is not a regular file")
        foreign = file_owner_problem(st)
        if foreign is not None:
            raise CredentialError(f"credential file {path} {foreign}")
        if st.st_mode & 0o007:
            # systemd made that copy: chmod on it is no fix, the source is.
            fix = (
                "check the LoadCredential= source and the unit"
                if systemd_copy
                else f"run: chmod 600 {path}"
            )
            raise CredentialError(
                f"credential file {path} is accessible by all users "
                f"(mode {stat.S_IMODE(st.st_mode):04o}); {fix}"
            )
        if st.st_mode & 0o077 and not systemd_copy:
            raise CredentialError(
                f"credential file {path} is readable by its group "
                f"(mode {stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path} (give "
                f"{reader} a copy of its own if a group must read the key)"
            )
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise CredentialError(
                f"credential file {path} is larger than {MAX_KEY_FILE_BYTES} bytes"
            )
        data = _read_at_most(fd, MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise CredentialError(
            f"credential file {path} cannot be read: {exc.strerror or exc}"
        ) from None
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise CredentialError(f"credential file {path} is larger than {MAX_KEY_FILE_BYTES} bytes")
    try:
        key = bearer_key(data)
    except ValueError as exc:
        raise CredentialError(f"credential file {path} {exc}") from None
    return Secret(key.decode("ascii"))


def _is_systemd_credential(path: str, credentials_directory: str | None) -> bool:
    """Is ``path`` a file in ``$CREDENTIALS_DIRECTORY``?

    systemd makes those copies itself, on a read-only file system private to
    the service, with a mode of its own choosing (0400, or 0440 where it grants
    access through the group or ACLs): the operator cannot chmod them, and no
    other user of the host can read them, so their group bits are not a finding.
    """
    directory = (
        credentials_directory
        if credentials_directory is not None
        else os.environ.get("CREDENTIALS_DIRECTORY")
    )
    if not directory:
        return False
    return os.path.dirname(os.path.normpath(path)) == os.path.normpath(directory)


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total < limit:
        chunk = os.read(fd, limit - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)
