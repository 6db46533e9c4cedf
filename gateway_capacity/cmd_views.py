"""``availability``, ``inspect`` and ``watch``: the operator's views of the segment.

They read without the lock (``shm_layout.view``), so they work while
handlers are busy and even while a dead writer's lock awaits recovery.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from gateway_capacity.common import add_target_options, fail, segment_from_args

EXIT_NO_SEGMENT = 3


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("availability", help="effective limit, running and waiting per provider")
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_availability)

    p = sub.add_parser("inspect", help="everything availability shows, plus holder records")
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--unlink", action="store_true", help="remove the segment and its semaphores (R-G5)"
    )
    p.add_argument(
        "--force", action="store_true", help="with --unlink: even while live processes use it"
    )
    p.set_defaults(func=run_inspect)

    p = sub.add_parser("watch", help="the availability view, refreshing in place")
    add_target_options(p)
    p.add_argument("--interval", type=float, default=1.0, metavar="S")
    p.add_argument("--count", type=int, default=0, help="stop after N refreshes (0: never)")
    p.set_defaults(func=run_watch)


def _read(args: argparse.Namespace) -> Any:
    from shm_layout.segment import SegmentError, SegmentMissing
    from shm_layout.view import read_view

    name = segment_from_args(args)
    try:
        return read_view(name)
    except SegmentMissing as exc:
        fail(str(exc), EXIT_NO_SEGMENT)
    except SegmentError as exc:
        fail(str(exc), 2)


def availability_doc(view: Any) -> dict[str, Any]:
    """The JSON of ``availability`` (SPEC section 8), shaped by ``schemas.AvailabilityDoc``."""
    import msgspec

    from gateway_capacity import schemas

    doc: dict[str, Any] = msgspec.to_builtins(schemas.availability(view))
    return doc


def inspect_doc(view: Any) -> dict[str, Any]:
    """The JSON of ``inspect``, shaped by ``schemas.InspectDoc``."""
    import msgspec

    from gateway_capacity import schemas

    doc: dict[str, Any] = msgspec.to_builtins(schemas.inspect(view))
    return doc


def _age(t: float | None, now: float) -> str:
    if not t:
        return "-"
    delta = t - now
    return f"in {delta:.0f}s" if delta >= 0 else f"{-delta:.0f}s ago"


def availability_text(view: Any) -> str:
    now = time.time()
    lines = [f"segment {view.name}  layout {view.major}.{view.minor}"]
    if not view.consistent:
        lines.append("  (a writer was mid-update; figures may be torn)")
    s = view.sidecar
    if s is None:
        lines.append("sidecar: none has run (handlers use their static limits)")
    else:
        beat = "-" if s.heartbeat_age_s is None else f"{s.heartbeat_age_s:.1f}s ago"
        state = ("alive" if s.alive else "dead") + f", {s.state}"
        lines.append(f"sidecar: pid {s.pid} ({state}), heartbeat {beat}, epoch {s.writer_epoch}")
    if view.config_status:
        lines.append(f"config: {view.config_status}")
    gens: dict[str, int] = {}
    for m in view.members:
        if m.alive:
            gens[m.generation] = gens.get(m.generation, 0) + 1
    lines.append(
        "generations: "
        + (", ".join(f"{g} ({n} process{'es' if n > 1 else ''})" for g, n in gens.items()) or "-")
    )
    for p in view.providers:
        lines.append("")
        flag = "discovery" if p.capacity_discovery else "static"
        lines.append(
            f"{p.id} [{flag}]  limit {p.effective_limit} ({p.source})  running {p.running}  "
            f"waiting {p.waiting}/{p.queue_bound}  fallback {p.fallback_limit} "
            f"({p.fallback_source})"
        )
        lines.append(f"  reason: {p.reason}")
        if p.expires_at:
            lines.append(
                f"  observed {_age(p.observed_at, now)}, expires {_age(p.expires_at, now)}"
            )
        for r in p.replicas:
            value = "-" if r.value is None else str(r.value)
            state = "complete" if r.complete else "incomplete"
            lines.append(
                f"  replica {r.address}: {r.reason} {state if r.ok else ''} value {value}".rstrip()
            )
    return "\n".join(lines)


def run_availability(args: argparse.Namespace) -> int:
    view = _read(args)
    if args.json:
        print(json.dumps(availability_doc(view), indent=2))
    else:
        print(availability_text(view))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    if args.unlink:
        return _unlink(args)
    view = _read(args)
    if args.json:
        print(json.dumps(inspect_doc(view), indent=2))
        return 0
    print(availability_text(view))
    print("\nholders:")
    for h in view.holders:
        print(
            f"  {h.provider}#{h.index} {h.state} pid {h.pid} "
            f"{'alive' if h.alive else 'DEAD'} ticket {h.ticket} gen {h.generation or '-'}"
        )
    if not view.holders:
        print("  (none)")
    print(f"lock: owner pid {view.lock_owner_pid or '-'}, recoveries so far {view.lock_repairs}")
    return 0


def _unlink(args: argparse.Namespace) -> int:
    from shm_layout.segment import unlink_segment

    name = segment_from_args(args)
    try:
        view = _read(args)
    except SystemExit:
        if not args.force:
            raise
        view = None
    if view is not None and not args.force:
        live = [f"handler pid {m.pid} ({m.generation})" for m in view.members if m.alive]
        live += [f"{h.state} holder pid {h.pid}" for h in view.holders if h.alive]
        if view.sidecar is not None and view.sidecar.alive:
            live.append(f"sidecar pid {view.sidecar.pid}")
        if live:
            fail(
                f"refusing to remove {name}: still in use by {', '.join(sorted(set(live)))}; "
                "stop them first or add --force",
                1,
            )
    if not unlink_segment(name) and view is None:
        fail(f"no segment {name}", EXIT_NO_SEGMENT)
    print(f"removed segment {name} and its semaphores")
    return 0


def run_watch(args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    shown = 0
    try:
        while True:
            view = _read(args)
            text = availability_text(view)
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
            else:
                sys.stdout.write(text + "\n---\n")
            sys.stdout.flush()
            shown += 1
            if args.count and shown >= args.count:
                return 0
            time.sleep(max(args.interval, 0.1))
    except KeyboardInterrupt:
        return 0
