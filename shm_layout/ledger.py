"""The holder-record protocol: the only code that changes running/waiting (R-A1..R-A6).

Invariants, per provider, whenever the segment lock is free:

* ``running`` = number of RUNNING records, ``waiting`` = number of WAITING
  records (the counters are derived; :func:`recount` rebuilds them).
* ``waiting <= queue_bound`` (32): an arrival that would exceed it is refused.
* a new arrival is admitted at once only when nobody waits and
  ``running < limit``; otherwise it queues with the next ticket (FIFO).
* whenever ``running < limit`` and someone waits, the WAITING record with the
  smallest ticket is made RUNNING (:func:`pump`); its process's doorbell is
  rung *after* the lock is released.
* a record's owner is (pid, start time); records of dead owners are freed by
  whoever sweeps first (:func:`reap`).

Record transitions (all under the lock):

    FREE -> RUNNING   arrive(), admitted at once
    FREE -> WAITING   arrive(), queued
    WAITING -> RUNNING  pump(): granted to the head of the queue
    WAITING -> FREE   leave(): timeout or cancel before a grant
    RUNNING -> FREE   leave(): release, or a cancel that lost the race with a grant
                      (the slot is handed on by the pump that follows)
    any -> FREE       reap(): the owner is dead

Functions here assume the caller holds the lock unless they say otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from shm_layout import layout
from shm_layout.layout import (
    HOLDER_FREE,
    HOLDER_ROW_SIZE,
    HOLDER_RUNNING,
    HOLDER_WAITING,
    HOLDERS_BASE,
    HOLDERS_PER_PROVIDER,
    MEMBER_ROW_SIZE,
    MEMBERS_BASE,
    PROVIDER_COUNT,
    PROVIDER_ROW_SIZE,
    PROVIDERS_BASE,
    RUNNING_ROOM,
    K,
    M,
    P,
)
from shm_layout.liveness import LivenessCache, is_alive

Buf = Any  # an mmap or a bytes copy of one

# hot-path codecs, bound once
_state, _pid, _start, _ticket, _serial, _member, _since = (
    K[n] for n in ("state", "pid", "start", "ticket", "serial", "member", "since")
)
_running, _waiting = P["running"], P["waiting"]


def provider_base(p: int) -> int:
    return PROVIDERS_BASE + p * PROVIDER_ROW_SIZE


def holder_base(p: int, h: int) -> int:
    return HOLDERS_BASE + (p * HOLDERS_PER_PROVIDER + h) * HOLDER_ROW_SIZE


def member_base(m: int) -> int:
    return MEMBERS_BASE + m * MEMBER_ROW_SIZE


# --- the effective limit (R-L7, R-A9): readable without the lock ------------------------
@dataclass(frozen=True, slots=True)
class Limit:
    value: int
    source: str
    reason: str


def effective_limit(buf: Buf, p: int, now: float) -> Limit:
    """The limit admission applies now: the published one until it expires, else the fallback."""
    base = provider_base(p)
    published = P["published_limit"].get(buf, base)
    reason = layout.decode_text(P["reason"].get(buf, base))
    if published >= 0:
        expires = P["expires_at"].get(buf, base)
        if now < expires:
            source = layout.SOURCES.get(P["published_source"].get(buf, base), "discovered")
            return Limit(min(published, RUNNING_ROOM), source, reason)
        reason = f"published limit expired {now - expires:.0f}s ago; using the fallback"
    fallback = P["fallback_limit"].get(buf, base)
    source = layout.SOURCES.get(P["fallback_source"].get(buf, base), "default")
    return Limit(min(max(fallback, 0), RUNNING_ROOM), source, reason)


_block, _block_off = layout.ADMISSION_BLOCK, layout.ADMISSION_BLOCK_OFFSET
_counts, _counts_off = layout.COUNTS, layout.COUNTS_OFFSET
_body, _body_off = layout.HOLDER_BODY, layout.HOLDER_BODY_OFFSET


def _limit_from(fallback: int, published: int, expires: float, now: float) -> int:
    if published >= 0 and now < expires:
        return min(published, RUNNING_ROOM)
    return min(max(fallback, 0), RUNNING_ROOM)


def limit_value(buf: Buf, p: int, now: float) -> int:
    """The number :func:`effective_limit` gives, without building its explanation (hot path)."""
    fallback, _, published, _, _, _, expires, *_ = _block.unpack_from(
        buf, provider_base(p) + _block_off
    )
    return _limit_from(fallback, published, expires, now)


# --- arrival ------------------------------------------------------------------------------
Decision = Literal["admit", "wait", "full"]


def decide_arrival(running: int, waiting: int, limit: int, bound: int) -> Decision:
    """FIFO admission: nobody overtakes a waiter (R-A3), the queue is bounded (R-A2)."""
    if waiting == 0 and running < limit:
        return "admit"
    if waiting >= bound:
        return "full"
    return "wait"


@dataclass(frozen=True, slots=True)
class Ticket:
    """A handle on one holder record; ``serial`` makes a stale handle harmless."""

    provider: int
    holder: int
    serial: int


def arrive(
    buf: Buf, p: int, pid: int, start: float, member: int, now: float, *, may_wait: bool = True
) -> tuple[Decision, Ticket | None]:
    base = provider_base(p)
    fallback, _, published, _, _, _, expires, _, _, bound, running, waiting = _block.unpack_from(
        buf, base + _block_off
    )
    decision = decide_arrival(
        running, waiting, _limit_from(fallback, published, expires, now), bound
    )
    if decision == "full" or (decision == "wait" and not may_wait):
        return decision, None
    h = _free_record(buf, p)
    if h is None:  # cannot happen while the counters are right; be safe, not sorry
        return "full", None
    hb = holder_base(p, h)
    serial = _serial.get(buf, hb) + 1
    if decision == "admit":
        _body.pack_into(buf, hb + _body_off, pid, start, 0, serial, member, now)
        _state.put(buf, HOLDER_RUNNING, hb)  # state last
        _counts.pack_into(buf, base + _counts_off, running + 1, waiting)
        _note_running(buf, base, running + 1)
        P["admitted_total"].put(buf, P["admitted_total"].get(buf, base) + 1, base)
    else:
        ticket = P["next_ticket"].get(buf, base) + 1
        P["next_ticket"].put(buf, ticket, base)
        _body.pack_into(buf, hb + _body_off, pid, start, ticket, serial, member, now)
        _state.put(buf, HOLDER_WAITING, hb)
        _counts.pack_into(buf, base + _counts_off, running, waiting + 1)
        if waiting + 1 > P["peak_waiting"].get(buf, base):
            P["peak_waiting"].put(buf, waiting + 1, base)
    return decision, Ticket(p, h, serial)


def count_rejection(buf: Buf, p: int) -> None:
    base = provider_base(p)
    P["rejected_total"].put(buf, P["rejected_total"].get(buf, base) + 1, base)


def queue_bound(buf: Buf, p: int) -> int:
    bound: int = P["queue_bound"].get(buf, provider_base(p))
    return bound


def grantable(buf: Buf, p: int, now: float) -> bool:
    """Lock-free: someone waits although there is room (a limit rose unannounced)."""
    base = provider_base(p)
    return bool(_waiting.get(buf, base) > 0 and _running.get(buf, base) < limit_value(buf, p, now))


def _count_running(buf: Buf, base: int, running: int) -> None:
    _running.put(buf, running, base)
    _note_running(buf, base, running)


def _note_running(buf: Buf, base: int, running: int) -> None:
    if running > P["peak_running"].get(buf, base):
        P["peak_running"].put(buf, running, base)


def _free_record(buf: Buf, p: int) -> int | None:
    for h in range(HOLDERS_PER_PROVIDER):
        if _state.get(buf, holder_base(p, h)) == HOLDER_FREE:
            return h
    return None


def holder_state(buf: Buf, t: Ticket) -> int | None:
    """The record's state if it is still ours (serial matches), else None. Lock-free."""
    hb = holder_base(t.provider, t.holder)
    if _serial.get(buf, hb) != t.serial:
        return None
    state: int = _state.get(buf, hb)
    return state


# --- leaving ------------------------------------------------------------------------------
Outcome = Literal["released", "timeout", "cancelled"]


def leave(buf: Buf, t: Ticket, pid: int, outcome: Outcome, now: float) -> tuple[str, set[int]]:
    """Free ``t``'s record. Returns (what it was, doorbells to ring after unlocking).

    What it was: "running", "waiting", or "stale" (already reclaimed, released
    twice, or not this process's: nothing is changed).
    """
    p = t.provider
    base = provider_base(p)
    hb = holder_base(p, t.holder)
    state = _state.get(buf, hb)
    owner, _, _, serial, _, _ = _body.unpack_from(buf, hb + _body_off)
    if serial != t.serial or owner != pid or state == HOLDER_FREE:
        return "stale", set()
    _state.put(buf, HOLDER_FREE, hb)
    running, waiting = _counts.unpack_from(buf, base + _counts_off)
    if state == HOLDER_RUNNING:
        running, was = max(running - 1, 0), "running"
    else:
        waiting, was = max(waiting - 1, 0), "waiting"
    _counts.pack_into(buf, base + _counts_off, running, waiting)
    if outcome == "timeout":
        P["timeouts_total"].put(buf, P["timeouts_total"].get(buf, base) + 1, base)
    elif outcome == "cancelled":
        P["cancelled_total"].put(buf, P["cancelled_total"].get(buf, base) + 1, base)
    return was, pump(buf, p, now)


# --- granting -----------------------------------------------------------------------------
def pump(buf: Buf, p: int, now: float) -> set[int]:
    """Grant head waiters while there is room. Returns the doorbells to ring.

    A head waiter whose process is dead is reclaimed instead of granted, so a
    slot is never handed to a corpse (R-A5).
    """
    base = provider_base(p)
    running, waiting = _counts.unpack_from(buf, base + _counts_off)
    if waiting == 0:
        return set()
    limit = limit_value(buf, p, now)
    rings: set[int] = set()
    while waiting > 0 and running < limit:
        head = _head_waiter(buf, p)
        if head is None:  # counters drifted: the records are the truth
            recount_provider(buf, p)
            return rings | pump(buf, p, now)
        hb = holder_base(p, head)
        waiting -= 1
        if not is_alive(_pid.get(buf, hb), _start.get(buf, hb)):
            _state.put(buf, HOLDER_FREE, hb)
            P["reclaimed_total"].put(buf, P["reclaimed_total"].get(buf, base) + 1, base)
            continue
        _since.put(buf, now, hb)
        _state.put(buf, HOLDER_RUNNING, hb)
        running += 1
        rings.add(_member.get(buf, hb))
        P["admitted_total"].put(buf, P["admitted_total"].get(buf, base) + 1, base)
    _waiting.put(buf, waiting, base)
    _count_running(buf, base, running)
    return rings


def _head_waiter(buf: Buf, p: int) -> int | None:
    best: int | None = None
    best_ticket = 0
    for h in range(HOLDERS_PER_PROVIDER):
        hb = holder_base(p, h)
        if _state.get(buf, hb) == HOLDER_WAITING:
            ticket = _ticket.get(buf, hb)
            if best is None or ticket < best_ticket:
                best, best_ticket = h, ticket
    return best


def pump_all(buf: Buf, now: float) -> set[int]:
    rings: set[int] = set()
    for p in range(PROVIDER_COUNT):
        if P["in_use"].get(buf, provider_base(p)):
            rings |= pump(buf, p, now)
    return rings


# --- crash reclaim (R-A5) and repair (R-A6) -----------------------------------------------
def reap(buf: Buf, now: float, cache: LivenessCache | None = None) -> tuple[int, set[int]]:
    """Free every record and member row of a dead process; then grant. (reclaimed, rings)."""
    cache = cache or LivenessCache()
    reclaimed = 0
    rings: set[int] = set()
    for p in range(PROVIDER_COUNT):
        base = provider_base(p)
        if not P["in_use"].get(buf, base):
            continue
        if _running.get(buf, base) == 0 and _waiting.get(buf, base) == 0:
            continue
        freed = 0
        for h in range(HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            if _state.get(buf, hb) != HOLDER_FREE and not cache.alive(
                _pid.get(buf, hb), _start.get(buf, hb)
            ):
                _state.put(buf, HOLDER_FREE, hb)
                freed += 1
        if freed:
            reclaimed += freed
            P["reclaimed_total"].put(buf, P["reclaimed_total"].get(buf, base) + freed, base)
            recount_provider(buf, p)
        rings |= pump(buf, p, now)
    for m in range(layout.MEMBER_COUNT):
        mb = member_base(m)
        if M["in_use"].get(buf, mb) and not cache.alive(
            M["pid"].get(buf, mb), M["start"].get(buf, mb)
        ):
            M["in_use"].put(buf, 0, mb)
    return reclaimed, rings


def dead_holders(buf: Buf, providers: list[int], cache: LivenessCache) -> bool:
    """Lock-free: does any of ``providers`` have a record of a dead process?"""
    for p in providers:
        for h in range(HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            if _state.get(buf, hb) != HOLDER_FREE and not cache.alive(
                _pid.get(buf, hb), _start.get(buf, hb)
            ):
                return True
    return False


def release_all_of(buf: Buf, pid: int, member: int, now: float) -> set[int]:
    """Free every record of one attachment (``pid`` and its ``member`` row) that detaches.

    By member too: a process may hold two attachments (two libraries, a re-attach on
    reload), and closing one must not free the other's slots. Returns doorbells to ring.
    """
    rings: set[int] = set()
    for p in range(PROVIDER_COUNT):
        base = provider_base(p)
        if not P["in_use"].get(buf, base):
            continue
        freed = False
        for h in range(HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            if (
                _state.get(buf, hb) != HOLDER_FREE
                and _pid.get(buf, hb) == pid
                and _member.get(buf, hb) == member
            ):
                _state.put(buf, HOLDER_FREE, hb)
                freed = True
        if freed:
            recount_provider(buf, p)
            rings |= pump(buf, p, now)
    return rings


def recount_provider(buf: Buf, p: int) -> None:
    running = waiting = 0
    for h in range(HOLDERS_PER_PROVIDER):
        hb = holder_base(p, h)
        state = _state.get(buf, hb)
        if state == HOLDER_RUNNING:
            running += 1
        elif state == HOLDER_WAITING:
            waiting += 1
        elif state != HOLDER_FREE:  # torn write by a dead holder
            _state.put(buf, HOLDER_FREE, hb)
    base = provider_base(p)
    _running.put(buf, running, base)
    _waiting.put(buf, waiting, base)


def recount(buf: Buf) -> None:
    for p in range(PROVIDER_COUNT):
        if P["in_use"].get(buf, provider_base(p)):
            recount_provider(buf, p)


# --- providers and members ----------------------------------------------------------------
def find_provider(buf: Buf, provider_id: str) -> int | None:
    raw = layout.encode_text(provider_id, layout.ID_BYTES)
    for p in range(PROVIDER_COUNT):
        base = provider_base(p)
        if not P["in_use"].get(buf, base):
            return None  # rows are claimed in order and never freed
        if P["id"].get(buf, base).rstrip(b"\x00") == raw:
            return p
    return None


class TableFull(Exception):
    pass


def ensure_provider(
    buf: Buf, provider_id: str, fallback: int, fallback_source: str, discovery: bool
) -> tuple[int, bool]:
    """The row of ``provider_id``, claimed if new (R-A8). Returns (index, created)."""
    p = find_provider(buf, provider_id)
    if p is not None:
        return p, False
    for p in range(PROVIDER_COUNT):
        base = provider_base(p)
        if P["in_use"].get(buf, base):
            continue
        P["id"].put(buf, layout.encode_text(provider_id, layout.ID_BYTES), base)
        P["queue_bound"].put(buf, layout.QUEUE_BOUND, base)
        P["published_limit"].put(buf, -1, base)
        P["discovered"].put(buf, -1, base)
        set_fallback(buf, p, fallback, fallback_source, discovery)
        P["reason"].put(
            buf,
            layout.encode_text(
                "no sidecar has published yet" if discovery else "static limit", layout.REASON_BYTES
            ),
            base,
        )
        P["in_use"].put(buf, 1, base)  # last
        return p, True
    raise TableFull(
        f"the segment holds at most {PROVIDER_COUNT} providers; {provider_id!r} does not fit"
    )


def set_fallback(buf: Buf, p: int, fallback: int, source: str, discovery: bool) -> bool:
    """Store the configured fallback (R-L7). True when it had to be clamped."""
    base = provider_base(p)
    clamped = fallback > RUNNING_ROOM
    P["fallback_limit"].put(buf, min(max(fallback, 0), RUNNING_ROOM), base)
    P["fallback_source"].put(buf, layout.SOURCE_CODES[source], base)
    flags = P["flags"].get(buf, base) & ~(layout.PFLAG_DISCOVERY | layout.PFLAG_CLAMPED)
    flags |= layout.PFLAG_CONFIGURED
    if discovery:
        flags |= layout.PFLAG_DISCOVERY
    if clamped:
        flags |= layout.PFLAG_CLAMPED
    P["flags"].put(buf, flags, base)
    return clamped


def register_member(buf: Buf, pid: int, start: float, label: str) -> int:
    """Claim a member row (R-G1); reuses rows of dead processes."""
    cache = LivenessCache()
    for m in range(layout.MEMBER_COUNT):
        mb = member_base(m)
        if M["in_use"].get(buf, mb) and cache.alive(M["pid"].get(buf, mb), M["start"].get(buf, mb)):
            continue
        M["pid"].put(buf, pid, mb)
        M["start"].put(buf, start, mb)
        M["major"].put(buf, layout.MAJOR, mb)
        M["minor"].put(buf, layout.MINOR, mb)
        M["attached_at"].put(buf, time.time(), mb)
        M["label"].put(buf, layout.encode_text(label, layout.ID_BYTES), mb)
        M["in_use"].put(buf, 1, mb)
        return m
    raise TableFull(f"the segment holds at most {layout.MEMBER_COUNT} attached handler processes")


def unregister_member(buf: Buf, m: int, pid: int) -> None:
    mb = member_base(m)
    if M["pid"].get(buf, mb) == pid:
        M["in_use"].put(buf, 0, mb)
