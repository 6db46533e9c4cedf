"""``gateway-capacity segments``: the segments of this user that exist, with their config
and sidecar.

A segment name derives from the config's absolute path, so a name one character
off, or a config named another way, leads to a segment nobody uses. Listing what
exists (and naming the nearest when a name is missing: ``availability``'s
message) turns "nothing has created it yet" into the name to use.

Only objects of a user this process trusts (itself, or ``$GATEWAY_CAPACITY_OWNER``)
and of the segment's size are opened, read-only and without waiting (as the
split-budget check does, R-G6). Listing needs a directory of POSIX shared memory,
which Linux has (``/dev/shm``) and macOS does not.
"""

from __future__ import annotations

import argparse
import difflib
import json
from typing import TYPE_CHECKING

from capacity_contract import shown as escaped  # a path the segment holds
from gateway_capacity.common import fail
from gateway_capacity.exits import EXIT_OK, EXIT_USAGE
from gateway_capacity.schemas import (
    SCHEMA_VERSION,
    ListedSegment,
    ListedSidecar,
    SegmentsDoc,
    sidecar_status,
)

if TYPE_CHECKING:
    from shm_layout.owners import OwnerPolicy

MAX_LISTED = 512  # a bound on the objects one listing opens
NEAREST_SHOWN = 3  # segments a missing name's message names


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "segments",
        help="the segments of this user that exist, with their config and sidecar",
        description="List the gateway-capacity segments of this user (or $GATEWAY_CAPACITY_"
        "OWNER's) in /dev/shm: each with the config its sidecar read and that sidecar's "
        "pid and state. Linux only (macOS cannot list shared memory).",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def segment_names(policy: OwnerPolicy | None = None) -> list[str] | None:
    """The names of the segments ``policy`` trusts, by their ``stat`` alone (nothing is
    opened); None where shared memory cannot be listed."""
    from shm_layout import layout, platform
    from shm_layout.owners import OwnerPolicy

    names = platform.list_shared_memory()
    if names is None:
        return None
    policy = policy or OwnerPolicy.for_process()
    found = []
    for name in sorted(names)[:MAX_LISTED]:
        st = platform.shared_memory_stat(name)
        if st is not None and st.st_size == layout.TOTAL_SIZE and policy.problem(st) is None:
            found.append(name)
    return found


def listed(name: str, policy: OwnerPolicy | None = None) -> ListedSegment:
    """One segment read-only and without waiting: its config, sidecar and handlers."""
    from shm_layout.view import read_view

    try:
        view = read_view(name, policy=policy, wait_init=False)
    except Exception as exc:  # not ready, not ours by its header, gone meanwhile
        return ListedSegment(name=name, error=str(exc).split("; ")[0])
    s = view.sidecar
    return ListedSegment(
        name=name,
        config_path=view.config_path or None,
        sidecar=None
        if s is None
        else ListedSidecar(pid=s.pid, alive=s.alive, status=sidecar_status(s)),
        handlers=sum(1 for m in view.members if m.alive),
    )


def list_segments(policy: OwnerPolicy | None = None) -> list[ListedSegment] | None:
    """The segments ``policy`` trusts, by name; None where shared memory cannot be listed."""
    from shm_layout.owners import OwnerPolicy

    policy = policy or OwnerPolicy.for_process()
    names = segment_names(policy)
    return None if names is None else [listed(name, policy) for name in names]


def describe(segment: ListedSegment) -> str:
    """One segment on one line: its name, config and sidecar."""
    if segment.error is not None:
        return f"{segment.name}  unreadable: {segment.error}"
    config = escaped(segment.config_path or "unknown (no sidecar has written it)")
    s = segment.sidecar
    sidecar = "no sidecar has run" if s is None else f"sidecar pid {s.pid} {s.status}"
    return f"{segment.name}  config {config}  {sidecar}  handlers {segment.handlers}"


def nearest(missing: str) -> str:
    """For a segment name that does not exist: the segments of this user that do, the
    nearest first, as one clause ("" where none can be listed). Only those it names
    are opened."""
    from shm_layout.owners import OwnerPolicy

    try:
        policy = OwnerPolicy.for_process()
        names = segment_names(policy)
        if names is None:
            return ""
        if not names:
            return "; this user has no segments at all"
        close = difflib.get_close_matches(missing, names, n=NEAREST_SHOWN, cutoff=0.6)
        shown = [listed(name, policy) for name in close or names[:NEAREST_SHOWN]]
    except Exception:  # a diagnostic: the missing segment is the error to report
        return ""
    more = len(names) - len(shown)
    tail = f" and {more} more ('gateway-capacity segments' lists them)" if more > 0 else ""
    items = "; ".join(_brief(s) for s in shown)
    return f"; did you mean {items}{tail}?" if close else f"; this user has {items}{tail}"


def _brief(segment: ListedSegment) -> str:
    if segment.error is not None:
        return f"{segment.name} (unreadable)"
    parts = [f"config {escaped(segment.config_path)}" if segment.config_path else "config unknown"]
    s = segment.sidecar
    parts.append("no sidecar" if s is None else f"sidecar pid {s.pid} {s.status}")
    return f"{segment.name} ({', '.join(parts)})"


def run(args: argparse.Namespace) -> int:
    import msgspec

    segments = list_segments()
    if segments is None:
        fail("this platform cannot list shared memory (no /dev/shm): nothing to list", EXIT_USAGE)
    if args.json:
        doc = SegmentsDoc(schema_version=SCHEMA_VERSION, segments=segments)
        print(json.dumps(msgspec.to_builtins(doc), indent=2))
    elif segments:
        print("\n".join(describe(s) for s in segments))
    else:
        from shm_layout.owners import OwnerPolicy

        print(f"no segments of {OwnerPolicy.for_process().expected()} in /dev/shm")
    return EXIT_OK
