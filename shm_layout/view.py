"""A consistent, lock-free picture of the segment for readers (inspect, availability).

Readers never take the lock: they copy the whole segment between two reads
of ``change_seq`` and retry while it is odd or moved. A writer that died
mid-write leaves it odd until the next lock holder repairs it; after a few
retries the reader returns the copy anyway with ``consistent=False``.

Running and waiting are counted from the holder records of *live* processes,
never from the counters, so a dead process's records are not counted even
before they are reclaimed (R-A5). Liveness is the kernel's word: a record's
member still holds its lock byte (``lock.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from shm_layout import _core, layout, platform
from shm_layout.layout import (
    CLASS,
    HEADER,
    HOLDER,
    HOLDER_FREE,
    HOLDER_RUNNING,
    HOLDER_STATES,
    HOLDER_WAITING,
    MEMBER,
    PROVIDER,
    REPLICA,
)
from shm_layout.liveness import is_alive
from shm_layout.lock import kind_name, members_alive, stamp
from shm_layout.owners import OwnerPolicy
from shm_layout.rows import (
    class_base,
    effective_limit,
    holder_base,
    in_room,
    member_base,
    provider_base,
    resolve_class,
    token_budget,
)
from shm_layout.segment import describe_owner, map_readonly, truncated

READ_RETRIES = 200
STUCK_S = 0.02


@dataclass(frozen=True, slots=True)
class ReplicaView:
    address: str
    ok: bool
    complete: bool
    value: int | None
    reason: str
    observed_at: float | None


@dataclass(frozen=True, slots=True)
class ClassView:
    """One admission class of a provider (DESIGN.md section 6b), highest first."""

    name: str
    reserve: int
    cap: int | None
    max_wait_s: float | None
    running: int  # from the records of live processes, like the provider's
    waiting: int
    admitted_total: int
    default: bool


@dataclass(frozen=True, slots=True)
class ProviderView:
    index: int
    id: str
    capacity_discovery: bool
    configured: bool
    clamped: bool
    effective_limit: int
    source: layout.Source
    reason: str
    running: int
    waiting: int
    queue_bound: int
    fallback_limit: int
    fallback_source: layout.Source
    published_limit: int | None
    discovered: int | None
    observed_at: float | None
    expires_at: float | None
    expires_mono: float | None  # the same deadline on the deadline clock (R-L7)
    replicas: tuple[ReplicaView, ...]
    counters: dict[str, int]
    stored_running: int
    stored_waiting: int
    classes: tuple[ClassView, ...] = ()
    # classes configured, but a handler of an older layout minor is registered: one FIFO
    classes_suspended: bool = False
    promoted_total: int = 0
    displaced_total: int = 0
    # the token budget (DESIGN.md section 6c): None while none is in force (slots alone)
    token_limit: int | None = None
    request_token_limit: int | None = None  # the most one request may hold; None unknown
    tokens_running: int = 0  # the charges of live running records, like ``running``
    # a token budget is published, but a handler of a minor below 3.2 is registered:
    # admission is on slots alone until it is gone
    tokens_suspended: bool = False


@dataclass(frozen=True, slots=True)
class HolderView:
    provider: str
    index: int
    state: str
    pid: int
    alive: bool
    ticket: int
    serial: int
    member: int
    generation: str | None
    since: float
    tokens: int = 0  # its charge (layout 3.2); 0 slots only


@dataclass(frozen=True, slots=True)
class MemberView:
    index: int
    pid: int
    alive: bool
    generation: str
    layout: str
    attached_at: float


@dataclass(frozen=True, slots=True)
class SidecarView:
    pid: int
    alive: bool
    state: str
    heartbeat_age_s: float | None
    writer_epoch: int
    config_generation: int
    refresh_s: float
    legacy_alive: int
    legacy_since: float | None = None  # when the legacy drain began, deadline clock (R-G3)
    legacy_max_s: float = 0.0  # --await-legacy-max
    legacy_pid: int = 0  # one legacy process still awaited

    def legacy_overdue(self, now: float) -> float | None:
        """How long the legacy drain has lasted at ``now`` (the deadline clock), when that
        is over its bound; else None."""
        if not self.legacy_alive or self.legacy_since is None or self.legacy_max_s <= 0:
            return None
        lasted = now - self.legacy_since
        return lasted if lasted > self.legacy_max_s else None


@dataclass(frozen=True, slots=True)
class SegmentView:
    name: str
    major: int
    minor: int
    created_at: float
    group_shared: bool
    consistent: bool
    read_at: float
    read_mono: float  # the deadline clock when read (for deadlines and ages)
    lock_kind: str
    lock_repairs: int
    damage_repairs: int  # sweeps that found counters or records damaged (R-A16)
    damage_note: str
    damage_age_s: float | None  # how long ago the last of them ran
    lock_problem: str | None  # a damaged lock word, with the recovery (R-A16)
    owner: str | None  # user:group of the object (R-G6)
    config_status: str
    config_path: str
    sidecar: SidecarView | None
    providers: tuple[ProviderView, ...]
    holders: tuple[HolderView, ...] = field(default=())
    members: tuple[MemberView, ...] = field(default=())

    def provider(self, provider_id: str) -> ProviderView | None:
        for p in self.providers:
            if p.id == provider_id:
                return p
        return None


def snapshot_bytes(buf: Any) -> tuple[bytes, bool]:
    """Copy the segment under the sequence counter: (copy, consistent).

    A section lasts microseconds. The same odd value for ``STUCK_S`` means a
    holder that is stopped, or died inside and nobody has entered since: the copy
    is returned at once, marked inconsistent, rather than after every retry.
    """
    seq = HEADER["change_seq"]
    copy = b""
    stuck: tuple[int, float] | None = None
    for _ in range(READ_RETRIES):
        before = seq.get(buf)
        if before % 2 == 0:
            copy = bytes(buf)
            if seq.get(buf) == before:
                return copy, True
        elif stuck is None or stuck[0] != before:
            stuck = (before, time.monotonic())
        elif time.monotonic() - stuck[1] >= STUCK_S:
            break
        time.sleep(0.001)
    return copy or bytes(buf), False


def read_view(
    name: str,
    *,
    now: float | None = None,
    policy: OwnerPolicy | None = None,
    wait_init: bool = True,
) -> SegmentView:
    """Map ``name`` read-only and describe it. Raises the ``SegmentError`` family; with
    ``policy``, a segment of an owner it does not trust is refused (R-G6)."""
    buf = map_readonly(name, policy=policy, wait_init=wait_init)
    try:
        data, consistent = snapshot_bytes(buf)
        if buf.damaged:  # truncated while it was read: what was read is zeros
            raise truncated(name)
    finally:
        buf.close()
    return parse_view(name, data, consistent=consistent, now=now, owner=describe_owner(name))


def lock_problem(name: str, data: bytes) -> str | None:
    """What is wrong with the segment's lock word, with the recovery; None when nothing."""
    if HEADER["lock_kind"].get(data) != layout.LOCK_ROBUST or not _core.HAVE_ROBUST:
        return None
    sane, _locked, _tid, _exists = _core.mutex_state(data, layout.MUTEX_OFFSET)
    if sane:
        return None
    return (
        "its lock word holds bytes no lock call of ours wrote (damage): stop its handlers "
        f"and sidecar, then 'gateway-capacity inspect --segment {name} --unlink --force' and "
        "start them again"
    )


def parse_view(
    name: str,
    data: bytes,
    *,
    consistent: bool = True,
    now: float | None = None,
    mono: float | None = None,
    owner: str | None = None,
) -> SegmentView:
    """``now``: the wall clock, for what people read; ``mono``: the deadline clock, for
    what is in force (R-L7). Each defaults to the clock's reading now."""
    now = time.time() if now is None else now
    mono = platform.deadline_now() if mono is None else mono
    kind = HEADER["lock_kind"].get(data)
    registered = _lock_rows(data)
    mark = stamp(data) if kind == layout.LOCK_FILE else b""
    # the kernel's word, per member row: its lock byte is held (serial 0: whoever holds
    # it). A record is alive when its row's byte is held, as the core judges it: the
    # record's serial is not consulted (R-A5, R-A16)
    held = dict(zip(registered, members_alive(name, kind, registered, mark), strict=True))
    alive = _AliveByRow(held)
    members = _members(data, alive)
    labels = {m.index: m.generation for m in members}
    providers: list[ProviderView] = []
    holders: list[HolderView] = []
    for p in range(layout.PROVIDER_COUNT):
        base = provider_base(p)
        if not PROVIDER["in_use"].get(data, base):
            break
        pid_text = layout.decode_text(PROVIDER["id"].get(data, base))
        running = waiting = tokens = 0
        by_class = [[0, 0] for _ in range(layout.CLASS_COUNT)]
        for h in range(layout.HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            state = HOLDER["state"].get(data, hb)
            if state == HOLDER_FREE:
                continue
            pid = HOLDER["pid"].get(data, hb)
            member = HOLDER["member"].get(data, hb)
            holder_alive = alive.get((member, HOLDER["member_serial"].get(data, hb)), False)
            k = resolve_class(data, p, HOLDER["cls"].get(data, hb) - 1)
            charge = HOLDER["tokens"].get(data, hb)
            if holder_alive and state == HOLDER_RUNNING:
                running += 1
                tokens += charge
                by_class[k][0] += 1
            elif holder_alive and state == HOLDER_WAITING:
                waiting += 1
                by_class[k][1] += 1
            holders.append(
                HolderView(
                    provider=pid_text,
                    index=h,
                    state=HOLDER_STATES.get(state, f"corrupt({state})"),
                    pid=pid,
                    alive=holder_alive,
                    ticket=HOLDER["ticket"].get(data, hb),
                    serial=HOLDER["serial"].get(data, hb),
                    member=member,
                    generation=labels.get(member),
                    since=HOLDER["since"].get(data, hb),
                    tokens=charge,
                )
            )
        providers.append(_provider(data, p, running, waiting, now, mono, by_class, tokens))
    return SegmentView(
        name=name,
        major=HEADER["major"].get(data),
        minor=HEADER["minor"].get(data),
        created_at=HEADER["created_at"].get(data),
        group_shared=bool(HEADER["flags"].get(data) & layout.FLAG_GROUP_SHARED),
        consistent=consistent,
        read_at=now,
        read_mono=mono,
        lock_kind=kind_name(kind),
        lock_repairs=HEADER["repairs"].get(data),
        damage_repairs=HEADER["damage_repairs"].get(data),
        damage_note=layout.decode_text(HEADER["damage_note"].get(data)),
        damage_age_s=(
            round(mono - HEADER["damage_mono"].get(data), 3)
            if HEADER["damage_repairs"].get(data)
            else None
        ),
        lock_problem=lock_problem(name, data),
        owner=owner,
        config_status=layout.decode_text(HEADER["config_status"].get(data)),
        config_path=layout.decode_text(HEADER["config_path"].get(data)),
        sidecar=_sidecar(data, now, mono),
        providers=tuple(providers),
        holders=tuple(holders),
        members=tuple(members),
    )


def class_name_bytes(name: str) -> bytes | None:
    """``name`` as a class row holds it (UTF-8, NUL-padded), or None when no row can hold
    it whole: a longer name is never cut to match a class by its first bytes."""
    raw = name.encode("utf-8", "replace")
    if not raw or len(raw) > layout.CLASS_NAME_BYTES or b"\0" in raw:
        return None
    return raw.ljust(layout.CLASS_NAME_BYTES, b"\0")


def class_index(buf: Any, p: int, name: str) -> int:
    """The row of provider ``p``'s class called ``name``, matched whole; -1 none
    (lock-free)."""
    count = min(PROVIDER["class_count"].get(buf, provider_base(p)), layout.CLASS_COUNT)
    wanted = class_name_bytes(name)
    if wanted is None:
        return -1
    for k in range(count):
        if CLASS["name"].get(buf, class_base(p, k)) == wanted:
            return k
    return -1


def _classes(data: bytes, p: int, by_class: list[list[int]]) -> tuple[ClassView, ...]:
    count = min(PROVIDER["class_count"].get(data, provider_base(p)), layout.CLASS_COUNT)
    default = resolve_class(data, p, -1)
    out = []
    for k in range(count):
        cb = class_base(p, k)
        cap = CLASS["cap"].get(data, cb)
        wait_ms = CLASS["max_wait_ms"].get(data, cb)
        out.append(
            ClassView(
                name=layout.decode_text(CLASS["name"].get(data, cb)),
                reserve=CLASS["reserve"].get(data, cb),
                cap=cap or None,
                max_wait_s=wait_ms / 1000.0 if wait_ms else None,
                running=by_class[k][0],
                waiting=by_class[k][1],
                admitted_total=CLASS["admitted_total"].get(data, cb),
                default=k == default,
            )
        )
    return tuple(out)


def _provider(
    data: bytes,
    p: int,
    running: int,
    waiting: int,
    now: float,
    mono: float,
    by_class: list[list[int]] | None = None,
    tokens: int = 0,
) -> ProviderView:
    base = provider_base(p)
    limit = effective_limit(data, p, mono)
    budget = token_budget(data, p, mono)
    flags = PROVIDER["flags"].get(data, base)
    published = PROVIDER["published_limit"].get(data, base)
    discovered = PROVIDER["discovered"].get(data, base)
    observed = PROVIDER["observed_at"].get(data, base)
    expires = PROVIDER["expires_at"].get(data, base)
    replicas = []
    for r in range(min(PROVIDER["replica_count"].get(data, base), layout.REPLICA_COUNT)):
        rb = base + layout.REPLICA_BASE + r * layout.REPLICA_ROW_SIZE
        value = REPLICA["value"].get(data, rb)
        r_observed = REPLICA["observed_at"].get(data, rb)
        replicas.append(
            ReplicaView(
                address=layout.decode_text(REPLICA["address"].get(data, rb)),
                ok=bool(REPLICA["ok"].get(data, rb)),
                complete=bool(REPLICA["complete"].get(data, rb)),
                value=value if value >= 0 else None,
                reason=layout.decode_text(REPLICA["reason"].get(data, rb)),
                observed_at=r_observed or None,
            )
        )
    counters = {k: PROVIDER[k].get(data, base) for k in layout.PROVIDER_COUNTERS}
    return ProviderView(
        index=p,
        id=layout.decode_text(PROVIDER["id"].get(data, base)),
        capacity_discovery=bool(flags & layout.PFLAG_DISCOVERY),
        configured=bool(flags & layout.PFLAG_CONFIGURED),
        clamped=bool(flags & layout.PFLAG_CLAMPED),
        effective_limit=limit.value,
        source=limit.source,
        reason=limit.reason,
        running=running,
        waiting=waiting,
        queue_bound=PROVIDER["queue_bound"].get(data, base),
        fallback_limit=in_room(PROVIDER["fallback_limit"].get(data, base)),
        fallback_source=_fallback_source(PROVIDER["fallback_source"].get(data, base)),
        published_limit=published if published >= 0 else None,
        discovered=discovered if discovered >= 0 else None,
        observed_at=observed or None,
        expires_at=expires or None,
        expires_mono=PROVIDER["expires_mono"].get(data, base) or None,
        replicas=tuple(replicas),
        counters=counters,
        stored_running=PROVIDER["running"].get(data, base),
        stored_waiting=PROVIDER["waiting"].get(data, base),
        classes=_classes(data, p, by_class or [[0, 0]] * layout.CLASS_COUNT),
        classes_suspended=bool(
            PROVIDER["class_count"].get(data, base) and HEADER["older_members"].get(data)
        ),
        promoted_total=PROVIDER["promoted_total"].get(data, base),
        displaced_total=PROVIDER["displaced_total"].get(data, base),
        token_limit=budget.limit or None,
        request_token_limit=budget.request_limit or None,
        tokens_running=tokens,
        tokens_suspended=bool(budget.limit and budget.suspended),
    )


def _fallback_source(code: int) -> layout.Source:
    """Which maxConcurrent the fallback is; a code that names no fallback (written over,
    R-A16) reads as the default, so a view never says what no writer writes."""
    source = layout.SOURCES.get(code, layout.Source.DEFAULT)
    return source if source in layout.FALLBACK_SOURCES else layout.Source.DEFAULT


def _lock_rows(data: bytes) -> list[tuple[int, int]]:
    """(member, 0) of every member row in use or named by a record: the rows whose lock
    byte to ask the kernel about."""
    rows = {m for m in range(layout.MEMBER_COUNT) if MEMBER["in_use"].get(data, member_base(m))}
    for p in range(layout.PROVIDER_COUNT):
        if not PROVIDER["in_use"].get(data, provider_base(p)):
            break
        for h in range(layout.HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            if HOLDER["state"].get(data, hb) != HOLDER_FREE:
                m = HOLDER["member"].get(data, hb)
                if 0 <= m < layout.MEMBER_COUNT:
                    rows.add(m)
    return [(m, 0) for m in sorted(rows)]


class _AliveByRow:
    """``alive.get((member, serial))``: the member row's lock byte is held."""

    def __init__(self, held: dict[tuple[int, int], bool]) -> None:
        self._held = {m: ok for (m, _), ok in held.items()}

    def get(self, key: tuple[int, int], default: bool = False) -> bool:  # noqa: FBT001, FBT002 (dict.get's)
        return self._held.get(key[0], default)


def _members(data: bytes, alive: _AliveByRow) -> list[MemberView]:
    out = []
    for m in range(layout.MEMBER_COUNT):
        mb = member_base(m)
        if not MEMBER["in_use"].get(data, mb):
            continue
        pid = MEMBER["pid"].get(data, mb)
        out.append(
            MemberView(
                index=m,
                pid=pid,
                alive=alive.get((m, MEMBER["serial"].get(data, mb)), False),
                generation=layout.decode_text(MEMBER["label"].get(data, mb)),
                layout=f"{MEMBER['major'].get(data, mb)}.{MEMBER['minor'].get(data, mb)}",
                attached_at=MEMBER["attached_at"].get(data, mb),
            )
        )
    return out


def _sidecar(data: bytes, now: float, mono: float) -> SidecarView | None:
    pid = HEADER["sidecar_pid"].get(data)
    if pid == 0:
        return None
    heartbeat = HEADER["heartbeat_mono"].get(data)
    return SidecarView(
        pid=pid,
        alive=_sidecar_alive(pid, HEADER["sidecar_start"].get(data)),
        state=layout.SIDECAR_STATES.get(HEADER["sidecar_state"].get(data), "unknown"),
        # on the deadline clock: a stepped wall clock neither ages nor rejuvenates it
        heartbeat_age_s=round(mono - heartbeat, 3) if heartbeat else None,
        writer_epoch=HEADER["writer_epoch"].get(data),
        config_generation=HEADER["config_generation"].get(data),
        refresh_s=HEADER["refresh_s"].get(data),
        legacy_alive=HEADER["legacy_alive"].get(data),
        legacy_since=HEADER["legacy_since"].get(data) or None,
        legacy_max_s=HEADER["legacy_max_s"].get(data),
        legacy_pid=HEADER["legacy_pid"].get(data),
    )


def _sidecar_alive(pid: int, start: float) -> bool:
    try:
        return is_alive(pid, start)
    except (OverflowError, ValueError):  # a damaged header: not a pid we can ask about
        return False


@dataclass(frozen=True, slots=True)
class ProviderLoad:
    running: int
    waiting: int
    effective_limit: int


def read_provider_load(name: str, provider_id: str) -> ProviderLoad:
    """Running, waiting and the effective limit of one provider, for ``wait-for-slot`` (R-W4).

    Raises ``KeyError`` when the provider is not in the segment, and the
    ``SegmentError`` family when the segment cannot be read.
    """
    view = read_view(name)
    provider = view.provider(provider_id)
    if provider is None:
        raise KeyError(provider_id)
    return ProviderLoad(provider.running, provider.waiting, provider.effective_limit)
