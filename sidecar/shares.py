"""Shares of one farm's discovered capacity among several gateways, as pure functions.

The guarantee: the sum over gateways of what each gateway's handlers may run never
exceeds the capacity ``C``, whatever stops (a sidecar, Redis, the network, a clock).
It rests on one rule: **a gateway's handlers only ever run on a lease that the
table still counts**. Three facts make it hold:

* the handlers' bound when the sidecar publishes nothing fresh is the segment's
  stored fallback, which lives for ever; so in share mode it is 0 (no reservation
  lives for ever: a dead gateway cannot renew one, a Redis restart forgets one);
* a grant is in force at the gateway until ``sent + lease`` on the gateway's own
  deadline clock (the handlers check it themselves), and the table keeps the lease
  until ``executed + lease + lease // 2`` on Redis's clock (:func:`held_for_ms`).
  The call is executed after it was sent, so the gateway's deadline comes first,
  by half a lease: that covers the rate of two clocks, and a request admitted just
  before the deadline that runs on for up to half a lease;
* the table is the only place a share is granted, atomically, on Redis's ``TIME``.

Invariant of the table (while ``C`` stays put and the table is trusted): the sum of
the ``reserved`` shares of the live leases never exceeds ``C``, and a gateway's
running requests never exceed its ``reserved`` share.

One :func:`step` is one gateway's call; the Lua script in ``sidecar.share`` does
exactly this inside Redis (the tests run both on the same calls and compare). Rules:

* **identity**: a lease is held by a gateway *name* and an instance *token* (one per
  host and segment). A call under a name whose lease is live under another token is
  refused (``duplicate``) and changes nothing: one config copied to two hosts
  cannot take one share twice. A call older than the last one applied for the same
  instance (``seq``) is ignored (``stale``): a call Redis executes late, after a
  stall, never lowers what a newer one reserved;
* **expiry**: a lease not renewed by ``expires_ms`` is gone, its share free;
* **a silent table is not trusted**: when nobody called for longer than half a
  lease (Redis was stopped, restarted empty, or its clock stepped; the shortest
  lease in the table, when gateways run on different ones), or when another server
  wrote it (a replica a failover promoted, which may lack the last grants: replication
  is asynchronous), the leases are dropped
  and until the longest lease could have ended the table *rebuilds*: a
  gateway is granted at most what it already ``held``, so every gateway
  re-registers what it runs before anyone grows;
* **targets**: every live gateway gets a floor (``min(floor, C // n)``), the
  rest goes by demand above the floor, max-min fair (:func:`targets`);
  capacity nobody asks for stays unreserved, so a burst is granted at once;
* **unknown capacity**: a gateway that has no fresh answer from the farm (its probe
  fails, or its wall clock disagrees with the farm's) reports capacity ``-1``; it is
  granted at most the floor, of the capacity the last gateway that knew reported,
  and its demand counts as at most the floor, so the others may have the rest;
* **lowest capacity**: a call grants from the lowest capacity any live gateway
  reported (each lease records it), so one reading a stale, higher figure from a
  router replica is held to the others';
* **shrink before grow**: the caller's new limit is ``min(target, C - the
  others' reserved)``; its reservation is ``max(limit, held)``, where ``held``
  is what it reports as in force locally (``max(published limit, running)``,
  read after the last limit was published). A lower limit stops new
  admissions at once; the reservation follows only as running requests finish,
  and only then can another gateway be granted what was given up.

**Tokens, by the same rules.** Where the farm states a running-token pool ``P``
(R-K7, R-L10), a call also reports it (``tokens``: ``P``, ``UNKNOWN`` without a fresh
answer, 0 where the farm states none), the token budget it holds
(``max(token limit in force, tokens running)``), its demand in tokens (the charges
running and waiting, at least one whole request while anything runs or waits) and the
most one request may hold ``Q``. The table keeps a token part beside each lease and
grants it with the same steps: a floor of ``floor`` whole requests (``floor x Q``), the
rest by demand max-min fair, the lowest pool a live gateway reported, shrink before
grow, at most what is held while rebuilding, at most the token floor of the last known
pool without a fresh answer. Invariant: the sum of the ``tokens_reserved`` of the live
leases never exceeds ``P``, and a gateway's handlers never run more tokens than its
token share (the core refuses a charge above it and admits one only when it fits), so
the tokens running over every gateway stay within the pool. A token share smaller
than one whole request would refuse requests the farm can hold: :func:`local_limit`
then holds the slots at 0 until a larger share is granted. A pool of 0 (none stated)
is not shared: the call's running tokens are reserved, nothing is limited.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

MIN_TABLE_TTL_MS: Final = 1000
# what a share published while this gateway holds no fresh grant says first;
# `availability --check` fails on it
DEGRADED: Final = "share degraded: "
UNKNOWN: Final = -1  # a reported capacity: this gateway has no fresh answer from the farm
# why a call changed nothing
DUPLICATE: Final = "duplicate"
STALE: Final = "stale"
NO_POOL: Final = 0  # a reported token pool: the farm states none (slots alone)


@dataclass(frozen=True, slots=True)
class Lease:
    reserved: int
    demand: int
    expires_ms: int
    token: str = ""  # the instance that holds it ("": written by an older version)
    seq: int = 0  # the instance's sequence number of the call that wrote it
    lease_ms: int = 0  # the lease its gateway runs on (0: written by an older version)
    capacity: int = UNKNOWN  # the capacity its gateway reported (UNKNOWN: none, or older)
    # the token part (0 0 0: none, or written by an older version)
    tokens_reserved: int = 0
    tokens_demand: int = 0
    tokens: int = NO_POOL  # the token pool its gateway reported (UNKNOWN, NO_POOL or P)


@dataclass(frozen=True, slots=True)
class Table:
    leases: Mapping[str, Lease]
    touched_ms: int
    rebuild_until_ms: int
    capacity: int | None = None  # the capacity the last gateway that knew it reported
    # the Redis server that wrote it (its run_id): a table another server wrote (a
    # replica promoted by a failover, which may lack the last writes) is not trusted
    server: str = ""
    tokens: int | None = None  # the token pool the last gateway that knew one reported


@dataclass(frozen=True, slots=True)
class Report:
    """One gateway's call: what it sees and holds for this provider."""

    gateway: str
    capacity: int  # the discovered capacity in force at this gateway, or UNKNOWN
    held: int  # max(limit published locally, running), read after that publication
    demand: int  # running + waiting
    floor: int
    lease_ms: int
    token: str = ""
    seq: int = 0
    tokens: int = NO_POOL  # the farm's token pool here: P, UNKNOWN or NO_POOL
    tokens_held: int = 0  # max(token limit in force, tokens running)
    tokens_demand: int = 0  # charges running and waiting (at least Q while any)
    request_tokens: int = 0  # Q, the most one request may hold (0 unknown)


@dataclass(frozen=True, slots=True)
class Grant:
    limit: int  # what the caller may admit up to now
    reserved: int  # what the table reserves for it
    gateways: int  # live gateways, the caller included
    rebuilding: bool
    others_reserved: int
    refused: str = ""  # DUPLICATE or STALE: the call changed nothing
    rebuild_left_ms: int = 0  # while ``rebuilding``: how much longer, server time
    tokens_limit: int = 0  # the tokens the caller's handlers may hold (pool NO_POOL: 0, none)
    tokens_reserved: int = 0
    tokens: int = NO_POOL  # the pool it was granted of (the lowest live report)


def held_for_ms(lease_ms: int) -> int:
    """How long the table keeps a lease after the call that wrote it: a lease and a
    half. The gateway stops at ``sent + lease``; the half lease between is what lets the
    others wait out everything its handlers could still run."""
    return lease_ms + lease_ms // 2


def targets(capacity: int, floor: int, demands: Mapping[str, int]) -> dict[str, int]:
    """Each live gateway's target share: a floor each, the rest max-min fair by demand.

    Deterministic (gateways in id order); never more than ``capacity`` in all;
    capacity beyond every demand stays unassigned.
    """
    if not demands:
        return {}
    ids = sorted(demands)
    capacity = max(0, capacity)
    base = min(max(0, floor), capacity // len(ids))
    given = dict.fromkeys(ids, base)
    want = {g: max(0, demands[g] - base) for g in ids}
    left = capacity - base * len(ids)
    while left > 0:
        active = [g for g in ids if want[g] > 0]
        if not active:
            break
        quantum = max(1, left // len(active))
        for g in active:
            part = min(quantum, want[g], left)
            given[g] += part
            want[g] -= part
            left -= part
            if left == 0:
                break
    return given


def step(table: Table | None, report: Report, now_ms: int, server: str = "") -> tuple[Table, Grant]:
    """One gateway's call at server time ``now_ms`` on the Redis ``server`` (its run_id):
    the new table and its grant."""
    lease_ms = max(1, report.lease_ms)
    # gateways may run on different leases (one config edited, not the others): a
    # silence is judged on the shortest one in the table, a rebuild waits out the longest
    others_leases = table.leases.values() if table is not None else ()
    lengths = [lease_ms] + [x.lease_ms for x in others_leases if x.lease_ms]
    if (
        table is None
        or table.server != server
        or now_ms - table.touched_ms > silent_after_ms(min(lengths))
    ):
        leases: dict[str, Lease] = {}
        rebuild_until = now_ms + held_for_ms(max(lengths))
        known = known_tokens = None
    else:
        mine = table.leases.get(report.gateway)
        if mine is not None and mine.expires_ms > now_ms:
            if mine.token and mine.token != report.token:
                return table, Grant(0, 0, 0, False, 0, DUPLICATE)
            if mine.token == report.token and mine.seq > report.seq:
                return table, Grant(0, 0, 0, False, 0, STALE)
        leases = {
            g: lease
            for g, lease in table.leases.items()
            if lease.expires_ms > now_ms and g != report.gateway
        }
        rebuild_until = table.rebuild_until_ms
        known, known_tokens = table.capacity, table.tokens
    rebuilding = now_ms < rebuild_until
    slots = _part(
        report.gateway,
        report.capacity,
        known,
        {g: (x.reserved, x.demand, x.capacity) for g, x in leases.items()},
        report.held,
        report.demand,
        report.floor,
        rebuilding=rebuilding,
    )
    if report.tokens == NO_POOL:  # nothing to share: what runs is counted, nothing limited
        tokens = _Part(0, max(0, report.tokens_held), 0, known_tokens, NO_POOL)
    else:
        tokens = _part(
            report.gateway,
            report.tokens,
            known_tokens,
            {
                g: (x.tokens_reserved, x.tokens_demand, x.tokens or UNKNOWN)
                for g, x in leases.items()
            },
            report.tokens_held,
            report.tokens_demand,
            max(0, report.floor) * max(0, report.request_tokens),
            rebuilding=rebuilding,
        )
    others = sum(lease.reserved for lease in leases.values())
    leases[report.gateway] = Lease(
        slots.reserved,
        slots.demand,
        now_ms + held_for_ms(lease_ms),
        report.token,
        report.seq if report.token else 0,
        lease_ms if report.token else 0,
        report.capacity if report.token else UNKNOWN,
        tokens.reserved if report.token else 0,
        tokens.demand if report.token else 0,
        report.tokens if report.token else NO_POOL,
    )
    left = rebuild_until - now_ms if rebuilding else 0
    grant = Grant(
        slots.limit,
        slots.reserved,
        len(leases),
        rebuilding,
        others,
        rebuild_left_ms=left,
        tokens_limit=tokens.limit,
        tokens_reserved=tokens.reserved,
        tokens=tokens.capacity,
    )
    return Table(leases, now_ms, rebuild_until, slots.known, server, tokens.known), grant


@dataclass(frozen=True, slots=True)
class _Part:
    limit: int
    reserved: int
    demand: int  # what the lease records: the demand, at most what it may be granted
    known: int | None  # the capacity the table remembers
    capacity: int  # the capacity granted of


def _part(
    me: str,
    reported: int,
    known: int | None,
    others: Mapping[str, tuple[int, int, int]],
    held: int,
    demand: int,
    floor: int,
    *,
    rebuilding: bool,
) -> _Part:
    """One dimension of gateway ``me``'s call (slots, or tokens): the others' leases as
    ``(reserved, demand, reported capacity)``; the rules of the module docstring."""
    held = max(0, held)
    if reported < 0:
        capacity = known if known is not None else 0
        ceiling = max(0, floor)
    else:
        # a gateway reading a stale (higher) capacity is held to the lowest a live one
        # reported: the sum of grants never exceeds any capacity in force here
        capacity = min([reported] + [c for _, _, c in others.values() if c >= 0])
        known = reported
        ceiling = capacity
    demand = min(max(0, demand), ceiling)  # what it may be granted, not more
    demands = {g: d for g, (_, d, _) in others.items()}
    demands[me] = demand
    target = targets(capacity, floor, demands)[me]
    taken = sum(r for r, _, _ in others.values())
    limit = max(0, min(target, capacity - taken, ceiling))
    if rebuilding:
        limit = min(limit, held)
    return _Part(limit, max(limit, held), demand, known, capacity)


def silent_after_ms(lease_ms: int) -> int:
    """How long without any call makes a table untrusted: half a lease. Live gateways
    renew every quarter of a lease, so a longer silence means Redis did not answer them
    (or its clock jumped ahead, which would end leases early)."""
    return lease_ms // 2


def table_ttl_ms(lease_ms: int) -> int:
    """How long Redis keeps a provider's table untouched: past the point where it is
    no longer trusted anyway, so a farm nobody shares any more leaves nothing behind."""
    return max(MIN_TABLE_TTL_MS, 3 * lease_ms)


# --- the gateway's side -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Held:
    """The last grant this gateway had, on its own deadline clock."""

    limit: int
    gateways: int
    asked_mono: float  # when the call that granted it was sent
    lease_s: float
    rebuild_left_s: float = 0.0  # the table was being rebuilt for this long after the call
    tokens: int = NO_POOL  # the token pool the call reported (NO_POOL: tokens not shared)
    tokens_limit: int = 0  # the token share granted
    tokens_of: int = NO_POOL  # the pool it was granted of

    @property
    def deadline(self) -> float:
        return self.asked_mono + self.lease_s


@dataclass(frozen=True, slots=True)
class Local:
    limit: int
    state: str  # "granted", "kept", "lapsed", "none", "refused"
    reason: str
    deadline: float | None  # when the limit stops (deadline clock); None: it is 0 anyway
    tokens_limit: int = 0  # the token budget the handlers apply (0: none, slots alone)


def _with_tokens(limit: int, why: str, held: Held, pool: int, request_tokens: int) -> Local:
    """The token part of a grant in force: its share of the pool (never above the pool
    seen here now); a share below one whole request (``request_tokens``, or 1) holds the
    slots at 0, since the core would refuse at once a request the farm can hold."""
    if held.tokens == NO_POOL:
        return Local(limit, "", why, None)
    tokens = held.tokens_limit if pool <= 0 else min(held.tokens_limit, pool)
    of = f"{held.tokens_of}" if held.tokens_of > 0 else "an unknown pool"
    why += f"; tokens {tokens} of {of}"
    whole = max(1, request_tokens)
    if tokens < whole:
        # 0 slots, and no token budget: the arrivals wait for a larger share (a budget
        # below their charge would refuse them at once)
        why += f", below one whole request ({whole}): no admission until more is granted"
        return Local(0, "", why, None, 0)
    return Local(limit, "", why, None, tokens)


def local_limit(
    held: Held | None,
    capacity: int,
    now_mono: float,
    redis_error: str,
    *,
    refused: str = "",
    tokens: int = NO_POOL,
    request_tokens: int = 0,
) -> Local:
    """The share this gateway enforces at ``now_mono``.

    A grant holds until its lease would end (counted from when the call was sent,
    so it ends here half a lease before Redis frees it). When the last call failed
    (``redis_error``), the grant is *kept* until then. After it, and without any
    grant, the limit is 0: what the handlers also fall back to on their own when the
    sidecar stops publishing (the segment's fallback in share mode), because no
    reservation outlives a lease. ``capacity`` may be ``UNKNOWN`` (the grant is
    then at most the floor already). ``refused``: this instance may hold no share
    (its gateway name is in use by another), 0 for good. ``tokens``: the farm's token
    pool seen here now (``NO_POOL``, ``UNKNOWN``), ``request_tokens`` the most one
    request may hold: a grant's token share comes with its slots (``_with_tokens``).
    """
    if refused:
        return Local(0, "refused", DEGRADED + refused, None)
    if held is None:
        why = f"no share granted yet ({redis_error})" if redis_error else "no share granted yet"
        return Local(0, "none", (DEGRADED if redis_error else "") + why, None)
    limit = held.limit if capacity < 0 else min(held.limit, capacity)
    of = "an unknown capacity" if capacity < 0 else f"{capacity}"
    if now_mono < held.deadline and not redis_error:
        why = f"share {limit} of {of}, {held.gateways} gateway(s)"
        left = held.asked_mono + held.rebuild_left_s - now_mono
        part = _with_tokens(limit, why, held, tokens, request_tokens)
        why = part.reason
        if left > 0:
            why += (
                f"; the table is being rebuilt (new, emptied or failed over) for {left:.0f} s "
                "more: until then each gateway keeps only what it runs"
            )
        return Local(part.limit, "granted", why, held.deadline, part.tokens_limit)
    if now_mono < held.deadline:
        part = _with_tokens(limit, f"share {limit}", held, tokens, request_tokens)
        return Local(
            part.limit,
            "kept",
            f"{DEGRADED}{part.reason} kept until its lease ends: {redis_error}",
            held.deadline,
            part.tokens_limit,
        )
    return Local(
        0,
        "lapsed",
        f"{DEGRADED}lease lapsed, holding 0 until Redis grants again (the others may take "
        f"this gateway's share now): {redis_error or 'no answer within the lease'}",
        None,
    )
