"""Segment and semaphore names (REQUIREMENTS.md section 8, R-A10).

macOS limits POSIX IPC names to 31 bytes including the leading slash; so
does every name here (the segment's, and each doorbell's).

A doorbell (one named semaphore per registered process) is named after a
random 64-bit id that its owner writes into its member row of the segment:
``/gwcb-`` + 16 hex digits. Only who can read the segment can know it: no other
local user can create it first (R-G6; macOS cannot show a semaphore's owner,
so an unguessable name is the only protection there), and no process of
another segment or registration ever posts it (R-A15).
"""

from __future__ import annotations

import os

from shm_layout import platform
from shm_layout.errors import BadSegmentName as BadSegmentName

ENV_VAR = "GATEWAY_CAPACITY_SEGMENT"
PREFIX = "/gwcap1-"
MAX_NAME_BYTES = 31  # macOS PSHMNAMLEN / SEM_NAME_LEN, leading slash included
MAX_SEGMENT_BYTES = MAX_NAME_BYTES
DOORBELL_PREFIX = "/gwcb-"

_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def _valid(name: str) -> bool:
    return len(name) > 1 and name[0] == "/" and all(c in _NAME_CHARS for c in name[1:])


def segment_name_for_config(config_path: str | os.PathLike[str]) -> str:
    """``/gwcap1-`` + 12 hex of sha256 of the config file's absolute path."""
    import hashlib  # here: it loads OpenSSL, which a handler that names its segment never needs

    absolute = os.path.abspath(os.fspath(config_path))
    digest = hashlib.sha256(absolute.encode("utf-8", "surrogateescape")).hexdigest()
    return PREFIX + digest[:12]


def check_segment_name(name: str) -> str:
    """Return ``name`` if usable, else raise :class:`BadSegmentName` saying how to fix it."""
    if not _valid(name):
        raise BadSegmentName(
            f"segment name {name!r} must start with '/' followed by letters, digits, '.', '_' "
            "or '-' only"
        )
    size = len(name.encode())
    if size > MAX_SEGMENT_BYTES:
        raise BadSegmentName(
            f"segment name {name!r} is {size} bytes; at most {MAX_SEGMENT_BYTES} are allowed "
            f"(macOS allows {MAX_NAME_BYTES} bytes per IPC name, the leading '/' included)"
        )
    return name


def resolve_segment_name(
    segment: str | None = None, config: str | os.PathLike[str] | None = None
) -> str:
    """``--segment`` beats ``$GATEWAY_CAPACITY_SEGMENT`` beats the config-derived name."""
    if segment:
        return check_segment_name(segment)
    env = os.environ.get(ENV_VAR)
    if env:
        return check_segment_name(env)
    if config is not None:
        return segment_name_for_config(config)
    raise BadSegmentName(f"no segment: give --config PATH or --segment NAME (or set ${ENV_VAR})")


def doorbell_name(bell: int) -> str:
    """The doorbell of the registration whose member row holds ``bell`` (``_core.c`` formats
    it the same way)."""
    return f"{DOORBELL_PREFIX}{bell:016x}"


def reasons_path(segment: str) -> str:
    """The file beside the segment's lock file that holds the reasons the segment had to
    cut, whole (``shm_layout.reasons``); removed with the segment."""
    return os.path.join(platform.lock_dir(), segment.lstrip("/") + ".reasons")


def new_bell() -> int:
    """A fresh doorbell id: 64 random bits, never 0 (0 means "no doorbell")."""
    while True:
        bell = int.from_bytes(os.urandom(8), "little")
        if bell:
            return bell
