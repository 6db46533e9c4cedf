"""Share mode end to end: three gateways (sidecar, segment, handler processes each), one
redis-server and a fake farm that counts concurrent requests. The invariant is checked
from the farm's side: the sum of running never exceeds the capacity in force."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from farm import Farm
from redis_rig import RedisServer
from share_rig import LEASE, Gateway, wait_for

CAPACITY = 9


@pytest.fixture
def farm_capacity() -> int:
    return CAPACITY


@pytest.fixture
def gateways(
    tmp_path: Path, farm: Farm, redis_server: RedisServer, key_file: Path
) -> Iterator[list[Gateway]]:
    redis_server.fresh()
    gws = [Gateway(f"gw-{n}", tmp_path, farm, redis_server, key_file) for n in "abc"]
    for gw in gws:
        gw.start_sidecar()
    try:
        wait_for(
            "three shares", lambda: all(gw.source() == "share" and gw.limit() >= 1 for gw in gws)
        )
        yield gws
    finally:
        for gw in gws:
            gw.cleanup()


def shares(gws: list[Gateway]) -> list[int]:
    return [gw.limit() for gw in gws]


def test_share_demand_moves_and_running_never_exceeds_capacity(
    gateways: list[Gateway], farm: Farm
) -> None:
    a, b, _c = gateways
    a.start_worker(12)
    wait_for("a grows to all but the others' floors", lambda: a.limit() == CAPACITY - 2)
    assert all(p is not None and p["source"] == "share" for p in (a.provider(), b.provider()))
    b.start_worker(12)
    wait_for("a and b split", lambda: sorted(shares(gateways)) == [1, 4, 4])
    verify = a.verify()  # the share rests on the capacity the rules give
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert json.loads(verify.stdout)["providers"][0]["segment_source"] == "share"
    a.stop_workers()
    wait_for("b takes what a gave up", lambda: b.limit() == CAPACITY - 2)
    b.stop_workers()
    assert farm.violations == []
    assert farm.peak <= CAPACITY
    assert farm.served == a.done + b.done  # nothing lost


def test_share_a_sigkilled_gateway_returns_its_share_after_a_lease(
    gateways: list[Gateway], farm: Farm
) -> None:
    a, b, _c = gateways
    a.start_worker(12)
    b.start_worker(12)
    wait_for("a and b split", lambda: a.limit() == 4 and b.limit() == 4)
    killed = time.monotonic()
    a.kill_all()  # sidecar and handlers SIGKILLed
    wait_for("b gets a's share", lambda: b.limit() == CAPACITY - 1, timeout=LEASE * 5)
    assert time.monotonic() - killed < LEASE * 4
    b.stop_workers()
    assert farm.violations == []


def test_share_redis_stopped_longer_than_a_lease_holds_0_then_recovers(
    gateways: list[Gateway], farm: Farm, redis_server: RedisServer
) -> None:
    a = gateways[0]
    a.start_worker(12)
    wait_for("a grows", lambda: a.limit() == CAPACITY - 2)
    redis_server.freeze()
    try:
        wait_for("a holds 0 once its lease is over", lambda: a.limit() == 0, timeout=LEASE * 5)
        check = a.check()
        assert check.returncode != 0 and "share degraded" in check.stdout
        assert all(gw.limit() == 0 for gw in gateways)
    finally:
        redis_server.thaw()
    wait_for("a grows again", lambda: a.limit() == CAPACITY - 2, timeout=LEASE * 6)
    assert a.check().returncode == 0
    a.stop_workers()
    assert farm.violations == []
    warnings = [ln for ln in a.log_text().splitlines() if "WARNING" in ln and "capacityShare" in ln]
    assert len(warnings) == 1, warnings


def test_share_redis_restarted_empty_is_rebuilt_without_going_over(
    gateways: list[Gateway], farm: Farm, redis_server: RedisServer
) -> None:
    a, b, _c = gateways
    a.start_worker(12)
    b.start_worker(12)
    wait_for("a and b split", lambda: a.limit() == 4 and b.limit() == 4)
    redis_server.stop()
    redis_server.start()  # empty: nothing saved
    time.sleep(LEASE * 2)
    wait_for("shares again", lambda: sorted(shares(gateways)) == [1, 4, 4], timeout=LEASE * 6)
    a.stop_workers()
    b.stop_workers()
    assert farm.violations == []


def test_share_a_stale_lease_written_by_hand_expires(
    gateways: list[Gateway], farm: Farm, redis_server: RedisServer
) -> None:
    a, _b, _c = gateways
    client: Any = redis_server.client()
    key = "gateway-capacity:share:{p1}"
    a.start_worker(12)
    wait_for("a grows", lambda: a.limit() == CAPACITY - 2)
    seconds, micros = client.time()  # the server's clock, as the script reads it
    expires_ms = seconds * 1000 + micros // 1000 + int(LEASE * 1500)
    client.hset(key, "g:ghost", f"5 5 {expires_ms}")  # a lease nobody renews
    # the ghost's 5 are reserved: a's limit drops (its running stay reserved, and
    # nothing more is granted while the sum is over the capacity)
    wait_for("a shrinks", lambda: a.limit() <= CAPACITY - 2 - 5, timeout=LEASE)
    wait_for("the ghost's share returns", lambda: a.limit() == CAPACITY - 2, timeout=LEASE * 5)
    a.stop_workers()
    assert farm.violations == []


def test_share_capacity_dropping_under_the_running_total_admits_nothing_new(
    gateways: list[Gateway], farm: Farm
) -> None:
    for gw in gateways:
        gw.start_worker(6, hold_ms=150)
    wait_for("three shares of 3", lambda: shares(gateways) == [3, 3, 3])
    farm.set_capacity(4)
    wait_for("shares of 4", lambda: sum(shares(gateways)) <= 4 and min(shares(gateways)) >= 1)
    time.sleep(1.0)
    farm.set_capacity(CAPACITY)
    wait_for("three shares of 3 again", lambda: shares(gateways) == [3, 3, 3])
    for gw in gateways:
        gw.stop_workers()
    assert farm.violations == []
    assert farm.served == sum(gw.done for gw in gateways)
