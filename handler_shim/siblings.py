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

The scan trusts nothing another user made (R-G6): a segment whose owner is not
one this process trusts is skipped by its ``stat`` alone, unopened. It never
waits on a segment (one that is not initialised is skipped), and its whole run
is bounded in time however many objects lie in the directory (``SCAN_S``).
Finding the other segments needs a listing of POSIX shared memory, which Linux
has and macOS does not (``platform.list_shared_memory``): there the check does
nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from shm_layout import platform
from shm_layout.names import ENV_VAR
from shm_layout.owners import OwnerPolicy
from shm_layout.view import SegmentView, read_view

log = logging.getLogger("gateway_capacity.admission")

MAX_SCANNED = 256  # a bound on the segments one attach may look into
SCAN_S = 0.25  # and on the time it may spend looking

_warned: set[tuple[str, str]] = set()


def warn_if_split_budget(
    segment: str, provider_ids: Iterable[str], policy: OwnerPolicy | None = None
) -> None:
    """Log a WARNING when ``segment`` has no sidecar but a sibling segment has one for
    the same providers. Never raises: it is a diagnostic, and attaching must go on."""
    try:
        _check(segment, frozenset(provider_ids), policy or OwnerPolicy.for_process())
    except Exception:
        log.debug("split-budget check of %s failed", segment, exc_info=True)


def _check(segment: str, provider_ids: frozenset[str], policy: OwnerPolicy) -> None:
    own = read_view(segment, policy=policy, wait_init=False)
    if own.sidecar is not None:
        return  # a sidecar writes this segment: handlers here share its budget
    ids = provider_ids or frozenset(p.id for p in own.providers)
    if not ids:
        return
    mine = platform.shared_memory_stat(segment)
    if mine is None:
        return
    for other in sidecar_segments(segment, mine.st_size, policy):
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


def sidecar_segments(
    exclude: str, size: int, policy: OwnerPolicy, budget_s: float = SCAN_S
) -> list[SegmentView]:
    """Other segments of this host (same size as ours, owned by someone ``policy``
    trusts) with a live sidecar; looked for for at most ``budget_s`` seconds."""
    names = platform.list_shared_memory()
    if names is None:
        return []  # no listing of shared memory here (macOS)
    deadline = time.monotonic() + budget_s
    found = []
    scanned = 0
    for name in sorted(names):
        if name == exclude or scanned >= MAX_SCANNED or time.monotonic() >= deadline:
            continue
        st = platform.shared_memory_stat(name)
        if st is None or st.st_size != size or policy.problem(st) is not None:
            continue  # not ours by its owner: never opened, never waited on
        scanned += 1
        try:
            view = read_view(name, policy=policy, wait_init=False)
        except Exception:
            continue  # not ours, not ready, not readable, or gone meanwhile
        if view.sidecar is not None and view.sidecar.alive:
            found.append(view)
    return found


def _provider_ids(view: SegmentView) -> frozenset[str]:
    """The providers of the config the segment's sidecar last read."""
    return frozenset(p.id for p in view.providers if p.configured)
