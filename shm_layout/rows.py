"""Typed reads of the segment's rows, without the lock: what production reads.

Where a row is (``provider_base``, ``holder_base``, ``member_base``), the limit in force
(R-L7, R-A9: ``limit_value``, and ``effective_limit`` with its source and reason), a
provider's load (``provider_load``), its row by id (R-A13: ``find_provider``) and the
queue ahead of a record (R-A3: ``waiting_ahead``), and a provider's admission classes
(R-A17..R-A23: ``class_base``, ``classes_in_force``, ``class_rules``, ``resolve_class``,
``stored_class``). The admission steps themselves run in
the compiled core (``_core.c``) and are modelled in ``ledger.py``, which reads the rows
through this module too.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

from shm_layout import layout
from shm_layout.errors import ProviderIdError
from shm_layout.layout import (
    HOLDER,
    HOLDER_ROW_SIZE,
    HOLDER_WAITING,
    HOLDERS_BASE,
    HOLDERS_PER_PROVIDER,
    MEMBER_ROW_SIZE,
    MEMBERS_BASE,
    PROVIDER,
    PROVIDER_COUNT,
    PROVIDER_ROW_SIZE,
    PROVIDERS_BASE,
    RUNNING_ROOM,
    Source,
)

Buffer = bytes | bytearray | memoryview | mmap.mmap  # what readers and the model work on


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
    source: Source
    reason: str


DEADLINE_SLACK_S = 60.0  # a published deadline further ahead than this is damage (_core.c)


def published_in_force(buf: Buffer, p: int, now: float) -> bool:
    """Is the published limit in force at ``now`` (the deadline clock)? Its deadline
    lies ahead, and no further ahead than a publication can set it (R-L7, R-A16)."""
    base = provider_base(p)
    if PROVIDER["published_limit"].get(buf, base) < 0:
        return False
    expires = PROVIDER["expires_mono"].get(buf, base)
    return bool(now < expires and expires - now <= DEADLINE_SLACK_S)


def in_room(limit: int) -> int:
    """A stored limit as the core applies it: clamped to 0..RUNNING_ROOM (a value out of
    that range was written over, R-A16)."""
    return int(min(max(limit, 0), RUNNING_ROOM))


def limit_value(buf: Buffer, p: int, now: float) -> int:
    """The limit admission applies at ``now`` (the deadline clock): the published one
    until its deadline, else the fallback, :func:`in_room`. :func:`effective_limit` adds
    where it came from."""
    base = provider_base(p)
    field = "published_limit" if published_in_force(buf, p, now) else "fallback_limit"
    return in_room(PROVIDER[field].get(buf, base))


def effective_limit(buf: Buffer, p: int, now: float) -> Limit:
    """:func:`limit_value`, with its source and the reason to show."""
    base = provider_base(p)
    value = limit_value(buf, p, now)
    published = PROVIDER["published_limit"].get(buf, base)
    reason = layout.decode_text(PROVIDER["reason"].get(buf, base))
    if published_in_force(buf, p, now):
        source = layout.SOURCES.get(PROVIDER["published_source"].get(buf, base), Source.DISCOVERED)
        return Limit(value, source, reason)
    if published >= 0:
        expired = now - PROVIDER["expires_mono"].get(buf, base)
        if expired >= 0:
            reason = f"published limit expired {expired:.0f}s ago; using the fallback"
        else:
            reason = "published limit has an impossible deadline (damage); using the fallback"
    source = layout.SOURCES.get(PROVIDER["fallback_source"].get(buf, base), Source.DEFAULT)
    return Limit(value, source, reason)


# --- providers: ids are matched in full (R-A13) ------------------------------------------
def encode_provider_id(provider_id: str) -> bytes:
    raw = provider_id.encode("utf-8")
    if not raw or len(raw) > layout.ID_BYTES or b"\x00" in raw:
        raise ProviderIdError(
            f"provider id {provider_id!r} is {len(raw)} bytes of UTF-8; ids must be 1 to "
            f"{layout.ID_BYTES} bytes without NUL to fit the segment: shorten it"
        )
    return raw


def find_provider(buf: Buffer, provider_id: str) -> int | None:
    """The row of ``provider_id``, or None. Lock-free: rows are claimed in order, never moved."""
    try:
        wanted = encode_provider_id(provider_id).ljust(layout.ID_BYTES, b"\x00")
    except ProviderIdError:
        return None
    for p in range(PROVIDER_COUNT):
        base = provider_base(p)
        if not PROVIDER["in_use"].get(buf, base):
            return None
        if PROVIDER["id"].get(buf, base) == wanted:
            return p
    return None


def provider_ids(buf: Buffer) -> list[str]:
    """The ids of the segment's provider rows, in row order (lock-free, as ``find_provider``)."""
    ids = []
    for p in range(PROVIDER_COUNT):
        base = provider_base(p)
        if not PROVIDER["in_use"].get(buf, base):
            break
        ids.append(layout.decode_text(PROVIDER["id"].get(buf, base)))
    return ids


def waiting_ahead(buf: Buffer, p: int, h: int) -> int:
    """How many waiting records of provider ``p`` hold an earlier ticket than record ``h``
    (FIFO order, R-A3): the requests a waiter at ``h`` would be granted after."""
    mine = HOLDER["ticket"].get(buf, holder_base(p, h))
    ahead = 0
    for other in range(HOLDERS_PER_PROVIDER):
        base = holder_base(p, other)
        if other != h and HOLDER["state"].get(buf, base) == HOLDER_WAITING:
            ahead += HOLDER["ticket"].get(buf, base) < mine
    return ahead


@dataclass(frozen=True, slots=True)
class Load:
    """A provider row's load at a moment, read without the lock: what runs, what waits,
    the limit in force (:func:`limit_value`) and the mean slot hold time (seconds)."""

    running: int
    waiting: int
    limit: int
    hold_mean_s: float


def provider_load(buf: Buffer, p: int, now: float) -> Load:
    base = provider_base(p)
    return Load(
        running=int(PROVIDER["running"].get(buf, base)),
        waiting=int(PROVIDER["waiting"].get(buf, base)),
        limit=limit_value(buf, p, now),
        hold_mean_s=float(PROVIDER["hold_mean_s"].get(buf, base)),
    )


# --- admission classes (DESIGN.md section 6b) ---------------------------------------
def class_base(p: int, k: int) -> int:
    return provider_base(p) + layout.CLASS_BASE + k * layout.CLASS_ROW_SIZE


@dataclass(frozen=True, slots=True)
class ClassRule:
    """One class row as the steps read it."""

    reserve: int
    cap: int  # 0: none
    max_wait_s: float  # 0: never promoted


def classes_in_force(buf: Buffer, p: int) -> int:
    """How many classes the steps apply to provider ``p``: 0 (one FIFO) without classes,
    or while a handler of an older minor is registered; never more than the rows."""
    count: int = PROVIDER["class_count"].get(buf, provider_base(p))
    if count == 0 or layout.HEADER["older_members"].get(buf, 0):
        return 0
    return min(count, layout.CLASS_COUNT)


def class_rules(buf: Buffer, p: int, count: int) -> list[ClassRule]:
    out = []
    for k in range(count):
        cb = class_base(p, k)
        out.append(
            ClassRule(
                layout.CLASS["reserve"].get(buf, cb),
                layout.CLASS["cap"].get(buf, cb),
                layout.CLASS["max_wait_ms"].get(buf, cb) / 1000.0,
            )
        )
    return out


def resolve_class(buf: Buffer, p: int, cls: int) -> int:
    """The class an arrival (or a record) counts in: ``cls`` when it is a class of the
    provider, else the default class (the last one when that is out of range too); 0
    without classes."""
    count = min(PROVIDER["class_count"].get(buf, provider_base(p)), layout.CLASS_COUNT)
    if count == 0:
        return 0
    if 0 <= cls < count:
        return cls
    default: int = PROVIDER["default_class"].get(buf, provider_base(p))
    return default if default < count else count - 1


def stored_class(buf: Buffer, p: int, cls: int) -> int:
    """What a record's ``cls`` byte holds: 1 + the class asked for when the provider has
    it, else 0, the default class, resolved when read (a record made before the classes
    were written counts in the default class, never the top one)."""
    count: int = PROVIDER["class_count"].get(buf, provider_base(p))
    return cls + 1 if 0 <= cls < min(count, layout.CLASS_COUNT) else 0


# --- the token budget (DESIGN.md section 6c) -------------------------------------------
@dataclass(frozen=True, slots=True)
class TokenBudget:
    """A provider's token budget at a moment: ``limit`` what all running requests may hold
    together (0: none, slots alone), ``request_limit`` the most one request may hold (0:
    unknown), both 0 once the published limit is not in force; ``suspended``: a handler
    of an older minor is registered, so the steps admit on slots alone (``limit`` still
    says what was published, and a request above it is still refused)."""

    limit: int
    request_limit: int
    suspended: bool


def token_budget(buf: Buffer, p: int, now: float) -> TokenBudget:
    """The token limits published for provider ``p``, in force while its published limit
    is (R-L7: they lapse with it), else 0."""
    if not published_in_force(buf, p, now):
        return TokenBudget(0, 0, False)
    base = provider_base(p)
    return TokenBudget(
        int(PROVIDER["token_limit"].get(buf, base)),
        int(PROVIDER["request_token_limit"].get(buf, base)),
        bool(layout.HEADER["tokenless_members"].get(buf, 0)),
    )


def tokens_fit(tokens_running: int, charge: int, limit: int) -> bool:
    """May a request charged ``charge`` run beside ``tokens_running`` under ``limit``? No
    budget (0), a request charged nothing, or nobody running: yes (a request never waits
    for more than the whole budget: alone, it runs); else when the sum fits."""
    return limit == 0 or charge == 0 or tokens_running == 0 or tokens_running + charge <= limit


def too_large(charge: int, budget: TokenBudget) -> bool:
    """Is a request charged ``charge`` one no worker could hold: above the most one
    request may hold, or above the whole budget? Refused at once, never queued."""
    return charge > 0 and (
        (budget.request_limit > 0 and charge > budget.request_limit)
        or (budget.limit > 0 and charge > budget.limit)
    )


def token_limit_in_force(buf: Buffer, p: int, now: float) -> int:
    """The token limit the steps apply to provider ``p`` at ``now``: the published one while
    it is in force and no handler of an older minor is registered, else 0 (slots alone)."""
    budget = token_budget(buf, p, now)
    return 0 if budget.suspended else budget.limit
