"""Shares of one farm's discovered capacity among several gateways, as pure functions.

Invariant (while the capacity ``C`` stays put and the table is trusted): the
sum of the ``reserved`` shares of the live leases never exceeds ``C``, and a
gateway's running requests never exceed its ``reserved`` share. So the sum of
running across gateways never exceeds ``C``.

The table holds one lease per gateway: ``reserved`` (what it may have
running), ``demand`` (its running + waiting) and ``expires_ms`` (server time).
One :func:`step` is one gateway's call; the Lua script in ``sidecar.share``
does exactly this inside Redis (the tests run both on the same calls and
compare). Rules:

* **expiry**: a lease not renewed by ``expires_ms`` is gone, its share free;
* **a silent table is not trusted**: when nobody called for longer than half
  a lease (Redis was stopped, or restarted empty), the leases are dropped and
  for one lease the table *rebuilds*: a gateway is granted at most what it
  already ``held``, so every gateway re-registers what it runs before anyone
  grows;
* **targets**: every live gateway gets a floor (``min(floor, C // n)``), the
  rest goes by demand above the floor, max-min fair (:func:`targets`);
  capacity nobody asks for stays unreserved, so a burst is granted at once;
* **shrink before grow**: the caller's new limit is ``min(target, C - the
  others' reserved)``; its reservation is ``max(limit, held)``, where ``held``
  is what it reports as in force locally (``max(published limit, running)``,
  read after the last limit was published). A lower limit stops new
  admissions at once; the reservation follows only as running requests finish,
  and only then can another gateway be granted what was given up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

MIN_TABLE_TTL_MS: Final = 1000
# what a share published while Redis does not answer says first; `availability --check`
# fails on it
DEGRADED: Final = "share degraded: "


@dataclass(frozen=True, slots=True)
class Lease:
    reserved: int
    demand: int
    expires_ms: int


@dataclass(frozen=True, slots=True)
class Table:
    leases: Mapping[str, Lease]
    touched_ms: int
    rebuild_until_ms: int


@dataclass(frozen=True, slots=True)
class Report:
    """One gateway's call: what it sees and holds for this provider."""

    gateway: str
    capacity: int  # the discovered capacity in force at this gateway
    held: int  # max(limit published locally, running), read after that publication
    demand: int  # running + waiting
    floor: int
    lease_ms: int


@dataclass(frozen=True, slots=True)
class Grant:
    limit: int  # what the caller may admit up to now
    reserved: int  # what the table reserves for it
    gateways: int  # live gateways, the caller included
    rebuilding: bool
    others_reserved: int


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


def step(table: Table | None, report: Report, now_ms: int) -> tuple[Table, Grant]:
    """One gateway's call at server time ``now_ms``: the new table and its grant."""
    lease_ms = max(1, report.lease_ms)
    if table is None or now_ms - table.touched_ms > silent_after_ms(lease_ms):
        leases: dict[str, Lease] = {}
        rebuild_until = now_ms + lease_ms
    else:
        leases = {
            g: lease
            for g, lease in table.leases.items()
            if lease.expires_ms > now_ms and g != report.gateway
        }
        rebuild_until = table.rebuild_until_ms
    rebuilding = now_ms < rebuild_until
    held = max(0, report.held)
    demands = {g: lease.demand for g, lease in leases.items()}
    demands[report.gateway] = max(0, report.demand)
    target = targets(report.capacity, report.floor, demands)[report.gateway]
    others = sum(lease.reserved for lease in leases.values())
    limit = max(0, min(target, report.capacity - others))
    if rebuilding:
        limit = min(limit, held)
    reserved = max(limit, held)
    leases[report.gateway] = Lease(reserved, max(0, report.demand), now_ms + lease_ms)
    grant = Grant(limit, reserved, len(leases), rebuilding, others)
    return Table(leases, now_ms, rebuild_until), grant


def silent_after_ms(lease_ms: int) -> int:
    """How long without any call makes a table untrusted: half a lease. Live gateways
    renew every quarter of a lease, so a longer silence means Redis did not answer them;
    and a gateway falls to its safe local limit only after a whole lease without an
    answer, so whoever finds its lease expired after an outage finds the table silent."""
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
    capacity: int
    asked_mono: float  # when the call that granted it was sent
    lease_s: float


@dataclass(frozen=True, slots=True)
class Local:
    limit: int
    state: str  # "granted", "kept", "safe", "none"
    reason: str


def local_limit(held: Held | None, capacity: int, now_mono: float, redis_error: str) -> Local:
    """The share this gateway enforces at ``now_mono``.

    A grant holds until its lease would end (counted from when the call was sent,
    so it ends here before Redis frees it). When the last call failed
    (``redis_error``), the grant is *kept* until then; after it, the gateway
    falls to a safe local limit: its last share, and never more than the capacity
    divided by the gateways it last saw. Never the whole capacity unless it was
    the only gateway; without any grant, 0.
    """
    capacity = max(0, capacity)
    if held is None:
        why = f"no share granted yet ({redis_error})" if redis_error else "no share granted yet"
        return Local(0, "none", (DEGRADED if redis_error else "") + why)
    limit = min(held.limit, capacity)
    in_lease = now_mono < held.asked_mono + held.lease_s
    if in_lease and not redis_error:
        return Local(limit, "granted", f"share {limit} of {capacity}, {held.gateways} gateway(s)")
    if in_lease:
        return Local(
            limit, "kept", f"{DEGRADED}share {limit} kept until its lease ends: {redis_error}"
        )
    safe = min(limit, capacity // max(1, held.gateways))
    return Local(
        safe,
        "safe",
        f"{DEGRADED}safe local limit {safe} (last share {held.limit}, capacity {capacity} / "
        f"{held.gateways} gateway(s)): {redis_error or 'lease lapsed'}",
    )
