"""The shape of every ``--json`` output, declared once.

``availability`` and ``inspect`` build these Structs from a segment view and
print them; the other commands print documents of the shapes declared here.
The JSON Schemas in ``docs/schemas/`` are generated from them (``make schemas``,
or ``python -m gateway_capacity.schemas docs/schemas``); a test fails when the
committed files differ from what the Structs generate, when a property has no
description, and when a command's real output does not validate.

``schema_version`` changes when a field is removed, renamed or changes type or
meaning. New fields may appear within a version: readers ignore what they do
not know, as the sidecar does with a capacity snapshot (R-K6).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, TypeVar, cast, get_args

import msgspec
from msgspec import Meta, Struct

from gateway_capacity.exits import EXIT_OK, EXIT_USAGE
from shm_layout import layout

if TYPE_CHECKING:
    from shm_layout.view import SegmentView, SidecarView

_S = TypeVar("_S", bound=Struct)

SCHEMA_VERSION: Final = 1

# Closed sets the segment view hands over as plain strings (layout.SIDECAR_STATES and
# layout.LOCK_KINDS values); the documents name them.
SidecarState = Literal["none", "running", "stopped", "unknown"]
LockKind = Literal["robust-mutex", "lock-file"]

Source = Annotated[
    Literal["discovered", "provider", "gateway", "default", "legacy_drain", "share"],
    Meta(description="where the limit comes from (R-L9)"),
]
FallbackSource = Annotated[
    Literal["provider", "gateway", "default"],
    Meta(description="which maxConcurrent the fallback is: the provider's, the gateway's, or 4"),
]
# The documents spell layout.Source's values out (a schema names them, not a $ref); they
# are checked against it here, when the module loads.
assert get_args(get_args(Source)[0]) == tuple(layout.Source), "schemas.Source != layout.Source"
assert get_args(get_args(FallbackSource)[0]) == layout.FALLBACK_SOURCES
Count = Annotated[int, Meta(ge=0)]
UnixTime = Annotated[float, Meta(description="Unix seconds")]
Version = Annotated[
    Literal[1], Meta(description="changes when a field is removed, renamed or retyped")
]


class Layout(Struct, kw_only=True):
    """The segment's layout version (R-G2)."""

    major: Annotated[int, Meta(description="layout major version (attach only when equal)")]
    minor: Annotated[int, Meta(description="layout minor version (append-only additions)")]


class Sidecar(Struct, kw_only=True):
    """The sidecar that last held the writer epoch."""

    pid: Annotated[int, Meta(description="its process id")]
    alive: Annotated[bool, Meta(description="that process still runs (pid and start time)")]
    state: Annotated[SidecarState, Meta(description="what it last wrote of itself")]
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
    pid: Annotated[int, Meta(description="its process id")]
    alive: Annotated[bool, Meta(description="that process still runs (pid and start time)")]
    layout: Annotated[str, Meta(description="layout version it speaks, major.minor")]


class Replica(Struct, kw_only=True):
    """One resolved address of the provider's host, as last probed (R-L2)."""

    address: Annotated[str, Meta(description="the resolved address that was probed")]
    ok: Annotated[bool, Meta(description="valid and fresh")]
    complete: Annotated[bool, Meta(description="the snapshot said complete: true (R-L6)")]
    value: Annotated[int | None, Meta(description="its value for this provider (R-L3)")]
    reason: Annotated[str, Meta(description="'ok' or why not, from a closed set, with detail")]
    observed_at: Annotated[UnixTime | None, Meta(description="its snapshot's observed_at")]


class Provider(Struct, kw_only=True):
    """One provider's row: the limit in force and the load on it."""

    id: Annotated[str, Meta(description="the provider id from the gateway config")]
    capacity_discovery: Annotated[bool, Meta(description="capacityDiscovery set in the config")]
    configured: Annotated[bool, Meta(description="in the config the sidecar last read")]
    effective_limit: Annotated[Count, Meta(description="requests that may run at once now")]
    source: Source
    reason: Annotated[str, Meta(description="why this limit, in a short phrase")]
    running: Annotated[Count, Meta(description="live processes' running requests")]
    waiting: Annotated[Count, Meta(description="live processes' waiting requests")]
    queue_bound: Annotated[Count, Meta(description="most requests that may wait (R-A2)")]
    fallback_limit: Annotated[
        Count, Meta(description="what handlers use once a discovered limit expires")
    ]
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
    replicas: Annotated[list[Replica], Meta(description="each resolved address, last probed")]
    classes: Annotated[
        list[AdmissionClass],
        Meta(description="admission classes, highest first (docs/classes.md); []: one FIFO"),
    ] = []
    classes_suspended: Annotated[
        bool,
        Meta(description="classes configured, but a layout 3.0 handler is registered: one FIFO"),
    ] = False
    token_limit: Annotated[
        Count | None,
        Meta(
            description="tokens all running requests may hold together (DESIGN.md 6c); "
            "null: no token budget in force, admission on slots alone"
        ),
    ] = None
    request_token_limit: Annotated[
        Count | None,
        Meta(description="the most tokens one request may hold; null: unknown"),
    ] = None
    tokens_running: Annotated[
        Count, Meta(description="tokens charged to live processes' running requests")
    ] = 0
    tokens_suspended: Annotated[
        bool,
        Meta(
            description="a token budget is published, but a handler of layout 3.1 or older "
            "is registered: admission on slots alone until it is gone"
        ),
    ] = False


class AdmissionClass(Struct, kw_only=True):
    """One admission class of a provider (R-A17..R-A20)."""

    name: Annotated[str, Meta(description="the class name from the gateway config")]
    default: Annotated[bool, Meta(description="requests that name no class count here")]
    reserve: Annotated[Count, Meta(description="slots no lower class may take")]
    cap: Annotated[Count | None, Meta(description="most this class runs at once; null: none")]
    max_wait_s: Annotated[
        float | None, Meta(description="a waiter is promoted after this long; null: never")
    ]
    running: Annotated[Count, Meta(description="live processes' running requests of it")]
    waiting: Annotated[Count, Meta(description="live processes' waiting requests of it")]
    admitted_total: Annotated[Count, Meta(description="requests of it admitted to a slot")]


class Damage(Struct, kw_only=True):
    """What the sweeps found written over in the segment and put right (R-A16)."""

    repairs: Annotated[Count, Meta(description="sweeps that found damage and repaired it")]
    last: Annotated[str, Meta(description="what the last of them found")]
    age_s: Annotated[
        float | None, Meta(description="seconds since the last of them (monotonic clock)")
    ]


class _SegmentDoc(Struct, kw_only=True):
    """The fields availability and inspect both open with (declared once; each document
    lists them first, then its own)."""

    schema_version: Version
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


class AvailabilityDoc(_SegmentDoc, kw_only=True):
    """gateway-capacity availability --json: per provider, the limit in force and the
    load on it, and which sidecar keeps the segment."""

    generations: Annotated[list[Generation], Meta(description="registered handler processes")]
    providers: Annotated[list[Provider], Meta(description="one row per provider")]


class Header(Struct, kw_only=True):
    """The segment's header."""

    created_at: Annotated[UnixTime, Meta(description="when the segment was created")]
    group_shared: Annotated[bool, Meta(description="0660 instead of 0600 (R-G6)")]
    lock_kind: Annotated[
        LockKind,
        Meta(description="the segment's lock: a robust mutex in it, or a lock file beside it"),
    ]
    lock_repairs: Annotated[
        Count, Meta(description="repairs after a lock holder died inside a section (R-A6)")
    ]
    config_path: Annotated[
        str | None, Meta(description="the config file the sidecar made this segment for")
    ]


class Counters(Struct, kw_only=True):
    """The provider's counters since the segment was created."""

    admitted_total: Annotated[Count, Meta(description="requests admitted to a slot")]
    rejected_total: Annotated[Count, Meta(description="refused at once: 32 waited (QueueFull)")]
    timeouts_total: Annotated[Count, Meta(description="waited until their timeout")]
    cancelled_total: Annotated[Count, Meta(description="waiting requests their caller cancelled")]
    reclaimed_total: Annotated[Count, Meta(description="records of dead processes reclaimed")]
    peak_running: Annotated[Count, Meta(description="most requests running at once")]
    peak_waiting: Annotated[Count, Meta(description="most requests waiting at once")]
    promoted_total: Annotated[
        Count, Meta(description="grants only a waiter's promotion after maxWait allowed")
    ] = 0
    displaced_total: Annotated[
        Count, Meta(description="waiters displaced from a full queue by a higher class")
    ] = 0


class InspectProvider(Provider, kw_only=True):
    """A provider's row with what the sidecar wrote and the stored counters."""

    published_limit: Annotated[int | None, Meta(description="as the sidecar wrote it")]
    clamped: Annotated[bool, Meta(description="the static limit was above the running room")]
    counters: Counters
    stored_running: Annotated[int, Meta(description="the counter as stored (derived, R-A6)")]
    stored_waiting: Annotated[int, Meta(description="the counter as stored (derived, R-A6)")]


class Holder(Struct, kw_only=True):
    """A running slot or waiting place, owned by a process (pid + start time)."""

    provider: Annotated[str, Meta(description="the provider it holds or waits for")]
    index: Annotated[int, Meta(description="its record's index in the provider's table")]
    state: Annotated[str, Meta(description="'running' or 'waiting'")]
    pid: Annotated[int, Meta(description="the owning process")]
    alive: Annotated[bool, Meta(description="that process still runs (pid and start time)")]
    ticket: Annotated[int, Meta(description="arrival order (R-A3)")]
    serial: Annotated[int, Meta(description="the record's reuse counter")]
    member: Annotated[int, Meta(description="index of the owning handler process's registration")]
    generation: Annotated[str | None, Meta(description="the owner's generation label")]
    since: Annotated[UnixTime, Meta(description="when it arrived or was admitted")]
    tokens: Annotated[Count, Meta(description="tokens it is charged (0: slots only)")] = 0


class Member(Struct, kw_only=True):
    """A registered handler process (R-G1)."""

    index: Annotated[int, Meta(description="its registration's index")]
    pid: Annotated[int, Meta(description="its process id")]
    alive: Annotated[bool, Meta(description="that process still runs (pid and start time)")]
    generation: Annotated[str, Meta(description="the label it attached with")]
    layout: Annotated[str, Meta(description="layout version it speaks, major.minor")]
    attached_at: Annotated[UnixTime, Meta(description="when it attached")]


class InspectDoc(_SegmentDoc, kw_only=True):
    """gateway-capacity inspect --json: availability's figures plus the segment's
    header, the counters and every holder record."""

    header: Header
    generations: Annotated[list[Member], Meta(description="registered handler processes")]
    providers: Annotated[list[InspectProvider], Meta(description="one row per provider")]
    holders: Annotated[list[Holder], Meta(description="every live or dead holder record")]


# --- from a segment view ----------------------------------------------------------------------
# The view's dataclasses carry the documents' fields under the same names, so each row is
# converted by name (msgspec reads the attributes and checks them against the Struct's
# types: a row never says what its own schema does not allow); only what the view does
# not hold as such (the sidecar's phrase, the header, the damage) is built by hand here.
def _row(obj: object, kind: type[_S]) -> _S:
    return msgspec.convert(obj, kind, from_attributes=True)


def sidecar_status(s: SidecarView) -> str:
    """The sidecar's state as one phrase (the process's liveness and what it last wrote)."""
    if s.alive:
        return "running" if s.state == "running" else "stopping"
    if s.state == "running":
        return "died without stopping (crashed or killed)"
    return "stopped"


def _common(view: SegmentView) -> dict[str, Any]:
    """The fields both documents open with."""
    s = view.sidecar
    return {
        "schema_version": SCHEMA_VERSION,
        "segment": view.name,
        "config_path": view.config_path or None,
        "layout": Layout(major=view.major, minor=view.minor),
        "consistent": view.consistent,
        "config_status": view.config_status or None,
        "sidecar": None if s is None else _sidecar(s),
        "owner": view.owner,
        "damage": (
            Damage(repairs=view.damage_repairs, last=view.damage_note, age_s=view.damage_age_s)
            if view.damage_repairs
            else None
        ),
        "lock_problem": view.lock_problem,
    }


def _sidecar(s: SidecarView) -> Sidecar:
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


def availability(view: SegmentView) -> AvailabilityDoc:
    """``availability --json`` of a ``shm_layout.view.SegmentView``."""
    return AvailabilityDoc(
        **_common(view),
        generations=[_row(m, Generation) for m in view.members],
        providers=[_row(p, Provider) for p in view.providers],
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
        generations=[_row(m, Member) for m in view.members],
        providers=[_row(p, InspectProvider) for p in view.providers],
        holders=[_row(h, Holder) for h in view.holders],
    )


# --- the other commands' --json documents -------------------------------------------------------


class ErrorDoc(Struct, kw_only=True):
    """Any command with --json that could not run: the one line it would print on stderr,
    with the same exit code."""

    schema_version: Version
    error: Annotated[str, Meta(description="what went wrong and what to fix, one line")]


class HealthDoc(Struct, kw_only=True):
    """gateway-capacity availability --check --json: the health check."""

    schema_version: Version
    ok: Annotated[bool, Meta(description="no problem and no warning found (exit 0)")]
    problems: Annotated[
        list[str],
        Meta(description="one line per problem, each naming the fix (any: exit 1)"),
    ]
    warnings: Annotated[
        list[str],
        Meta(
            description="one line per state that may be meant but stops admission "
            "(only these: exit 4)"
        ),
    ] = []


class ListedSidecar(Struct, kw_only=True):
    """The sidecar that last wrote a listed segment."""

    pid: Annotated[int, Meta(description="its process id")]
    alive: Annotated[bool, Meta(description="that process still runs (pid and start time)")]
    status: Annotated[str, Meta(description="one phrase: running, stopping, stopped, ...")]


class ListedSegment(Struct, kw_only=True):
    """One segment of this user (or of the configured owner) in /dev/shm."""

    name: Annotated[str, Meta(description="the segment name, for --segment")]
    config_path: Annotated[
        str | None, Meta(description="the config its sidecar read (null: no sidecar has run)")
    ] = None
    sidecar: Annotated[
        ListedSidecar | None, Meta(description="the sidecar that last wrote it (null: none)")
    ] = None
    handlers: Annotated[Count, Meta(description="handler processes attached and alive")] = 0
    error: Annotated[
        str | None, Meta(description="why it could not be read (then nothing else is known)")
    ] = None


class SegmentsDoc(Struct, kw_only=True):
    """gateway-capacity segments --json: the segments of this user that exist."""

    schema_version: Version
    segments: Annotated[list[ListedSegment], Meta(description="by name")]


class CheckedAddress(Struct, kw_only=True):
    """One resolved address of the provider's host and its verdict (R-P1)."""

    address: Annotated[str, Meta(description="the resolved address")]
    allowed: Annotated[bool, Meta(description="the key may be sent there")]
    detail: Annotated[str, Meta(description="why: loopback, tailnet peer, range-checked, ...")]


class ConfiguredClass(Struct, kw_only=True):
    """One admission class as the config gives it (docs/classes.md)."""

    name: Annotated[str, Meta(description="the class's name")]
    reserve: Annotated[Count, Meta(description="slots no lower class may take")]
    cap: Annotated[Count | None, Meta(description="most running at once, or null: none")]
    max_wait: Annotated[
        float | None, Meta(description="seconds before a waiter is promoted, or null: never")
    ]
    default: Annotated[bool, Meta(description="the class of a request that names none")]


class CheckedProvider(Struct, kw_only=True):
    """One provider of the config, checked as a probe would, nothing sent."""

    id: Annotated[str, Meta(description="the provider id")]
    discovery_requested: Annotated[bool, Meta(description="capacityDiscovery is true")]
    discovery_active: Annotated[bool, Meta(description="discovery would be active now")]
    reason: Annotated[str, Meta(description="the first problem, or the opt-in's status")]
    problems: Annotated[list[str], Meta(description="every problem of the entry")]
    fallback_limit: Annotated[Count, Meta(description="the static limit it falls back to")]
    fallback_source: FallbackSource
    fallback_share: Annotated[
        bool,
        Meta(
            description="share mode's fallback: 0 whenever no share is in force (source 'default')"
        ),
    ] = False
    endpoint: Annotated[str | None, Meta(description="the capacity URL that would be probed")]
    addresses: Annotated[list[CheckedAddress], Meta(description="each resolved address")]
    credential: Annotated[
        str | None, Meta(description="'ok', why the key file is unusable, or null: not read")
    ]
    probe: Annotated[
        ProbeResult | None,
        Meta(description="with --probe and discovery asked for: what the probe got, else null"),
    ] = None
    classes: Annotated[
        list[ConfiguredClass],
        Meta(description="its admission classes, highest first; empty: one queue"),
    ] = []
    class_problems: Annotated[
        list[str],
        Meta(description="every problem of classes/defaultClass: the classes are refused"),
    ] = []


class ProbedReplica(Struct, kw_only=True):
    """One address the probe sent to (check-config --probe)."""

    address: Annotated[str, Meta(description="the resolved, checked address")]
    ok: Annotated[bool, Meta(description="a valid, fresh capacity answer")]
    reason: Annotated[str, Meta(description="ok, no_endpoint, auth_failed, timeout, ...")]
    detail: Annotated[str, Meta(description="more about it (never the key)")]
    complete: Annotated[bool, Meta(description="the answer's complete flag")]
    models: Annotated[
        dict[str, int], Meta(description="upstream model id -> max_concurrent_requests")
    ]
    request_tokens: Annotated[
        dict[str, int],
        Meta(description="upstream model id -> max_request_tokens, where the row states it"),
    ]
    running_tokens: Annotated[
        dict[str, int],
        Meta(description="upstream model id -> max_running_tokens, where the row states it"),
    ]


class ProbeResult(Struct, kw_only=True):
    """check-config --probe: one real probe of {baseUrl}/capacity, under the probe's rules."""

    ok: Annotated[bool, Meta(description="some replica gave a valid answer")]
    refused: Annotated[
        str | None, Meta(description="why nothing was sent (reason:detail), or null")
    ]
    replicas: Annotated[list[ProbedReplica], Meta(description="each address sent to")]
    missing_models: Annotated[
        list[str], Meta(description="configured upstream models no answer reports")
    ]
    hints: Annotated[list[str], Meta(description="what to do about what it got")]


class UnknownConfigKey(Struct, kw_only=True):
    """A key of the product's objects that is probably a typo (ignored; --strict fails)."""

    where: Annotated[str, Meta(description="the object: the top level, providers[i] (id), ...")]
    key: Annotated[str, Meta(description="the key as written")]
    suggestion: Annotated[str | None, Meta(description="the known key it resembles, or null")]


class ShareSentinelCheck(Struct, kw_only=True):
    """The Sentinel set that names share mode's Redis master."""

    master: Annotated[str, Meta(description="the master's name in the sentinels' config")]
    addresses: Annotated[list[str], Meta(description="the sentinels, host:port")]


class ShareCheck(Struct, kw_only=True):
    """Share mode (capacityShare) as check-config sees it, nothing sent to Redis."""

    on: Annotated[bool, Meta(description="capacityShare is set: share mode")]
    redis: Annotated[
        str | None, Meta(description="the Redis URL without userinfo, or null (a Sentinel set)")
    ]
    sentinel: Annotated[
        ShareSentinelCheck | None, Meta(description="the Sentinel set, or null (one Redis)")
    ] = None
    listener_owner: Annotated[
        int | str | None,
        Meta(description="who must own a loopback Redis's listener; null: the default owners"),
    ] = None
    gateway: Annotated[str | None, Meta(description="this gateway's name, or null")]
    redis_py: Annotated[
        str, Meta(description="'importable (VERSION)' or why not, with the install command")
    ]
    credential: Annotated[
        str | None,
        Meta(description="'ok' (readable, not shown), why the file is unusable, or null: none"),
    ]
    problems: Annotated[list[str], Meta(description="what stops share mode from starting")]


class CheckConfigDoc(Struct, kw_only=True):
    """gateway-capacity check-config --json: per provider, would discovery be active."""

    schema_version: Version
    config: Annotated[str, Meta(description="the config file checked")]
    max_concurrent: Annotated[
        int | None, Meta(description="the gateway-wide maxConcurrent, or null")
    ]
    providers: Annotated[list[CheckedProvider], Meta(description="one per usable entry")]
    skipped: Annotated[list[str], Meta(description="entries skipped, each with its reason")]
    segment: Annotated[str | None, Meta(description="the segment this config's users share")]
    segment_from: Annotated[str, Meta(description="what the segment name comes from")]
    unknown_keys: Annotated[
        list[UnknownConfigKey], Meta(description="keys of ours that are probably typos")
    ] = []
    share: Annotated[ShareCheck, Meta(description="share mode: on or off, and can it start")]


class VerifiedProvider(Struct, kw_only=True):
    """One provider: the rules' limit for a probe made now beside the segment's."""

    id: Annotated[str, Meta(description="the provider id")]
    agree: Annotated[bool, Meta(description="the segment's limit and token budget are the rules'")]
    status: Annotated[
        Literal["ok", "differs", "missing_models", "no_answer"],
        Meta(description="the verdict; no_answer: could not compare"),
    ]
    missing_models: Annotated[
        list[str], Meta(description="configured upstream models a complete answer lacks")
    ]
    rules_limit: Annotated[int, Meta(description="what the rules give now")]
    rules_source: Source
    rules_reason: Annotated[str, Meta(description="why, in full")]
    rules_token_limit: Annotated[
        int, Meta(description="the running-token budget the rules give now; 0: none (R-L10)")
    ]
    rules_request_token_limit: Annotated[
        int, Meta(description="the most one request may hold, by the rules now; 0: unknown")
    ]
    segment_limit: Annotated[int | None, Meta(description="the limit in the segment")]
    segment_source: Annotated[str | None, Meta(description="its source in the segment")]
    segment_token_limit: Annotated[
        int, Meta(description="the running-token budget in force in the segment; 0: none")
    ]
    segment_request_token_limit: Annotated[
        int, Meta(description="the most one request may hold, in the segment; 0: unknown")
    ]
    tokens_agree: Annotated[
        bool,
        Meta(
            description="the segment's token budget is the rules' (share mode: within the "
            "pool, the same per-request bound)"
        ),
    ]
    replicas: Annotated[list[Replica], Meta(description="each replica as probed now")]


class VerifyDoc(Struct, kw_only=True):
    """gateway-capacity verify --json."""

    schema_version: Version
    segment: Annotated[str, Meta(description="the segment compared with")]
    config: Annotated[str, Meta(description="the config the rules came from")]
    agree: Annotated[bool, Meta(description="every provider's limit agrees")]
    ok: Annotated[bool, Meta(description="exit 0: agrees, no model missing, all answered")]
    providers: Annotated[list[VerifiedProvider], Meta(description="one row per provider")]
    sidecar: Annotated[
        str | None,
        Meta(description="no sidecar, or it stopped or is stale, and since when; null: it runs"),
    ] = None


class WaitForSlotDoc(Struct, kw_only=True):
    """gateway-capacity wait-for-slot --json: how the wait ended."""

    schema_version: Version
    outcome: Annotated[
        Literal["room", "no_room", "gave_up", "unreachable", "error"],
        Meta(description="how it ended"),
    ]
    exit_code: Annotated[int, Meta(description="the command's exit code")]
    running: Annotated[float | None, Meta(description="running in the last sample")]
    waiting: Annotated[float | None, Meta(description="waiting in the last sample")]
    need: Annotated[int, Meta(description="--need")]
    limit: Annotated[
        int | None,
        Meta(
            description="the limit of the last sample; without one, metrics mode's --limit "
            "(or its default); null when unknown"
        ),
    ]
    reason: Annotated[
        str | None, Meta(description="why the last sample had no load to show, in full")
    ]
    samples: Annotated[int, Meta(description="samples taken")]
    waited_s: Annotated[float, Meta(description="seconds waited")]
    error: Annotated[str, Meta(description="on exit 2: the line text mode prints")] = ""


class CapacityRow(Struct, kw_only=True):
    """One row of the capacity contract (REQUIREMENTS.md section 4)."""

    id: Annotated[str, Meta(description="upstream model id")]
    max_concurrent_requests: Annotated[int, Meta(description="the farm's slots for it")]
    max_request_tokens: Annotated[
        int | None,
        Meta(description="the most one request may hold (R-K7); absent: unknown"),
    ] = None
    max_running_tokens: Annotated[
        int | None,
        Meta(description="what all its running requests may hold together; absent: unknown"),
    ] = None


class CapacityAnswer(Struct, kw_only=True):
    """The router's capacity snapshot, as GET /v1/capacity serves it."""

    object: Annotated[Literal["inference_capacity"], Meta(description="the contract's name")]
    version: Annotated[Literal[1], Meta(description="the contract's version")]
    complete: Annotated[bool, Meta(description="every answering worker could be read")]
    observed_at: Annotated[UnixTime, Meta(description="when the observation round started")]
    models: Annotated[list[CapacityRow], Meta(description="one row per registered model id")]


class RouterWorker(Struct, kw_only=True):
    """A registered worker and what fences it (from the loopback admin endpoint)."""

    id: Annotated[str, Meta(description="the worker id from the registry")]
    fenced_by: Annotated[
        Literal["registry", "admin"] | None,
        Meta(description="the registry file, router fence, or null: in service"),
    ]
    state: Annotated[
        Literal["ok", "unreadable", "unhealthy", "unreachable"] | None,
        Meta(description="the last round's view; absent while fenced or before a round"),
    ] = None
    slots: Annotated[
        int | None, Meta(description="the slots read (ok only): per model when it says")
    ] = None
    reason: Annotated[str | None, Meta(description="how the slots were read, or why not")] = None
    unserved: Annotated[
        list[str] | None,
        Meta(description="registered model ids this worker does not serve (counted 0)"),
    ] = None
    activity: Annotated[
        str | None,
        Meta(description="what the worker says it is doing (vLLM gauges, loaded models)"),
    ] = None
    unlisted: Annotated[
        list[str] | None,
        Meta(
            description="registered model ids this worker does not list but counts: it "
            "answers any model with its one (llama-server without --alias, TGI)"
        ),
    ] = None
    request_tokens: Annotated[
        int | None,
        Meta(description="the most one request may hold on it, where it states it (R-K7)"),
    ] = None
    running_tokens: Annotated[
        int | None,
        Meta(
            description="what its running requests may hold, as reported (lowered while "
            "it preempts)"
        ),
    ] = None
    tokens_from: Annotated[
        str | None, Meta(description="where the token figures come from, and why lowered")
    ] = None


class RouterShowDoc(Struct, kw_only=True):
    """gateway-capacity router show --json."""

    schema_version: Version
    snapshot: CapacityAnswer
    workers: Annotated[
        list[RouterWorker] | None,
        Meta(description="registered workers; null from a router without /admin/workers"),
    ]
    warnings: Annotated[
        list[str],
        Meta(
            description="the router's warnings about its registry: two workers that "
            "resolve to one socket address (their slots may count twice)"
        ),
    ] = []


class RouterFenceDoc(Struct, kw_only=True):
    """gateway-capacity router fence|unfence --json."""

    schema_version: Version
    worker: Annotated[str, Meta(description="the worker fenced or restored")]
    fenced: Annotated[bool, Meta(description="true after fence, false after unfence")]
    snapshot: CapacityAnswer


class DemoPhase(Struct, kw_only=True):
    """One phase of the demo."""

    name: Annotated[str, Meta(description="what the phase does")]
    expected_limit: Annotated[int, Meta(description="the limit it should reach")]
    reached_after_s: Annotated[float | None, Meta(description="seconds until it did; null: never")]
    limits_seen: Annotated[
        list[int], Meta(description="every limit sampled once the expected one was reached")
    ]
    advertised_seen: Annotated[list[int], Meta(description="every advertised value sampled")]
    peak_running: Annotated[
        int, Meta(description="most running once the expected limit was reached")
    ]
    peak_waiting: Annotated[
        int, Meta(description="most waiting once the expected limit was reached")
    ]
    changeover_limits_seen: Annotated[
        list[int],
        Meta(description="limits sampled before the expected one was reached (the last phase's)"),
    ] = []
    changeover_peak_running: Annotated[
        int, Meta(description="most running before the expected limit was reached")
    ] = 0
    changeover_peak_waiting: Annotated[
        int, Meta(description="most waiting before the expected limit was reached")
    ] = 0
    over_limit_running: Annotated[
        int,
        Meta(
            description="most running sampled above the limit in force (requests admitted "
            "before it was lowered, finishing); 0: never above it"
        ),
    ] = 0


class DemoLoad(Struct, kw_only=True):
    """What one handler generation's load process did."""

    generation: Annotated[str, Meta(description="its generation label")]
    admitted: Annotated[int, Meta(description="requests admitted")]
    queue_full: Annotated[int, Meta(description="requests refused with QueueFull")]
    timeouts: Annotated[int, Meta(description="requests that timed out waiting")]
    wait_p50_ms: Annotated[
        int | None, Meta(description="the interactive load: median wait for admission")
    ] = None
    wait_max_ms: Annotated[
        int | None, Meta(description="the interactive load: longest wait for admission")
    ] = None


class DemoDoc(Struct, kw_only=True):
    """gateway-capacity demo --json: the summary (the live lines go to stderr)."""

    schema_version: Version
    load: Annotated[list[DemoLoad], Meta(description="per load process")] = []
    phases: Annotated[list[DemoPhase], Meta(description="the phases, in order")] = []
    peak_running: Annotated[int, Meta(description="the provider's peak running")] = 0
    peak_waiting: Annotated[int, Meta(description="the provider's peak waiting")] = 0
    admitted: Annotated[int, Meta(description="admitted in all")] = 0
    rejected: Annotated[int, Meta(description="refused with QueueFull in all")] = 0
    timeouts: Annotated[int, Meta(description="timed out in all")] = 0
    final_running: Annotated[int, Meta(description="running at the end (0)")] = 0
    final_waiting: Annotated[int, Meta(description="waiting at the end (0)")] = 0
    holder_records_left: Annotated[int, Meta(description="records left at the end (0)")] = 0
    segment: Annotated[str, Meta(description="the demo's own segment")]
    picture: Annotated[str | None, Meta(description="the PNG drawn, or null")]
    cleaned_up: Annotated[bool, Meta(description="no process or shared object left")]
    problems: Annotated[list[str], Meta(description="what went wrong; empty: ok")]
    ok: Annotated[bool, Meta(description="exit 0")]


# --- the JSON Schemas ---------------------------------------------------------------------------
SCHEMAS: Final[dict[str, tuple[type[Struct], str]]] = {
    "availability.schema.json": (AvailabilityDoc, "gateway-capacity availability --json"),
    "inspect.schema.json": (InspectDoc, "gateway-capacity inspect --json"),
    "availability-check.schema.json": (HealthDoc, "gateway-capacity availability --check --json"),
    "segments.schema.json": (SegmentsDoc, "gateway-capacity segments --json"),
    "check-config.schema.json": (CheckConfigDoc, "gateway-capacity check-config --json"),
    "verify.schema.json": (VerifyDoc, "gateway-capacity verify --json"),
    "wait-for-slot.schema.json": (WaitForSlotDoc, "gateway-capacity wait-for-slot --json"),
    "router-show.schema.json": (RouterShowDoc, "gateway-capacity router show --json"),
    "router-fence.schema.json": (RouterFenceDoc, "gateway-capacity router fence|unfence --json"),
    "demo.schema.json": (DemoDoc, "gateway-capacity demo --json"),
    "error.schema.json": (ErrorDoc, "any --json output of a command that could not run"),
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
