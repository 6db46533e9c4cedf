"""Share mode through a Redis outage, with real processes: two gateways (a sidecar, a
segment and a handler process each) declare the outage rule (``gateways`` 2) under a
steady load above a fake farm's capacity of 4, and their one redis-server is SIGKILLed
for three leases, then started again empty on its port. With ``outage`` "keep" each
gateway keeps its part, floor(4 x 0.5 / 2) = 1, and the farm serves through the outage;
with "hold" every gateway holds 0 and the farm serves nothing. The farm's own count is
the judge of the capacity (each gateway's static fallback is the whole capacity). The
Sentinel form, every Redis process stopped, is ``make share-failover``
(test_share_sentinel.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from farm import Farm
from redis_rig import RedisServer
from share_rig import LEASE, Gateway, wait_for

CAPACITY = 4


@pytest.fixture
def farm_capacity() -> int:
    return CAPACITY


@pytest.fixture
def redis_alone(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, to be killed and started again."""
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("outage", ["keep", "hold"])
def test_share_one_redis_killed_for_three_leases_keeps_each_part_or_holds_0(
    tmp_path: Path, farm: Farm, redis_alone: RedisServer, key_file: Path, outage: str
) -> None:
    gws = [
        Gateway(name, tmp_path, farm, redis_alone, key_file, gateways=2, outage=outage)
        for name in ("gw-a", "gw-b")
    ]
    kept = 1 if outage == "keep" else 0
    try:
        for gw in gws:
            gw.start_sidecar()
        # set-up, not a behaviour: a generous wait for a machine loaded by other jobs
        wait_for("two shares", lambda: all(gw.source() == "share" for gw in gws), timeout=60)
        for gw in gws:
            gw.start_worker(6)  # 12 threads on a capacity of 4
        wait_for("a and b split", lambda: [gw.limit() for gw in gws] == [2, 2], timeout=60)
        since = time.monotonic()
        redis_alone.stop()  # SIGKILL
        wait_for(
            f"every gateway on {kept} once its lease lapsed",
            lambda: [gw.limit() for gw in gws] == [kept, kept],
            timeout=LEASE * 5,
        )
        lapsed = time.monotonic()
        check = gws[0].check()
        assert check.returncode != 0 and "share degraded" in check.stdout
        if kept:
            assert "keeping its outage part 1 of 4" in check.stdout, check.stdout
        else:
            assert "holding 0 until Redis grants again" in check.stdout, check.stdout
        # what was admitted before the lapse has reached the farm: count from here
        time.sleep(0.5)
        before = farm.served
        time.sleep(max(LEASE, lapsed + LEASE * 3 - time.monotonic()))
        during = farm.served - before
        print(f"\n{outage}: {during} served in {time.monotonic() - lapsed - 0.5:.1f} s of outage")
        redis_alone.start()  # empty, on the same port
        wait_for(
            "both gateways granted again",
            lambda: [gw.limit() for gw in gws] == [2, 2],
            timeout=LEASE * 10,
        )
        served = farm.served
        wait_for("the farm serving", lambda: farm.served > served + 20, timeout=LEASE * 10)
        gap = farm.longest_gap(since)
        print(
            f"\none Redis killed for 3 leases, outage {outage}: farm peak {farm.peak} of "
            f"{CAPACITY}, {during} served while it was down, admitted nothing for {gap:.2f} s"
        )
        for gw in gws:
            gw.stop_workers()
        assert farm.violations == [], farm.violations
        assert farm.peak <= CAPACITY
        if kept:  # each gateway's part served through the outage
            assert during > 0
        else:
            assert during == 0
        logs = "".join(gw.log_text() for gw in gws)
        assert "in an outage" in logs
    finally:
        for gw in gws:
            gw.cleanup()


def test_share_a_gateway_beyond_the_declared_most_is_refused_loudly(
    tmp_path: Path, farm: Farm, redis_server: RedisServer, key_file: Path
) -> None:
    """``gateways`` 1 declared and a second gateway started: the table refuses it while
    the first is live (ERROR, exit 2, 0 with the reason, ``--check`` fails), and it
    never keeps a part; the first keeps its part and the rest."""
    redis_server.fresh()
    a = Gateway("gw-a", tmp_path, farm, redis_server, key_file, gateways=1)
    b = Gateway("gw-b", tmp_path, farm, redis_server, key_file, gateways=1)
    try:
        a.start_sidecar()
        wait_for("a's share", lambda: a.source() == "share" and a.limit() >= 1, timeout=60)
        b.start_sidecar()
        assert b.sidecar is not None
        assert b.sidecar.wait(60) == 2  # exit 2: a configuration to fix, not restarted
        assert "gateway(s) are live in Redis already" in b.log_text()
        assert b.limit() == 0
        check = b.check()
        assert check.returncode != 0 and "capacityShare.gateways declares" in check.stdout
        a.start_worker(6)
        wait_for("a grows to the whole capacity", lambda: a.limit() == CAPACITY, timeout=30)
        a.stop_workers()
        assert farm.peak <= CAPACITY
    finally:
        a.cleanup()
        b.cleanup()
