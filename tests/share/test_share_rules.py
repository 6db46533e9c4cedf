"""The share rules (sidecar.shares) by table and hypothesis, and the Lua script in a real
redis-server doing exactly what the pure function does."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.share import STEP_LUA, table_key
from sidecar.shares import (
    DUPLICATE,
    STALE,
    UNKNOWN,
    Held,
    Lease,
    Report,
    Table,
    held_for_ms,
    local_limit,
    step,
    table_ttl_ms,
    targets,
)

LEASE = 10_000


_calls = itertools.count(1)


def report(
    gw: str, cap: int, held: int, demand: int, floor: int = 1, seq: int | None = None
) -> Report:
    """One call of gateway ``gw``'s one instance (its calls numbered in order)."""
    return Report(gw, cap, held, demand, floor, LEASE, f"tok{gw}", seq or next(_calls))


@pytest.mark.parametrize(
    ("capacity", "floor", "demands", "expected"),
    [
        (20, 1, {"a": 0, "b": 0, "c": 0}, {"a": 1, "b": 1, "c": 1}),
        (20, 1, {"a": 30, "b": 0, "c": 0}, {"a": 18, "b": 1, "c": 1}),
        (20, 1, {"a": 30, "b": 30}, {"a": 10, "b": 10}),
        (20, 1, {"a": 3, "b": 30}, {"a": 3, "b": 17}),
        (20, 2, {"a": 5, "b": 5}, {"a": 5, "b": 5}),
        (2, 1, {"a": 5, "b": 5, "c": 5}, {"a": 1, "b": 1, "c": 0}),
        (0, 1, {"a": 5}, {"a": 0}),
        (7, 0, {"a": 0, "b": 9}, {"a": 0, "b": 7}),
    ],
)
def test_targets_floor_each_then_waiting_demand_max_min_fair(
    capacity: int, floor: int, demands: dict[str, int], expected: dict[str, int]
) -> None:
    assert targets(capacity, floor, demands) == expected


@given(
    st.integers(0, 100),
    st.integers(0, 8),
    st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 200), min_size=1),
)
def test_targets_never_exceed_capacity_nor_a_demand_above_the_floor(
    capacity: int, floor: int, demands: dict[str, int]
) -> None:
    t = targets(capacity, floor, demands)
    assert sum(t.values()) <= capacity
    base = min(floor, capacity // len(demands))
    for g, d in demands.items():
        assert base <= t[g] <= max(base, d)
    if sum(t.values()) < capacity:  # capacity left over: every demand is met
        assert all(t[g] >= d for g, d in demands.items())


def test_shrink_before_grow_a_share_moves_only_as_running_finishes() -> None:
    table, g = step(None, report("a", 10, 0, 0), 0)
    table, g = step(table, report("b", 10, 0, 0), 1)
    assert g.rebuilding  # a new table grants nothing beyond what is held
    table = warm(table, ["a", "b"], 10)
    now = held_for_ms(LEASE) + 10
    table, a = step(table, report("a", 10, 0, 20), now)
    assert a.limit == 9 and not a.rebuilding  # b keeps its floor
    table, _ = step(table, report("a", 10, 9, 9), now + 1)  # a runs 9
    table, b = step(table, report("b", 10, 0, 20), now + 2)  # b's demand rises
    assert b.limit == 1  # nothing given up yet: only b's own floor
    table, a = step(table, report("a", 10, 9, 9), now + 3)
    assert a.limit == 5 and a.reserved == 9  # a's limit drops; its running stays reserved
    table, b = step(table, report("b", 10, 1, 20), now + 4)
    assert b.limit == 1
    table, a = step(table, report("a", 10, 6, 6), now + 5)  # 3 of a's finished
    assert a.reserved == 6
    table, b = step(table, report("b", 10, 1, 20), now + 6)
    assert b.limit == 4  # exactly what a gave up
    assert sum(lease.reserved for lease in table.leases.values()) <= 10


def test_an_expired_lease_returns_its_share() -> None:
    table = Table({"a": Lease(8, 8, 5_000)}, touched_ms=4_000, rebuild_until_ms=0)
    _, b = step(table, report("b", 10, 0, 10), 4_500)
    assert b.limit == 2
    _, b = step(table, report("b", 10, 0, 10), 5_001)
    assert b.limit == 10 and b.gateways == 1


def test_a_table_silent_for_a_lease_is_rebuilt_from_what_gateways_hold() -> None:
    table = Table({"a": Lease(8, 8, 30_000)}, touched_ms=0, rebuild_until_ms=0)
    table, b = step(table, report("b", 10, 2, 10), LEASE + 1)  # a is still running 8
    assert b.rebuilding and b.limit == 2 and b.gateways == 1
    table, a = step(table, report("a", 10, 8, 8), LEASE + 2)
    assert (a.limit, a.reserved) == (5, 8)  # its target is 5 now: it shrinks as 3 finish
    assert sum(x.reserved for x in table.leases.values()) == 10


def test_capacity_dropping_under_the_running_total_grants_nothing_new() -> None:
    table = Table({"a": Lease(6, 6, 50_000), "b": Lease(4, 4, 50_000)}, 0, 0)
    table, a = step(table, report("a", 5, 6, 6), 1)
    assert a.limit == 1 and a.reserved == 6  # target 3 (b's demand), room 5 - 4 = 1
    table, b = step(table, report("b", 5, 4, 4), 2)
    assert b.limit == 0 and b.reserved == 4


def test_the_gateway_keeps_its_share_for_a_lease_then_holds_0() -> None:
    held = Held(limit=9, gateways=3, asked_mono=100.0, lease_s=10.0)
    granted = local_limit(held, 20, 105.0, "")
    assert (granted.state, granted.deadline) == ("granted", 110.0)
    kept = local_limit(held, 20, 109.9, "Redis unavailable")
    assert (kept.limit, kept.state, kept.deadline) == (9, "kept", 110.0)
    lapsed = local_limit(held, 20, 110.0, "Redis unavailable")
    assert (lapsed.limit, lapsed.state, lapsed.deadline) == (0, "lapsed", None)
    assert lapsed.reason.startswith("share degraded: ")
    assert local_limit(None, 20, 0.0, "Redis unavailable").limit == 0
    assert local_limit(held, 20, 105.0, "", refused="refused: name").limit == 0


def warm(table: Table, gws: list[str], cap: int) -> Table:
    """Renewals every quarter of a lease, as the sidecars call, past the first table's
    rebuild."""
    for t in range(LEASE // 4, held_for_ms(LEASE) + 1, LEASE // 4):
        for gw in gws:
            table, _ = step(table, report(gw, cap, 0, 0), t)
    return table


def test_a_departed_gateways_share_is_granted_only_half_a_lease_after_its_deadline() -> None:
    """a's handlers may admit until a's call + lease (its deadline) and a request admitted
    just before may run on for half a lease: b is granted a's share only after both."""
    table, _ = step(None, report("a", 10, 0, 0), 0)
    table = warm(table, ["a", "b"], 10)
    now = held_for_ms(LEASE) + 10
    table, a = step(table, report("a", 10, 0, 20), now)
    assert a.limit == 9  # a stops calling: its sidecar died; its deadline is now + LEASE
    deadline = now + LEASE
    t = now
    while t < deadline + LEASE // 2 - 1:  # b renews, asking for everything
        t = min(t + LEASE // 4, deadline + LEASE // 2 - 1)
        table, b = step(table, report("b", 10, 1, 20), t)
        assert b.limit == 1  # a's 9 are still reserved
    _, b = step(table, report("b", 10, 1, 20), t + 2)
    assert b.limit == 10


def test_a_second_instance_under_a_live_gateways_name_is_refused() -> None:
    table, _ = step(None, report("a", 10, 0, 0), 0)
    twin = Report("a", 10, 0, 20, 1, LEASE, "another-host", 1)
    after, g = step(table, twin, 100)
    assert g.refused == DUPLICATE and g.limit == 0 and after == table
    later = held_for_ms(LEASE) + 1  # the first instance's lease ended: the name is free
    _, g = step(table, twin, later)
    assert not g.refused


def test_a_call_redis_runs_after_a_newer_one_of_the_same_instance_changes_nothing() -> None:
    table, _ = step(None, report("a", 10, 5, 5, seq=10**9), 0)
    after, g = step(table, report("a", 10, 0, 0, seq=10**9 - 1), 10)
    assert g.refused == STALE and after == table


def test_a_gateway_without_a_fresh_capacity_is_granted_at_most_the_floor() -> None:
    table, _ = step(None, report("a", 10, 0, 0), 0)
    table = warm(table, ["a"], 10)
    now = held_for_ms(LEASE) + 10
    table, b = step(table, report("b", UNKNOWN, 0, 20, floor=2), now)
    assert b.limit == 2  # of the capacity a reported
    table, a = step(table, report("a", 10, 0, 20, floor=2), now + 1)
    assert a.limit == 8  # b's demand counts as no more than it may be granted
    _, b = step(None, report("b", UNKNOWN, 0, 20), 0)
    assert b.limit == 0  # nobody knows it


# --- the Lua script against the model -------------------------------------------------

call = st.tuples(
    st.sampled_from(["a", "b", "c"]),
    st.integers(-1, 30),  # capacity (-1: unknown here)
    st.integers(0, 30),  # held
    st.integers(0, 40),  # demand
    st.integers(0, 3),  # floor
    st.sampled_from(["", "t1", "t2"]),  # instance token
    st.integers(0, 5),  # its sequence number
    st.sampled_from([LEASE, LEASE // 4]),  # its lease (one gateway's config edited)
    st.sampled_from([-1, 0, 0, 600, 1536, 2048]),  # token pool (-1 unknown, 0 none stated)
    st.integers(0, 2500),  # tokens held
    st.integers(0, 3000),  # tokens demanded
    st.sampled_from([0, 256, 512]),  # the most one request may hold
)


def _table_in_redis(client: Any, key: str) -> Table | None:
    raw = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
    if not raw:
        return None
    leases = {}
    for k, v in raw.items():
        if k.startswith("g:"):
            r, d, e, *ident = v.split()
            token, seq, lease, cap_, *tok = ident if ident else ("", "0", "0", "-1")
            tr, td, pool = tok or ("0", "0", "0")
            leases[k[2:]] = Lease(
                int(r),
                int(d),
                int(e),
                token,
                int(seq),
                int(lease),
                int(cap_),
                int(tr),
                int(td),
                int(pool),
            )
    cap = int(raw["~cap"]) if "~cap" in raw else None
    tcap = int(raw["~tcap"]) if "~tcap" in raw else None
    return Table(leases, int(raw["~touched"]), int(raw["~rebuild"]), cap, raw["~server"], tcap)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(call, min_size=1, max_size=25))
def test_the_lua_script_is_the_pure_step(redis_server: Any, calls: list[Any]) -> None:
    """Each call runs in Redis (server TIME) and in the model at the time Redis used: the
    grants and the tables agree (expiry and rebuilding have their own tests below)."""
    client = redis_server.client()
    script = client.register_script(STEP_LUA)
    key = table_key("lua-vs-model")
    client.delete(key)
    model: Table | None = None
    for n, call_ in enumerate(calls):
        gw, cap, held, demand, floor, token, seq, lease, pool, theld, tdemand, per = call_
        rep = Report(gw, cap, held, demand, floor, lease, token, seq, pool, theld, tdemand, per)
        args = [gw, cap, held, demand, floor, lease, table_ttl_ms(lease), token, seq]
        args += [pool, theld, tdemand, per]
        out = script(keys=[key], args=args)
        limit, reserved, gateways, rebuilding, others, now, refused = (int(x) for x in out[:7])
        model, grant = step(model, rep, now, out[7].decode())
        left = int(out[8]) if len(out) > 8 else 0
        tokens = tuple(int(x) for x in out[9:12]) if len(out) > 11 else (0, 0, 0)
        assert (limit, reserved, gateways, bool(rebuilding), others, refused, left, tokens) == (
            grant.limit,
            grant.reserved,
            grant.gateways,
            grant.rebuilding,
            grant.others_reserved,
            {"": 0, DUPLICATE: 1, STALE: 2}[grant.refused],
            grant.rebuild_left_ms,
            (grant.tokens_limit, grant.tokens_reserved, grant.tokens),
        ), n
        assert _table_in_redis(client, key) == model


def test_the_lua_script_drops_a_stale_lease_written_by_hand(redis_server: Any) -> None:
    client = redis_server.client()
    script = client.register_script(STEP_LUA)
    key = table_key("stale")
    client.delete(key)
    script(keys=[key], args=["a", 10, 0, 0, 1, LEASE, table_ttl_ms(LEASE), "t", 1])
    touched = int(client.hget(key, "~touched"))
    client.hset(key, mapping={"~rebuild": 0, "g:ghost": f"9 9 {touched - 1}", "g:junk": "x"})
    limit, *_ = script(keys=[key], args=["a", 10, 0, 10, 1, LEASE, table_ttl_ms(LEASE), "t", 2])
    assert limit == 10
    assert set(client.hkeys(key)) == {b"~touched", b"~rebuild", b"~cap", b"~server", b"g:a"}


# --- the invariant over whole histories ------------------------------------------------

event = st.tuples(
    st.sampled_from(["a", "b", "c"]),
    st.sampled_from(["call", "call", "admit", "finish", "wait", "unwait", "down", "up"]),
    st.integers(0, 3_000),  # ms since the previous event
)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 20), st.integers(0, 3), st.lists(event, max_size=80))
def test_the_sum_of_running_never_exceeds_the_capacity(
    capacity: int, floor: int, events: list[tuple[str, str, int]]
) -> None:
    """Gateways that obey their limits and report honestly, each renewing at least
    every quarter of a lease as the sidecar does, the others' calls in any order, Redis
    down for all of them at times: every gateway's running stays within its
    reservation, and the sum of running within the capacity. A gateway without an
    answer for a lease holds 0 (``local_limit``)."""
    table: Table | None = None
    now = 0
    up = True
    held_by: dict[str, Held | None] = dict.fromkeys("abc")
    last_call = dict.fromkeys("abc", -(10**9))
    running = dict.fromkeys("abc", 0)
    waiting = dict.fromkeys("abc", 0)

    def in_force(gw: str) -> int:
        error = "" if up else "down"
        return local_limit(held_by[gw], capacity, now / 1000, error).limit

    def call(gw: str) -> None:
        nonlocal table
        last_call[gw] = now
        if not up:
            return
        held = max(in_force(gw), running[gw])
        rep = Report(gw, capacity, held, running[gw] + waiting[gw], floor, LEASE)
        table, grant = step(table, rep, now)
        if not grant.refused:
            held_by[gw] = Held(grant.limit, grant.gateways, now / 1000, LEASE / 1000)
        assert grant.reserved >= running[gw]

    for gw, what, gap in events:
        target = now + gap
        while True:  # the renewals due meanwhile, in time order
            due, other = min((last_call[o] + LEASE // 4, o) for o in "abc")
            if due > target:
                break
            now = max(now, due)
            call(other)
        now = target
        if what == "call":
            call(gw)
        elif what == "admit" and running[gw] < in_force(gw):
            running[gw] += 1
        elif what == "finish" and running[gw] > 0:
            running[gw] -= 1
        elif what == "wait":
            waiting[gw] += 1
        elif what == "unwait" and waiting[gw] > 0:
            waiting[gw] -= 1
        elif what == "down":
            up = False
        elif what == "up":
            up = True
        assert sum(running.values()) <= capacity, (running, table)


def test_after_an_outage_longer_than_half_a_lease_nobody_grows_into_a_share_in_force() -> None:
    """Redis down for everyone: a (last answer at 1 s) runs its 5 until 11 s, and a
    request admitted at 10.9 s may run on; when Redis answers at 12 s, b must not be
    granted a's 5 until the longest lease could have ended."""
    table = Table({"a": Lease(5, 5, 16_000), "b": Lease(5, 10, 14_000)}, 4_000, 0)
    _, b = step(table, report("b", 10, 5, 10), 12_000)
    assert b.rebuilding and b.limit == 5


def test_a_replica_promoted_without_the_last_grant_rebuilds_instead_of_granting_it_again() -> None:
    """Replication is asynchronous: a's grant of 8 reached a, not the replica Sentinel
    then promoted. On the new master (another run_id) b must not be granted what the
    copy shows as free: the table is rebuilt, each gateway held to what it holds."""
    old = ""  # the run_id warm()'s calls were executed by
    table = warm(step(None, report("a", 10, 0, 0), 0, old)[0], ["a", "b"], 10)
    now = table.touched_ms + 1
    replica_copy = table
    _, a = step(table, report("a", 10, 1, 8), now, old)
    assert a.limit == 8  # in force at a; the write never reached the replica
    _, b = step(replica_copy, report("b", 10, 1, 10), now + 1, "new")
    assert b.rebuilding and b.limit <= 1
    assert a.limit + b.limit <= 10
    # the same copy read by its own writer is trusted: the fence is the writer's identity
    _, same = step(replica_copy, report("b", 10, 1, 10), now + 1, old)
    assert not same.rebuilding and same.limit == 9


def test_a_shorter_lease_on_one_gateway_never_frees_a_longer_ones_share_early() -> None:
    """a runs with a lease of 10 s, b with 2 s (one config edited, not the other). a is
    cut off right after a grant: its handlers may admit until 10 s after that call. b's
    sidecar pauses a little over half of b's lease; neither b's silence rule nor b's
    rebuild may hand b a's share before a's deadline and half of a's lease."""
    short = 2_000

    def b_report(held: int) -> Report:
        return Report("b", 4, held, 4, 1, short, "tokb", next(_calls))

    table, _ = step(None, report("a", 4, 0, 4), 0)
    table = warm(table, ["a"], 4)
    now = held_for_ms(LEASE) + 10
    table, a = step(table, report("a", 4, 4, 4), now)  # a's last call: 4 until now + LEASE
    assert a.limit == 4
    t = now + short // 2 + 100  # b's first call after its pause
    while t < now + LEASE:
        table, b = step(table, b_report(0), t)
        assert b.limit + a.limit <= 4, (t, b)
        t += short // 4


def test_a_redis_clock_jump_never_ends_a_shorter_lease_before_its_gateway_stops() -> None:
    """b runs on a lease of 2 s, a on 10 s. Redis's clock steps 1.5 s ahead just after
    b's last call (b is cut off): the table must not drop b's lease before b's own
    deadline, even when a, whose half lease is longer than the step, calls first."""
    short, jump = 2_000, 1_500

    def b_report(held: int) -> Report:
        return Report("b", 4, held, 4, 1, short, "tokb", next(_calls))

    table, _ = step(None, report("a", 4, 0, 4), 0)
    t = 0
    while t < held_for_ms(LEASE) + 10:  # both registered, past the rebuild
        t += short // 4
        table, _ = step(table, report("a", 4, 2, 4), t)
        table, b = step(table, b_report(2), t)
    assert b.limit == 2
    deadline = t + short  # b is cut off now: its handlers run 2 until then
    while t < deadline:
        t += short // 4
        table, a = step(table, report("a", 4, 2, 4), t + jump)
        assert a.limit + 2 <= 4, (t, a)


def test_a_gateway_reading_a_stale_higher_capacity_is_held_to_the_lowest_live_report() -> None:
    """a reads the farm's 4; b reads 8 from a router replica that has not caught up. b's
    grant counts against the smallest capacity a live gateway reported: never 4 + more."""
    table, _ = step(None, report("a", 4, 0, 0), 0)
    table = warm(table, ["a", "b"], 4)
    now = held_for_ms(LEASE) + 10
    table, a = step(table, report("a", 4, 0, 4), now)
    table, b = step(table, report("b", 8, 0, 8), now + 1)
    assert a.limit + b.limit <= 4, (a, b)


def test_a_new_table_rebuilds_for_a_lease_and_a_half_and_the_reason_says_until_when() -> None:
    _, grant = step(None, report("a", 5, 0, 2), 1_000)
    assert grant.rebuilding and grant.rebuild_left_ms == held_for_ms(LEASE)
    held = Held(grant.limit, grant.gateways, 50.0, LEASE / 1000, grant.rebuild_left_ms / 1000)
    during = local_limit(held, 5, 51.0, "")
    assert during.limit == 0 and "being rebuilt" in during.reason
    assert f"for {held_for_ms(LEASE) / 1000 - 1:.0f} s more" in during.reason
    over = Held(grant.limit, grant.gateways, 50.0, LEASE / 1000, 2.0)  # a later call's grant
    after = local_limit(over, 5, 53.0, "")
    assert after.state == "granted" and "rebuilt" not in after.reason


# --- tokens: the same rules on the pool ----------------------------------------------


def treport(gw: str, held: int, demand: int, *, pool: int = 1536, q: int = 512) -> Report:
    """A call of ``gw`` on a farm of 8 slots (none held, demand 8) and a token pool."""
    return Report(gw, 8, 0, 8, 1, LEASE, f"tok{gw}", next(_calls), pool, held, demand, q)


def test_tokens_shrink_before_grow_and_the_pool_is_never_overgranted() -> None:
    table, _ = step(None, treport("a", 0, 0), 0)
    table, _ = step(table, treport("b", 0, 0), 1)
    table = Table(table.leases, table.touched_ms, 0, table.capacity, table.server, table.tokens)
    table, a = step(table, treport("a", 0, 3000), 10)
    assert a.tokens_limit == 1536 - 512 and a.tokens == 1536  # b keeps one whole request
    table, a = step(table, treport("a", 1024, 1024), 11)  # a runs 1024
    table, b = step(table, treport("b", 0, 1536), 12)
    assert b.tokens_limit == 512  # nothing given up yet
    table, a = step(table, treport("a", 1024, 1024), 13)
    assert (a.tokens_limit, a.tokens_reserved) == (768, 1024)  # its share drops, its running stays
    table, b = step(table, treport("b", 512, 1536), 14)
    assert b.tokens_limit == 512
    table, a = step(table, treport("a", 768, 768), 15)  # 256 of a's finished
    table, b = step(table, treport("b", 512, 1536), 16)
    assert b.tokens_limit == 768
    assert sum(x.tokens_reserved for x in table.leases.values()) <= 1536


def test_tokens_are_granted_of_the_lowest_pool_a_live_gateway_reported() -> None:
    table, _ = step(None, treport("a", 0, 0, pool=1000), 0)
    table = Table(table.leases, table.touched_ms, 0, table.capacity, table.server, table.tokens)
    _, b = step(table, treport("b", 0, 5000, pool=4000), 5)
    # a's floor is one request, at most half the pool: 500 of 1000 to each
    assert b.tokens == 1000 and b.tokens_limit == 500


def test_a_farm_stating_no_pool_shares_slots_alone_and_counts_what_runs() -> None:
    _, a = step(None, treport("a", 700, 900, pool=0), 0)
    assert (a.tokens_limit, a.tokens_reserved, a.tokens) == (0, 700, 0)


def test_a_token_share_below_one_whole_request_holds_the_slots_at_0() -> None:
    held = Held(4, 3, 0.0, 10.0, tokens=1536, tokens_limit=300, tokens_of=1536)
    local = local_limit(held, 8, 1.0, "", tokens=1536, request_tokens=512)
    assert (local.limit, local.tokens_limit) == (0, 0)  # arrivals wait; none refused
    assert "below one whole request (512)" in local.reason
    held = Held(4, 3, 0.0, 10.0, tokens=1536, tokens_limit=600, tokens_of=1536)
    local = local_limit(held, 8, 1.0, "", tokens=1536, request_tokens=512)
    assert (local.limit, local.tokens_limit) == (4, 600)
    assert "tokens 600 of 1536" in local.reason
