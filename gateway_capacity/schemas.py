"""The shape of ``availability --json`` and ``inspect --json``, declared once.

The commands build these Structs from a segment view and print them; the JSON
Schemas in ``docs/schemas/`` are generated from them (``make schemas``, or
``python -m gateway_capacity.schemas docs/schemas``), and a test fails when
the committed files differ from what the Structs generate.

``schema_version`` changes when a field is removed, renamed or changes type or
meaning. New fields may appear within a version: readers ignore what they do
not know, as the sidecar does with a capacity snapshot (R-K6).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, cast

import msgspec
from msgspec import Meta, Struct

from gateway_capacity.exits import EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from shm_layout.view import ProviderView, SegmentView, SidecarView

SCHEMA_VERSION: Final = 1

# Closed sets the segment view hands over as plain strings (layout.SIDECAR_STATES and
# layout.LOCK_KINDS values); the documents name them.
SidecarState = Literal["none", "running", "stopped", "unknown"]
LockKind = Literal["robust-mutex", "lock-file"]

Source = Annotated[
    Literal["discovered", "provider", "gateway", "default", "legacy_drain"],
    Meta(description="where the limit comes from (R-L9)"),
]
FallbackSource = Annotated[
    Literal["provider", "gateway", "default"],
    Meta(description="which maxConcurrent the fallback is: the provider's, the gateway's, or 4"),
]
Count = Annotated[int, Meta(ge=0)]
UnixTime = Annotated[float, Meta(description="Unix seconds")]


class Layout(Struct, kw_only=True):
    major: Annotated[int, Meta(description="layout major version (attach only when equal)")]
    minor: Annotated[int, Meta(description="layout minor version (append-only additions)")]


class Sidecar(Struct, kw_only=True):
    """The sidecar that last held the writer epoch."""

    pid: int
    alive: Annotated[bool, Meta(description="that process still runs (pid and start time)")]
    state: SidecarState
    status: Annotated[
        str,
        Meta(description="one phrase: running, stopping, stopped, died without stopping, ..."),
    ]
    heartbeat_age_s: Annotated[
        float | None, Meta(description="seconds since its last heartbeat (every 0.5 s)")
    ]
    writer_epoch: Annotated[int, Meta(description="fencing epoch (R-G4)")]
    config_generation: Annotated[int, Meta(description="+1 per config the sidecars adopted")]
    legacy_alive: Annotated[Count, Meta(description="--await-legacy processes still alive")]


class Generation(Struct, kw_only=True):
    """A handler process registered in the segment (R-G1)."""

    generation: Annotated[str, Meta(description="the label it attached with")]
    pid: int
    alive: bool
    layout: Annotated[str, Meta(description="layout version it speaks, major.minor")]


class Replica(Struct, kw_only=True):
    """One resolved address of the provider's host, as last probed (R-L2)."""

    address: str
    ok: Annotated[bool, Meta(description="valid and fresh")]
    complete: bool
    value: Annotated[int | None, Meta(description="its value for this provider (R-L3)")]
    reason: Annotated[str, Meta(description="'ok' or why not, from a closed set, with detail")]
    observed_at: UnixTime | None


class Provider(Struct, kw_only=True):
    id: str
    capacity_discovery: Annotated[bool, Meta(description="capacityDiscovery set in the config")]
    configured: Annotated[bool, Meta(description="in the config the sidecar last read")]
    effective_limit: Annotated[Count, Meta(description="requests that may run at once now")]
    source: Source
    reason: str
    running: Annotated[Count, Meta(description="live processes' running requests")]
    waiting: Annotated[Count, Meta(description="live processes' waiting requests")]
    queue_bound: Annotated[Count, Meta(description="most requests that may wait (R-A2)")]
    fallback_limit: Count
    fallback_source: FallbackSource
    discovered: Annotated[
        int | None, Meta(description="limit from the last valid snapshots; null: none")
    ]
    observed_at: Annotated[
        UnixTime | None, Meta(description="oldest snapshot the discovered limit came from")
    ]
    expires_at: Annotated[
        UnixTime | None, Meta(description="when the published limit lapses (R-L7); null: none")
    ]
    replicas: list[Replica]


class Damage(Struct, kw_only=True):
    """What the sweeps found written over in the segment and put right (R-A16)."""

    repairs: Annotated[Count, Meta(description="sweeps that found damage and repaired it")]
    last: Annotated[str, Meta(description="what the last of them found")]
    age_s: Annotated[
        float | None, Meta(description="seconds since the last of them (monotonic clock)")
    ]


class AvailabilityDoc(Struct, kw_only=True):
    """gateway-capacity availability --json: per provider, the limit in force and the
    load on it, and which sidecar keeps the segment."""

    schema_version: Annotated[
        Literal[1], Meta(description="changes when a field is removed, renamed or retyped")
    ]
    segment: Annotated[str, Meta(description="POSIX shared-memory name")]
    config_path: Annotated[
        str | None, Meta(description="the config file the sidecar made this segment for")
    ]
    layout: Layout
    consistent: Annotated[bool, Meta(description="false: a writer was mid-update, figures torn")]
    config_status: Annotated[
        str | None, Meta(description="'ok', or why the last edit of the config was ignored")
    ]
    sidecar: Annotated[Sidecar | None, Meta(description="null: no sidecar has run")]
    owner: Annotated[
        str | None,
        Meta(description="user:group that owns the segment object (R-G6); null: unknown"),
    ]
    damage: Annotated[
        Damage | None,
        Meta(description="null: no sweep ever found the segment damaged (R-A16)"),
    ]
    lock_problem: Annotated[
        str | None,
        Meta(description="null, or what is wrong with the lock word and how to recover"),
    ]
    generations: list[Generation]
    providers: list[Provider]


class Header(Struct, kw_only=True):
    created_at: UnixTime
    group_shared: Annotated[bool, Meta(description="0660 instead of 0600 (R-G6)")]
    lock_kind: Annotated[
        LockKind,
        Meta(description="the segment's lock: a robust mutex in it, or a lock file beside it"),
    ]
    lock_repairs: Annotated[
        Count, Meta(description="repairs after a lock holder died inside a section (R-A6)")
    ]
    config_path: str | None


class Counters(Struct, kw_only=True):
    """The provider's counters since the segment was created."""

    admitted_total: Count
    rejected_total: Count
    timeouts_total: Count
    cancelled_total: Count
    reclaimed_total: Count
    peak_running: Count
    peak_waiting: Count


class InspectProvider(Provider, kw_only=True):
    published_limit: Annotated[int | None, Meta(description="as the sidecar wrote it")]
    clamped: Annotated[bool, Meta(description="the static limit was above the running room")]
    counters: Counters
    stored_running: Annotated[int, Meta(description="the counter as stored (derived, R-A6)")]
    stored_waiting: int


class Holder(Struct, kw_only=True):
    """A running slot or waiting place, owned by a process (pid + start time)."""

    provider: str
    index: int
    state: Annotated[str, Meta(description="'running' or 'waiting'")]
    pid: int
    alive: bool
    ticket: Annotated[int, Meta(description="arrival order (R-A3)")]
    serial: int
    member: int
    generation: str | None
    since: UnixTime


class Member(Struct, kw_only=True):
    index: int
    pid: int
    alive: bool
    generation: str
    layout: str
    attached_at: UnixTime


class InspectDoc(Struct, kw_only=True):
    """gateway-capacity inspect --json: availability's figures plus the segment's
    header, the counters and every holder record."""

    schema_version: Annotated[
        Literal[1], Meta(description="changes when a field is removed, renamed or retyped")
    ]
    segment: str
    config_path: str | None
    layout: Layout
    consistent: bool
    config_status: str | None
    sidecar: Sidecar | None
    owner: str | None
    damage: Damage | None
    lock_problem: str | None
    header: Header
    generations: list[Member]
    providers: list[InspectProvider]
    holders: list[Holder]


# --- from a segment view ----------------------------------------------------------------------
def _provider_fields(p: ProviderView) -> dict[str, Any]:
    return {
        "id": p.id,
        "capacity_discovery": p.capacity_discovery,
        "configured": p.configured,
        "effective_limit": p.effective_limit,
        "source": p.source,
        "reason": p.reason,
        "running": p.running,
        "waiting": p.waiting,
        "queue_bound": p.queue_bound,
        "fallback_limit": p.fallback_limit,
        "fallback_source": p.fallback_source,
        "discovered": p.discovered,
        "observed_at": p.observed_at,
        "expires_at": p.expires_at,
        "replicas": [
            Replica(
                address=r.address,
                ok=r.ok,
                complete=r.complete,
                value=r.value,
                reason=r.reason,
                observed_at=r.observed_at,
            )
            for r in p.replicas
        ],
    }


def sidecar_status(s: SidecarView) -> str:
    """The sidecar's state as one phrase (the process's liveness and what it last wrote)."""
    if s.alive:
        return "running" if s.state == "running" else "stopping"
    if s.state == "running":
        return "died without stopping (crashed or killed)"
    return "stopped"


def _sidecar(view: SegmentView) -> Sidecar | None:
    s = view.sidecar
    if s is None:
        return None
    return Sidecar(
        pid=s.pid,
        alive=s.alive,
        state=cast(SidecarState, s.state),
        status=sidecar_status(s),
        heartbeat_age_s=s.heartbeat_age_s,
        writer_epoch=s.writer_epoch,
        config_generation=s.config_generation,
        legacy_alive=s.legacy_alive,
    )


def _common(view: SegmentView) -> dict[str, Any]:
    """The fields both documents open with."""
    return {
        "schema_version": SCHEMA_VERSION,
        "segment": view.name,
        "config_path": view.config_path or None,
        "layout": Layout(major=view.major, minor=view.minor),
        "consistent": view.consistent,
        "config_status": view.config_status or None,
        "sidecar": _sidecar(view),
        "owner": view.owner,
        "damage": (
            Damage(repairs=view.damage_repairs, last=view.damage_note, age_s=view.damage_age_s)
            if view.damage_repairs
            else None
        ),
        "lock_problem": view.lock_problem,
    }


def availability(view: SegmentView) -> AvailabilityDoc:
    """``availability --json`` of a ``shm_layout.view.SegmentView``."""
    return AvailabilityDoc(
        **_common(view),
        generations=[
            Generation(generation=m.generation, pid=m.pid, alive=m.alive, layout=m.layout)
            for m in view.members
        ],
        providers=[Provider(**_provider_fields(p)) for p in view.providers],
    )


def inspect(view: SegmentView) -> InspectDoc:
    """``inspect --json`` of a ``shm_layout.view.SegmentView``."""
    return InspectDoc(
        **_common(view),
        header=Header(
            created_at=view.created_at,
            group_shared=view.group_shared,
            lock_kind=cast(LockKind, view.lock_kind),
            lock_repairs=view.lock_repairs,
            config_path=view.config_path or None,
        ),
        generations=[
            Member(
                index=m.index,
                pid=m.pid,
                alive=m.alive,
                generation=m.generation,
                layout=m.layout,
                attached_at=m.attached_at,
            )
            for m in view.members
        ],
        providers=[
            InspectProvider(
                **_provider_fields(p),
                published_limit=p.published_limit,
                clamped=p.clamped,
                counters=Counters(**p.counters),
                stored_running=p.stored_running,
                stored_waiting=p.stored_waiting,
            )
            for p in view.providers
        ],
        holders=[
            Holder(
                provider=h.provider,
                index=h.index,
                state=h.state,
                pid=h.pid,
                alive=h.alive,
                ticket=h.ticket,
                serial=h.serial,
                member=h.member,
                generation=h.generation,
                since=h.since,
            )
            for h in view.holders
        ],
    )


# --- the JSON Schemas ---------------------------------------------------------------------------
SCHEMAS: Final[dict[str, tuple[type[Struct], str]]] = {
    "availability.schema.json": (AvailabilityDoc, "gateway-capacity availability --json"),
    "inspect.schema.json": (InspectDoc, "gateway-capacity inspect --json"),
}


def json_schema(kind: type[Struct], title: str) -> dict[str, Any]:
    schema = msgspec.json.schema(kind)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title, **schema}


def schema_texts() -> dict[str, str]:
    """File name -> the text of each committed schema, as the Structs generate it."""
    return {
        name: json.dumps(json_schema(kind, title), indent=2) + "\n"
        for name, (kind, title) in SCHEMAS.items()
    }


def main(argv: list[str]) -> int:
    """``python -m gateway_capacity.schemas DIR``: (re)write the schemas into DIR."""
    if len(argv) != 1:
        print("usage: python -m gateway_capacity.schemas DIR", file=sys.stderr)
        return EXIT_USAGE
    directory = Path(argv[0])
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in schema_texts().items():
        (directory / name).write_text(text)
        print(directory / name)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
