"""``availability``, ``inspect`` and ``watch``: the operator's views of the segment.

They read without the lock (``shm_layout.view``), so they work while
handlers are busy and even while a lock holder is stopped.
"""

from __future__ import annotations

import argparse
import json
import stat
import sys
import time
from typing import TYPE_CHECKING, Any

from capacity_contract import shown
from gateway_capacity.common import add_target_options, fail, segment_from_args
from gateway_capacity.exits import (
    EXIT_NO_SEGMENT,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    EXIT_WARNING,
)
from gateway_capacity.schemas import SCHEMA_VERSION, sidecar_status
from shm_layout.layout import FALLBACK_SOURCES, Source
from sidecar.shares import DEGRADED as SHARE_DEGRADED

if TYPE_CHECKING:
    from shm_layout.view import SegmentView

# The sidecar beats every 0.5 s; ten missed beats is no scheduling hiccup but a stopped
# or wedged sidecar (systemd's watchdog, at 20 s, is the slower backstop).
STALE_HEARTBEAT_S = 5.0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("availability", help="effective limit, running and waiting per provider")
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--check",
        action="store_true",
        help="health check: exit 1 when the sidecar is dead or stale, a provider that asks "
        "for discovery is on its fallback or is held at 0 by a model the farm lacks, the "
        "config on disk is broken, or the segment is another user's; exit 4 when only a "
        "provider held at limit 0 for another reason; one line per problem and its fix",
    )
    p.add_argument(
        "--max-heartbeat-age",
        type=_positive_seconds,
        default=STALE_HEARTBEAT_S,
        metavar="S",
        help=f"with --check: a heartbeat older than this is stale (default {STALE_HEARTBEAT_S:g})",
    )
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
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when the segment's lock word is damaged or a sweep repaired damage in "
        "the last 10 minutes, saying how to recover; one line per problem",
    )
    p.set_defaults(func=run_inspect)

    p = sub.add_parser("watch", help="the availability view, refreshing in place")
    add_target_options(p)
    p.add_argument(
        "--interval",
        type=_positive_seconds,
        default=1.0,
        metavar="S",
        help="seconds between refreshes (default 1; at least 0.1)",
    )
    p.add_argument(
        "--count", type=int, default=0, metavar="N", help="stop after N refreshes (0: never)"
    )
    p.set_defaults(func=run_watch)


def _positive_seconds(text: str) -> float:
    """A number of seconds above 0 (a heartbeat age of 0 would always be stale)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0: {text!r}")
    return value


def _read(args: argparse.Namespace) -> SegmentView:
    from shm_layout.errors import SegmentError, SegmentMissing
    from shm_layout.reasons import whole
    from shm_layout.view import read_view

    name = segment_from_args(args)
    try:
        return whole(read_view(name))
    except SegmentMissing as exc:
        from gateway_capacity.cmd_segments import nearest

        fail(f"{exc}{nearest(name)}", EXIT_NO_SEGMENT)
    except SegmentError as exc:
        fail(str(exc), EXIT_USAGE)


def availability_doc(view: SegmentView) -> dict[str, Any]:
    """JSON of ``availability`` (REQUIREMENTS.md 8), shaped by ``schemas.AvailabilityDoc``."""
    import msgspec

    from gateway_capacity import schemas

    doc: dict[str, Any] = msgspec.to_builtins(schemas.availability(view))
    return doc


def inspect_doc(view: SegmentView) -> dict[str, Any]:
    """The JSON of ``inspect``, shaped by ``schemas.InspectDoc``."""
    import msgspec

    from gateway_capacity import schemas

    doc: dict[str, Any] = msgspec.to_builtins(schemas.inspect(view))
    return doc


def _as_stored(reason: str, field: str) -> str:
    """A reason that fills its field in the segment was cut there, on a character
    boundary and without a mark: show that it was."""
    from shm_layout import layout

    table = layout.PROVIDER if field == "provider" else layout.REPLICA
    size = table["reason"].codec.size
    return reason + "…" if size - 4 < len(reason.encode()) <= size else reason


def _one_line(text: str) -> str:
    """A reason whole, on one line (the sidecar's full text when it kept one)."""
    return " ".join(text.split())


def _age(t: float | None, now: float) -> str:
    if not t:
        return "-"
    delta = t - now
    return f"in {delta:.0f}s" if delta >= 0 else f"{-delta:.0f}s ago"


def availability_text(view: SegmentView) -> str:
    now = time.time()
    lines = [
        f"segment {view.name}  layout {view.major}.{view.minor}  "
        + (
            f"config path {shown(view.config_path)}"
            if view.config_path
            else "config path unknown (no sidecar has written this segment)"
        )
    ]
    if not view.consistent:
        lines.append("  (a writer was mid-update; figures may be torn)")
    lines.extend(f"  DAMAGE: {shown(problem)}" for problem in damage_problems(view))
    s = view.sidecar
    if s is None:
        lines.append(
            "sidecar: none has run (handlers use each provider's stored fallback, shown below)"
        )
    else:
        beat = "-" if s.heartbeat_age_s is None else f"{s.heartbeat_age_s:.1f}s ago"
        lines.append(
            f"sidecar: pid {s.pid} {sidecar_status(s)}, heartbeat {beat}, epoch {s.writer_epoch}"
        )
    if view.config_status:
        lines.append(f"config: {shown(view.config_status)}")
    gens: dict[str, int] = {}
    for m in view.members:
        if m.alive:
            gens[m.generation] = gens.get(m.generation, 0) + 1
    lines.append(
        "generations: "
        + (
            ", ".join(f"{shown(g)} ({n} process{'es' if n > 1 else ''})" for g, n in gens.items())
            or "-"
        )
    )
    for p in view.providers:
        lines.append("")
        flag = "discovery" if p.capacity_discovery else "static"
        lines.append(
            f"{p.id} [{flag}]  limit {p.effective_limit} ({p.source})  running {p.running}  "
            f"waiting {p.waiting}/{p.queue_bound}  fallback {p.fallback_limit} "
            f"({p.fallback_source})"
        )
        lines.append(f"  reason: {_one_line(shown(_as_stored(p.reason, 'provider')))}")
        if p.token_limit is not None or p.request_token_limit is not None:
            budget = "-" if p.token_limit is None else str(p.token_limit)
            per = "" if p.request_token_limit is None else f"  per request {p.request_token_limit}"
            suspended = (
                "  SUSPENDED (a layout 3.1 or older handler is registered: slots alone)"
                if p.tokens_suspended
                else ""
            )
            lines.append(f"  tokens {p.tokens_running}/{budget}{per}{suspended}")
        if p.classes:
            suspended = " SUSPENDED (a layout 3.0 handler is registered: one FIFO)"
            lines.append(f"  classes{suspended if p.classes_suspended else ''}:")
        for c in p.classes:
            rules = [f"reserve {c.reserve}"] if c.reserve else []
            rules += [f"cap {c.cap}"] if c.cap else []
            rules += [f"maxWait {c.max_wait_s:g}s"] if c.max_wait_s else []
            lines.append(
                f"    {c.name}{' (default)' if c.default else ''}: running {c.running}  "
                f"waiting {c.waiting}" + (f"  [{', '.join(rules)}]" if rules else "")
            )
        if p.expires_at:
            lines.append(
                f"  observed {_age(p.observed_at, now)}, expires {_age(p.expires_at, now)}"
            )
        for r in p.replicas:
            value = "-" if r.value is None else str(r.value)
            state = "complete" if r.complete else "incomplete"
            lines.append(
                f"  replica {r.address}: {_one_line(shown(_as_stored(r.reason, 'replica')))} "
                f"{state if r.ok else ''} value {value}".rstrip()
            )
    return "\n".join(lines)


DAMAGE_RECENT_S = 600.0  # damage repaired this recently fails a check (R-A16)


def damage_problems(view: SegmentView) -> list[str]:
    """A damaged lock word, and damage the sweeps repaired lately, each with the
    recovery (R-A16)."""
    problems = []
    if view.lock_problem:
        problems.append(f"segment {view.name}: {view.lock_problem}")
    if view.damage_repairs and (view.damage_age_s or 0.0) <= DAMAGE_RECENT_S:
        ago = "" if view.damage_age_s is None else f" {view.damage_age_s:.0f}s ago"
        problems.append(
            f"segment {view.name}: damage repaired{ago} ({view.damage_note}; "
            f"{view.damage_repairs} time(s) in all): something writes into the segment that "
            "no gateway-capacity process writes. Counters were rebuilt from the records; if "
            "it goes on, stop the handlers and the sidecar, 'gateway-capacity inspect "
            f"--segment {view.name} --unlink --force', and start them again"
        )
    return problems


def _start_again(view: SegmentView) -> str:
    """What to run to have a sidecar write the segment again."""
    config = view.config_path or "PATH"
    return (
        f"start it again ('gateway-capacity sidecar --config {config}', or 'systemctl start' "
        "its unit); meanwhile handlers admit on each provider's stored fallback "
        "(0 for a shared one)"
    )


def health_problems(view: SegmentView, max_heartbeat_age: float) -> list[str]:
    """What ``availability --check`` fails on, one line each ending with what to do
    (empty: healthy)."""
    problems = damage_problems(view) + owner_problems(view)
    s = view.sidecar
    if s is None:
        problems.append(f"no sidecar has ever written segment {view.name}: {_start_again(view)}")
    elif not s.alive:
        after = "; its log says why it died" if s.state == "running" else ""
        problems.append(f"sidecar pid {s.pid} {sidecar_status(s)}: {_start_again(view)}{after}")
    elif s.state != "running":
        problems.append(
            f"sidecar pid {s.pid} is stopping: wait for it to exit, then {_start_again(view)}"
        )
    elif s.heartbeat_age_s is None or s.heartbeat_age_s > max_heartbeat_age:
        age = "never" if s.heartbeat_age_s is None else f"{s.heartbeat_age_s:.1f}s ago"
        problems.append(
            f"sidecar pid {s.pid} is stale: last heartbeat {age} "
            f"(limit {max_heartbeat_age:g}s; stopped or wedged?): 'kill -CONT {s.pid}' if it "
            "was stopped; if it stays stale, restart it and read its log"
        )
    lasted = s.legacy_overdue(view.read_mono) if s is not None and s.alive else None
    if s is not None and lasted is not None:
        problems.append(
            f"legacy drain has lasted {lasted / 60:.0f} min, over --await-legacy-max "
            f"{s.legacy_max_s / 60:g} min: pid {s.legacy_pid} still runs, opted-in providers "
            "admit nothing new (R-G3); stop it, or restart the sidecar without --await-legacy"
        )
    if view.config_status not in ("", "ok"):
        path = view.config_path or "the config"
        problems.append(
            f"config {path}: {view.config_status}. Fix the file ('gateway-capacity "
            f"check-config --config {path}' says what is wrong): the sidecar picks up the "
            "fix by itself, and handlers that attach meanwhile refuse the broken file"
        )
    for p in view.providers:
        if p.capacity_discovery and p.source in FALLBACK_SOURCES:
            problems.append(
                f"provider {p.id}: discovery failed, on fallback {p.effective_limit} "
                f"({p.source}): {shown(p.reason)}{_then_probe(view)}"
            )
        elif p.effective_limit == 0 and MISSING_MODEL in p.reason:
            problems.append(
                f"provider {p.id}: held at limit 0 ({p.source}): {shown(p.reason)}; "
                "every request waits, then times out. Name in models only what the farm serves "
                "('gateway-capacity verify' shows what it reports)"
            )
        if p.source == Source.SHARE and p.reason.startswith(SHARE_DEGRADED):
            problems.append(
                f"provider {p.id}: limit {p.effective_limit}, {shown(p.reason)}: "
                "make Redis reachable from this host (capacityShare.redis; "
                "'gateway-capacity check-config' shows share mode); the sidecar retries by itself"
            )
    return problems


def _then_probe(view: SegmentView) -> str:
    """What to run once the reason's fix is made: the probe, now, as the sidecar sends it."""
    config = view.config_path or "PATH"
    return (
        f"; after the fix, 'gateway-capacity check-config --probe --config {config}' tries it now"
    )


# limits.py's words when a configured model is what holds a discovered value at 0 (R-L8)
MISSING_MODEL = " missing from "


def health_warnings(view: SegmentView) -> list[str]:
    """States ``availability --check`` warns of (exit 4 when nothing fails): each may be
    meant (every worker fenced, a static limit of 0) but admits nothing."""
    return [
        f"provider {p.id}: limit 0 ({p.source}): {_one_line(shown(p.reason))}; it admits nothing "
        "(requests wait, then time out) until the limit rises"
        for p in view.providers
        if p.effective_limit == 0
        and p.source != Source.LEGACY_DRAIN  # the drain's 0 is R-G3's; an overdue one fails
        and MISSING_MODEL not in p.reason
        and not (p.capacity_discovery and p.source in FALLBACK_SOURCES)
    ]


def owner_problems(view: SegmentView) -> list[str]:
    """A segment of a user this process does not trust: a handler of this user refuses
    it (``ForeignSegment``, R-G6). Linux only: macOS shows no owner without opening."""
    from shm_layout import platform
    from shm_layout.errors import OwnerError
    from shm_layout.owners import OwnerPolicy, user_name

    info = platform.shared_memory_stat(view.name)
    if info is None:
        return []
    try:
        policy = OwnerPolicy.for_process()
    except OwnerError as exc:
        return [f"$GATEWAY_CAPACITY_OWNER: {exc}"]
    problem = policy.problem(info)
    if problem is None or problem.startswith("is accessible"):
        return []  # ours (one open to all users is refused when read: UnsafePermissions)
    owner = user_name(info.st_uid)
    return [
        f"segment {view.name} {problem}: a handler of this user refuses it (ForeignSegment). "
        f"If the handlers and the sidecar run as {owner} on purpose, run this check as "
        f"{owner} or with GATEWAY_CAPACITY_OWNER={owner} (handlers: Admission.attach(..., "
        f"group_shared=True, owner='{owner}'), the sidecar --group-shared); if it is not "
        f"meant to be there, remove it as root ('gateway-capacity inspect --segment "
        f"{view.name} --unlink --force') and find out who made it"
    ]


def run_availability(args: argparse.Namespace) -> int:
    view = _read(args)
    if args.check:
        problems = health_problems(view, args.max_heartbeat_age)
        warnings = health_warnings(view)
        if args.json:
            doc = {
                "schema_version": SCHEMA_VERSION,
                "ok": not problems and not warnings,
                "problems": problems,
                "warnings": warnings,
            }
            print(json.dumps(doc, indent=2))
        elif problems or warnings:
            # each quotes what the segment holds (reasons, paths): one line, escaped
            print("\n".join(shown(line) for line in problems + [f"warning: {w}" for w in warnings]))
        else:
            assert view.sidecar is not None  # health_problems reports a missing one
            print(f"ok: segment {view.name}, sidecar pid {view.sidecar.pid} running")
        if problems:
            return EXIT_PROBLEM
        return EXIT_WARNING if warnings else EXIT_OK
    if args.json:
        print(json.dumps(availability_doc(view), indent=2))
    else:
        print(availability_text(view))
    return EXIT_OK


def run_inspect(args: argparse.Namespace) -> int:
    if args.unlink:
        return _unlink(args)
    view = _read(args)
    if args.check:
        problems = damage_problems(view)
        if args.json:
            print(json.dumps({"ok": not problems, "problems": problems}, indent=2))
        else:
            print(
                "\n".join(map(shown, problems))
                if problems
                else f"ok: segment {view.name} is undamaged"
            )
        return EXIT_PROBLEM if problems else EXIT_OK
    if args.json:
        print(json.dumps(inspect_doc(view), indent=2))
        return EXIT_OK
    print(availability_text(view))
    print("\nholders:")
    for h in view.holders:
        print(
            f"  {h.provider}#{h.index} {h.state} pid {h.pid} "
            f"{'alive' if h.alive else 'DEAD'} ticket {h.ticket} gen {shown(h.generation or '-')}"
        )
    if not view.holders:
        print("  (none)")
    print(f"lock: {view.lock_kind}, repairs after a holder died inside it: {view.lock_repairs}")
    if view.lock_problem:
        print(f"lock word: {view.lock_problem}")
    if view.damage_repairs:
        print(
            f"damage repaired by sweeps: {view.damage_repairs} time(s), the last "
            f"{view.damage_age_s:.0f}s ago: {view.damage_note}"
        )
    print(f"owner: {view.owner or 'unknown'}")
    return EXIT_OK


def _unlink(args: argparse.Namespace) -> int:
    from shm_layout.errors import SegmentError, SegmentMissing
    from shm_layout.segment import unlink_segment
    from shm_layout.view import read_view

    name = segment_from_args(args)
    unread = None  # why the segment could not be read, when it could not
    try:
        view = read_view(name)
    except SegmentMissing:
        view = None
    except SegmentError as exc:
        view = None
        unread = str(exc).split(";")[0].split(". ")[0].rstrip(".")
        if not args.force:
            fail(
                f"cannot tell who uses {name}: {unread}; add --force to remove it anyway",
                EXIT_USAGE,
            )
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
    from shm_layout import platform

    before = platform.shared_memory_stat(name)
    try:
        existed = unlink_segment(name)
    except SegmentError as exc:
        fail(str(exc), EXIT_USAGE)
    if before is not None and stat.S_ISLNK(before.st_mode):
        # shm_unlink removes the name, never what a link there points at
        print(f"removed the symbolic link {platform.SHM_DIR}{name} (not what it pointed at)")
        return EXIT_OK
    if not existed and view is None and unread is None:
        fail(f"no segment {name}", EXIT_NO_SEGMENT)
    if unread is not None:
        print(f"removed segment {name} and its semaphores without reading it ({unread})")
    else:
        print(f"removed segment {name} and its semaphores")
    return EXIT_OK


def run_watch(args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    frames = 0
    try:
        while True:
            view = _read(args)
            text = availability_text(view)
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
            else:
                sys.stdout.write(text + "\n---\n")
            sys.stdout.flush()
            frames += 1
            if args.count and frames >= args.count:
                return EXIT_OK
            time.sleep(max(args.interval, 0.1))
    except KeyboardInterrupt:
        return EXIT_OK
