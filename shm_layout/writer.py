"""The single writer of limits: fencing epochs, publication and heartbeat (R-G4, R-L7, R-L9).

A sidecar takes the next ``writer_epoch`` when it starts. Every later write is
committed by the core only while the header still carries that epoch (a guard
checked under the lock); a sidecar that finds a newer one raises
:class:`Superseded` and has written nothing. So a retired sidecar can never put
an older configuration or limit back.

Python never holds the segment lock (R-A11): each write is decided here on
plain values, then committed as one list of (offset, bytes) by
``Core.transact``, which applies it under the lock with the GIL released.

A refresh publishes every provider in **one** transaction (:func:`publish`).
Given a :class:`PublishCache` (the daemon keeps one per segment), it writes
only what changed since its last commit: a provider whose :class:`Publication`
is unchanged costs one comparison, a changed one only the bytes that differ,
and a provider's row index is looked up under the lock once, not at every
publication (rows are never moved or reused). The cache is sound because only
the holder of the writer epoch writes these fields, and it is updated only
after a commit succeeded.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from shm_layout import layout, platform
from shm_layout.errors import ProviderIdError
from shm_layout.errors import TableFull as TableFull
from shm_layout.layout import HEADER, PROVIDER, REPLICA, SOURCE_CODES, Field, Source
from shm_layout.rows import Buffer, encode_provider_id, provider_base
from shm_layout.segment import Segment
from shm_layout.view import ReplicaView


class Superseded(Exception):
    """A newer sidecar took the writer epoch."""

    def __init__(self, mine: int, current: int) -> None:
        self.mine = mine
        self.current = current
        super().__init__(f"writer epoch {mine} was superseded by epoch {current}")


class Patch:
    """Writes to commit in one locked step, in order."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, bytes]] = []

    def put(self, f: Field, value: object, base: int = 0) -> None:
        self.writes.append((base + f.offset, f.codec.pack(value)))

    def put_block(self, codec: struct.Struct, offset: int, *values: object) -> None:
        """Adjacent fields in one pack (``codec`` checked against the field table)."""
        self.writes.append((offset, codec.pack(*values)))


# A whole replica row in one pack: a publication writes 4 to 8 of them per provider, and
# one pack per row keeps a publication's CPU low (a field at a time would dominate it).
REPLICA_ROW = struct.Struct("<48sBB2xid64s")
layout._check_block(
    REPLICA_ROW, REPLICA["address"].offset, REPLICA, "address ok complete value observed_at reason"
)


# One admission class as written: (name, reserve, cap (0 none), maxWait in ms (0 never)).
ClassSpec = tuple[str, int, int, int]
CLASS_ROW = struct.Struct(f"<{layout.CLASS_NAME_BYTES}sHHI")
layout._check_block(CLASS_ROW, 0, layout.CLASS, "name reserve cap max_wait_ms")


def class_table(classes: Sequence[ClassSpec], default: int) -> tuple[list[bytes], int]:
    """The class rows as written (``CLASS_ROW``, highest class first) and the default
    class's row. More than ``CLASS_COUNT`` classes are cut (the config refuses them
    first); values are clamped to their fields."""
    rows = [
        CLASS_ROW.pack(
            layout.encode_text(name, layout.CLASS_NAME_BYTES),
            min(max(reserve, 0), layout.RUNNING_ROOM),
            min(max(cap, 0), layout.RUNNING_ROOM),
            min(max(wait_ms, 0), 0xFFFFFFFF),
        )
        for name, reserve, cap, wait_ms in list(classes)[: layout.CLASS_COUNT]
    ]
    return rows, min(max(default, 0), max(len(rows) - 1, 0))


def class_writes(p: int, classes: Sequence[ClassSpec], default: int) -> list[tuple[int, bytes]]:
    """Provider ``p``'s class table (DESIGN.md section 6b), highest class first: every
    row, then ``default_class``, then ``class_count`` (none: one FIFO). Each class's
    admission counter is kept (:func:`class_table`)."""
    base = provider_base(p)
    rows, default = class_table(classes, default)
    empty = CLASS_ROW.pack(b"", 0, 0, 0)
    writes = [
        (
            base + layout.CLASS_BASE + k * layout.CLASS_ROW_SIZE,
            rows[k] if k < len(rows) else empty,
        )
        for k in range(layout.CLASS_COUNT)
    ]
    field = PROVIDER["default_class"]
    writes.append((base + field.offset, field.codec.pack(default)))
    writes.append(
        (base + PROVIDER["class_count"].offset, PROVIDER["class_count"].codec.pack(len(rows)))
    )
    return writes


def _epoch_guard(epoch: int) -> list[tuple[int, bytes]]:
    return [(HEADER["writer_epoch"].offset, HEADER["writer_epoch"].codec.pack(epoch))]


def _commit(seg: Segment, epoch: int, patch: Patch, now: float, *, pump: bool = False) -> None:
    if not seg.core.transact(_epoch_guard(epoch), patch.writes, pump, now):
        raise Superseded(epoch, HEADER["writer_epoch"].get(seg.buf))


@dataclass(frozen=True, slots=True)
class Publication:
    """One provider's row as the sidecar wants it after a refresh.

    ``limit`` is None when nothing is to be enforced beyond the fallback
    (static providers, failed discovery): handlers then use ``fallback``.
    """

    provider_id: str
    discovery: bool
    fallback: int
    fallback_source: Source
    limit: int | None = None
    source: Source = Source.DISCOVERED
    reason: str = ""
    discovered: int | None = None
    observed_at: float | None = None
    expires_at: float | None = None  # wall clock, for people
    # the deadline on the host's deadline clock (platform.deadline_now), judged once by
    # the sidecar at probe time; what handlers obey (R-L7). None: derived at publication
    # from expires_at and the clocks' difference then.
    expires_mono: float | None = None
    # a replica is written with the fields it is read with
    replicas: Sequence[ReplicaView] = field(default=())
    # admission classes, highest first (DESIGN.md section 6b); none: one FIFO
    classes: tuple[ClassSpec, ...] = ()
    default_class: int = 0
    # the token budget (DESIGN.md section 6c), published with ``limit`` and lapsing with
    # it: what all running requests may hold together, and the most one may hold; 0 none
    token_limit: int = 0
    request_token_limit: int = 0


def take_epoch(
    seg: Segment, pid: int, start: float, now: float, refresh_s: float, config_path: str
) -> int:
    while True:
        current: int = HEADER["writer_epoch"].get(seg.buf)
        patch = Patch()
        patch.put(HEADER["sidecar_start"], start)
        patch.put(HEADER["sidecar_pid"], pid)
        patch.put(HEADER["sidecar_state"], layout.SIDECAR_RUNNING)
        patch.put(HEADER["heartbeat"], now)
        patch.put(HEADER["heartbeat_mono"], platform.deadline_now())
        patch.put(HEADER["refresh_s"], refresh_s)
        patch.put(HEADER["config_path"], layout.encode_text(config_path, 256))
        patch.put(HEADER["writer_epoch"], current + 1)  # compare-and-set on the epoch
        if seg.core.transact(_epoch_guard(current), patch.writes, False, 0.0):
            return current + 1


def heartbeat(
    seg: Segment,
    epoch: int,
    now: float,
    legacy_alive: int = 0,
    *,
    legacy_since: float = 0.0,
    legacy_max_s: float = 0.0,
    legacy_pid: int = 0,
) -> int:
    """Mark the sidecar alive and sweep: reap dead holders, check the counters against
    the records, grant what expiries allow (R-A5, R-A16, R-L7). While a sidecar runs it
    is the host's sweeper, so handlers' waiters find the sweep done.

    ``legacy_*`` describe a legacy drain in progress (R-G3), so that
    ``availability --check`` can tell one that outlasted ``--await-legacy-max``.
    Returns how many holder records were reclaimed.
    """
    patch = Patch()
    patch.put(HEADER["heartbeat"], now)
    patch.put(HEADER["heartbeat_mono"], platform.deadline_now())
    patch.put(HEADER["legacy_alive"], legacy_alive)
    patch.put(HEADER["legacy_since"], legacy_since if legacy_alive else 0.0)
    patch.put(HEADER["legacy_max_s"], legacy_max_s)
    patch.put(HEADER["legacy_pid"], legacy_pid if legacy_alive else 0)
    _commit(seg, epoch, patch, 0.0)
    reclaimed: int = seg.core.sweep(0.0)
    return reclaimed


def set_state(seg: Segment, epoch: int, state: int) -> None:
    """Record how the sidecar left (stopped / retired); only the holder of ``epoch`` may."""
    patch = Patch()
    patch.put(HEADER["sidecar_state"], state)
    seg.core.transact(_epoch_guard(epoch), patch.writes, False, 0.0)


@dataclass
class _Written:
    """What the cache last committed for one provider row."""

    publication: Publication
    writes: list[tuple[int, bytes]]  # every (offset, bytes) the row's patch wrote, in order
    clamped: bool


@dataclass
class PublishCache:
    """What one writer last committed to one segment (see the module docstring)."""

    rows: dict[str, int] = field(default_factory=dict)  # provider id -> row index
    written: dict[int, _Written] = field(default_factory=dict)
    unconfigured: set[int] = field(default_factory=set)  # rows marked "not in the config"
    header: tuple[int, str] | None = None  # (config_generation, config_status)


def publish(
    seg: Segment,
    epoch: int,
    config_generation: int,
    config_status: str,
    publications: Sequence[Publication],
    now: float,
    cache: PublishCache | None = None,
) -> list[str]:
    """Write every provider's row in one transaction, then grant waiters the new limits allow.

    Providers in the segment but absent from ``publications`` (removed from
    the config) are marked unconfigured and fall back to their stored
    fallback. With ``cache``, only what changed since the cache's last commit
    is written (nothing at all: no transaction). Returns warnings (clamped
    static limits) for the caller to log.
    """
    warnings: list[str] = []
    buf = seg.buf
    current = HEADER["writer_epoch"].get(buf)
    if current != epoch:  # checked again, under the lock, when committing
        raise Superseded(epoch, current)
    fresh = PublishCache() if cache is None else cache
    patch = Patch()
    if fresh.header != (config_generation, config_status):
        patch.put(HEADER["config_generation"], config_generation)
        patch.put(HEADER["config_status"], layout.encode_text(config_status, layout.REASON_BYTES))
    seen: set[int] = set()
    rows: dict[str, int] = {}
    staged: dict[int, _Written] = {}
    for pub in publications:
        p = fresh.rows.get(pub.provider_id)
        if p is None:
            try:
                p, _ = ensure_provider(
                    seg,
                    pub.provider_id,
                    pub.fallback,
                    pub.fallback_source,
                    discovery=pub.discovery,
                    classes=pub.classes,
                    default_class=pub.default_class,
                )
            except (TableFull, ProviderIdError) as exc:
                warnings.append(f"provider {pub.provider_id}: not published: {exc}")
                continue
        seen.add(p)
        rows[pub.provider_id] = p
        before = fresh.written.get(p)
        if before is not None and before.publication == pub:
            clamped = before.clamped
        else:
            row = Patch()
            clamped = _set_fallback(
                row, buf, p, pub.fallback, pub.fallback_source, discovery=pub.discovery
            )
            _write_publication(row, p, pub, epoch, now)
            patch.writes.extend(_changed(row.writes, before.writes if before else []))
            staged[p] = _Written(pub, row.writes, clamped)
        if clamped:
            warnings.append(
                f"provider {pub.provider_id}: configured limit {pub.fallback} is above the "
                f"segment's room of {layout.RUNNING_ROOM} running; clamped"
            )
    newly_unconfigured: list[int] = []
    for p in range(layout.PROVIDER_COUNT):
        base = provider_base(p)
        if not PROVIDER["in_use"].get(buf, base):
            break
        if p not in seen and p not in fresh.unconfigured:
            newly_unconfigured.append(p)
            patch.put(
                PROVIDER["flags"], PROVIDER["flags"].get(buf, base) & ~layout.PFLAG_CONFIGURED, base
            )
            patch.put(PROVIDER["published_limit"], -1, base)
            patch.put(PROVIDER["token_limit"], 0, base)
            patch.put(PROVIDER["request_token_limit"], 0, base)
            patch.put(PROVIDER["observed_at"], 0.0, base)
            patch.put(PROVIDER["expires_at"], 0.0, base)
            patch.put(PROVIDER["expires_mono"], 0.0, base)
            patch.put(PROVIDER["discovered"], -1, base)
            patch.put(PROVIDER["replica_count"], 0, base)
            patch.put(
                PROVIDER["reason"],
                layout.encode_text("not in the config any more", layout.REASON_BYTES),
                base,
            )
    if patch.writes:
        _commit(seg, epoch, patch, 0.0, pump=True)
    # committed: remember it (a Superseded or a lock error above leaves the cache as it was)
    fresh.header = (config_generation, config_status)
    fresh.rows.update(rows)
    for p in seen:
        fresh.unconfigured.discard(p)
    for p in newly_unconfigured:
        fresh.unconfigured.add(p)
        fresh.written.pop(p, None)
    fresh.written.update(staged)
    return warnings


def _changed(new: list[tuple[int, bytes]], old: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """The writes of ``new`` that ``old`` did not already make."""
    if len(new) == len(old):  # same fields in the same order: compare in step
        return [w for w, was in zip(new, old, strict=True) if w != was]
    before = dict(old)
    return [(o, b) for o, b in new if before.get(o) != b]


def ensure_provider(
    seg: Segment,
    provider_id: str,
    fallback: int,
    fallback_source: Source,
    *,
    discovery: bool,
    classes: Sequence[ClassSpec] = (),
    default_class: int = 0,
) -> tuple[int, bool]:
    """The row of ``provider_id``, claimed if new (R-A8), with its admission classes in
    it from the same locked step: no arrival ever finds the row without them (a row
    found is left as it is: its classes are a publication's). Returns (index, created).

    Raises :class:`TableFull` when all rows are taken, ``ProviderIdError``
    when the id cannot be stored whole (R-A13).
    """
    raw = encode_provider_id(provider_id)
    clamped = fallback > layout.RUNNING_ROOM
    flags = layout.PFLAG_CONFIGURED | (layout.PFLAG_DISCOVERY if discovery else 0)
    flags |= layout.PFLAG_CLAMPED if clamped else 0
    reason = "no sidecar has published yet" if discovery else "static limit"
    rows, default = class_table(classes, default_class)
    p, created = seg.core.ensure_provider(
        raw,
        min(max(fallback, 0), layout.RUNNING_ROOM),
        _source_code(fallback_source),
        flags,
        layout.QUEUE_BOUND,
        layout.encode_text(reason, layout.REASON_BYTES),
        b"".join(rows),
        default,
    )
    if p < 0:
        raise TableFull(
            f"the segment holds at most {layout.PROVIDER_COUNT} providers; {provider_id!r} does "
            "not fit"
        )
    return p, bool(created)


def _set_fallback(
    patch: Patch, buf: Buffer | object, p: int, fallback: int, source: Source, *, discovery: bool
) -> bool:
    """Store the configured fallback (R-L7). True when it had to be clamped."""
    base = provider_base(p)
    clamped = fallback > layout.RUNNING_ROOM
    patch.put(PROVIDER["fallback_limit"], min(max(fallback, 0), layout.RUNNING_ROOM), base)
    patch.put(PROVIDER["fallback_source"], _source_code(source), base)
    flags = PROVIDER["flags"].get(buf, base) & ~(layout.PFLAG_DISCOVERY | layout.PFLAG_CLAMPED)
    flags |= layout.PFLAG_CONFIGURED
    if discovery:
        flags |= layout.PFLAG_DISCOVERY
    if clamped:
        flags |= layout.PFLAG_CLAMPED
    patch.put(PROVIDER["flags"], flags, base)
    return clamped


def _deadline(pub: Publication, now: float) -> float:
    """The publication's deadline on the deadline clock (R-L7)."""
    if pub.expires_mono is not None:
        return pub.expires_mono
    if pub.expires_at is None:
        return 0.0
    return platform.deadline_now() + (pub.expires_at - now)


def _write_publication(patch: Patch, p: int, pub: Publication, epoch: int, now: float) -> None:
    base = provider_base(p)
    # Fields first, the limit last (the core applies writes in order).
    patch.put(PROVIDER["published_source"], _source_code(pub.source), base)
    patch.put(PROVIDER["published_at"], now, base)
    patch.put(PROVIDER["observed_at"], pub.observed_at or 0.0, base)
    patch.put(PROVIDER["expires_at"], pub.expires_at or 0.0, base)
    patch.put(PROVIDER["expires_mono"], _deadline(pub, now), base)
    patch.put(PROVIDER["published_epoch"], epoch, base)
    patch.put(PROVIDER["discovered"], -1 if pub.discovered is None else pub.discovered, base)
    patch.put(PROVIDER["reason"], layout.encode_text(pub.reason, layout.REASON_BYTES), base)
    replicas = list(pub.replicas)[: layout.REPLICA_COUNT]
    for r, rep in enumerate(replicas):
        rb = base + layout.REPLICA_BASE + r * layout.REPLICA_ROW_SIZE
        patch.put_block(
            REPLICA_ROW,
            rb + REPLICA["address"].offset,
            layout.encode_text(rep.address, 48),
            int(rep.ok),
            int(rep.complete),
            -1 if rep.value is None else rep.value,
            rep.observed_at or 0.0,
            layout.encode_text(rep.reason, 64),
        )
    patch.put(PROVIDER["replica_count"], len(replicas), base)
    patch.writes.extend(class_writes(p, pub.classes, pub.default_class))
    limit = -1 if pub.limit is None or pub.expires_at is None else max(pub.limit, 0)
    tokens = _token_value(pub.token_limit) if limit >= 0 else 0
    per_request = _token_value(pub.request_token_limit) if limit >= 0 else 0
    patch.put(PROVIDER["token_limit"], tokens, base)
    patch.put(PROVIDER["request_token_limit"], per_request, base)
    patch.put(PROVIDER["published_limit"], limit, base)


def _token_value(value: int) -> int:
    """A token limit as the row holds it: 0 (none) .. the u32's top."""
    return min(max(int(value), 0), 0xFFFFFFFF)


def _source_code(source: str) -> int:
    """The segment's code of a limit source; ValueError for a name that is none (a
    misspelt source is a bug to see, not a "discovered" limit to publish)."""
    code = SOURCE_CODES.get(source)
    if code is None:
        known = ", ".join(SOURCE_CODES)
        raise ValueError(f"unknown limit source {source!r}: one of {known}")
    return code
