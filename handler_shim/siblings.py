"""Split budgets: a handler alone on a segment while the sidecar publishes on another.

The segment name derives from the config's absolute path, so a handler that
names the config another way (a symlink, a copy, a release directory instead of
``/etc/...``) gets a segment of its own: its admission works, on the static
limits, but it shares no budget with the handlers on the sidecar's segment, and
nothing else says so. :func:`warn_if_split_budget` looks for exactly that case
when a handler attaches: its segment has never been written by a sidecar, while
a live sidecar whose config has the same provider ids publishes on another
segment. It then logs one WARNING (once per pair of segments in a process)
naming both segments and the sidecar's config path, and how to fix it.

Only ``shm_layout.view`` is used (read-only, lock-free); no httpx. Finding the
other segments needs a directory listing of POSIX shared memory, which Linux
has (``/dev/shm``) and macOS does not: there the check does nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from shm_layout.names import ENV_VAR
from shm_layout.view import SegmentView, read_view

log = logging.getLogger("gateway_capacity.admission")

SHM_DIR = "/dev/shm"
MAX_SCANNED = 256  # a bound on the work one attach may do on a crowded host

_warned: set[tuple[str, str]] = set()


def warn_if_split_budget(segment: str, provider_ids: Iterable[str]) -> None:
    """Log a WARNING when ``segment`` has no sidecar but a sibling segment has one for
    the same providers. Never raises: it is a diagnostic, and attaching must go on."""
    try:
        _check(segment, frozenset(provider_ids))
    except Exception:
        log.debug("split-budget check of %s failed", segment, exc_info=True)


def _check(segment: str, provider_ids: frozenset[str]) -> None:
    own = read_view(segment)
    if own.sidecar is not None:
        return  # a sidecar writes this segment: handlers here share its budget
    ids = provider_ids or frozenset(p.id for p in own.providers)
    if not ids:
        return
    for other in sidecar_segments(segment, os.stat(_path(segment)).st_size):
        if _provider_ids(other) != ids or (segment, other.name) in _warned:
            continue
        _warned.add((segment, other.name))
        assert other.sidecar is not None
        log.warning(
            "segment %s has no sidecar, but sidecar pid %d publishes limits for the same "
            "providers (%s) on segment %s (config %s): this process does not share their "
            "budget. Give the sidecar and every handler the same segment: the same config "
            "path, or the same $%s (--segment)",
            segment,
            other.sidecar.pid,
            ", ".join(sorted(ids)),
            other.name,
            other.config_path or "unknown",
            ENV_VAR,
        )


def sidecar_segments(exclude: str, size: int) -> list[SegmentView]:
    """Other segments of this host (same size as ours) with a live sidecar."""
    try:
        names = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []  # no listing of shared memory here (macOS)
    found = []
    scanned = 0
    for entry in names:
        name = "/" + entry
        if entry.startswith("sem.") or name == exclude or scanned >= MAX_SCANNED:
            continue
        try:
            st = os.stat(_path(name))
        except OSError:
            continue
        if st.st_size != size:
            continue
        scanned += 1
        if not _sidecar_in_header(name):
            continue  # cheap: most segments have none, and a full read may wait on a writer
        try:
            view = read_view(name)
        except Exception:
            continue  # not ours, not readable, or gone meanwhile
        if view.sidecar is not None and view.sidecar.alive:
            found.append(view)
    return found


def _sidecar_in_header(name: str) -> bool:
    """Does the header of ``name`` (ours, this major) name a sidecar that is alive?"""
    import mmap

    import posix_ipc

    from shm_layout import layout
    from shm_layout.liveness import is_alive

    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except Exception:
        return False
    try:
        head = mmap.mmap(shm.fd, layout.HEADER_SIZE, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return False
    finally:
        shm.close_fd()
    try:
        HEADER = layout.HEADER
        if HEADER["magic"].get(head) != layout.MAGIC or HEADER["major"].get(head) != layout.MAJOR:
            return False
        pid = HEADER["sidecar_pid"].get(head)
        return pid != 0 and is_alive(pid, HEADER["sidecar_start"].get(head))
    except (OverflowError, ValueError):
        return False
    finally:
        head.close()


def _provider_ids(view: SegmentView) -> frozenset[str]:
    """The providers of the config the segment's sidecar last read."""
    return frozenset(p.id for p in view.providers if p.configured)


def _path(segment: str) -> str:
    return SHM_DIR + segment
