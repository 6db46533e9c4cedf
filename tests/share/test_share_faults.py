"""Share mode holds the farm's capacity in every fault, end to end: two gateways (a
sidecar, a segment and a handler process each), a real redis-server and a fake farm
that counts concurrent requests. Every gateway's static fallback (``maxConcurrent`` 4)
is the whole capacity, so a handler that ever ran on it beside another's share would
show; the farm's own peak is the judge. Lease 1.5 s."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from farm import Farm
from redis_rig import RedisServer
from share_rig import Blackhole, Gateway, wait_for

CAPACITY = 4
LEASE = 1.5
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"

Make = Callable[..., Gateway]


@pytest.fixture
def farm_capacity() -> int:
    return CAPACITY


@pytest.fixture
def make(tmp_path: Path, farm: Farm, redis_server: RedisServer, key_file: Path) -> Iterator[Make]:
    redis_server.fresh()
    made: list[Gateway] = []

    def make(name: str, **share: Any) -> Gateway:
        gw = Gateway(name, tmp_path, farm, redis_server, key_file, lease=LEASE, **share)
        made.append(gw)
        return gw

    yield make
    for gw in made:
        if gw.sidecar is not None and gw.sidecar.poll() is None:
            os.kill(gw.sidecar.pid, signal.SIGCONT)
        gw.cleanup()


def two(make: Make, **b_share: Any) -> tuple[Gateway, Gateway]:
    """Gateways a and b, loaded (6 threads each on capacity 4), split 2 and 2."""
    a, b = make("gw-a"), make("gw-b", **b_share)
    a.start_sidecar()
    b.start_sidecar()
    wait_for("two shares", lambda: a.source() == "share" and b.source() == "share")
    a.start_worker(6)
    b.start_worker(6)
    wait_for("a and b split", lambda: a.limit() == 2 and b.limit() == 2)
    return a, b


def held_capacity(farm: Farm, *gws: Gateway) -> None:
    for gw in gws:
        gw.stop_workers()
    assert farm.peak <= CAPACITY, farm.violations[:5]
    assert farm.violations == []
    assert farm.served == sum(gw.done for gw in gws)


def test_share_a_sidecar_stopped_past_its_lease_or_dead_leaves_its_handlers_at_0(
    make: Make, farm: Farm
) -> None:
    """a's sidecar is SIGSTOPped past its lease, resumed, then SIGKILLed; its handlers go
    on serving throughout, on 0 once its lease is over, and b takes a's share only then."""
    a, b = two(make)
    assert a.sidecar is not None
    os.kill(a.sidecar.pid, signal.SIGSTOP)
    try:
        wait_for("b takes a's share", lambda: b.limit() == CAPACITY, timeout=LEASE * 6)
        assert (a.limit(), a.source()) == (0, "share")  # the segment's fallback in share mode
    finally:
        os.kill(a.sidecar.pid, signal.SIGCONT)
    wait_for("a and b split again", lambda: a.limit() == 2 and b.limit() == 2, timeout=LEASE * 8)
    a.kill_sidecar()
    wait_for("b takes a's share again", lambda: b.limit() == CAPACITY, timeout=LEASE * 6)
    assert (a.limit(), a.source()) == (0, "share")
    assert b.check().returncode == 0
    held_capacity(farm, a, b)


def test_share_redis_stalled_for_less_than_a_lease_or_cut_off_never_goes_over(
    make: Make, farm: Farm, redis_server: RedisServer
) -> None:
    """Redis stops twice for 0.9 of a lease: no handler runs on its static fallback (the
    whole capacity here). Then b alone is cut off from Redis: it drops to 0 by its
    lease's end, and a takes b's share only after that."""
    hole = Blackhole(redis_server.port)
    try:
        a, b = two(make, redis_url=hole.url)
        seen: set[str] = set()
        for _ in range(2):
            redis_server.freeze()
            try:
                end = time.monotonic() + LEASE * 0.9
                while time.monotonic() < end:
                    seen.update((a.source(), b.source()))
                    time.sleep(0.05)
            finally:
                redis_server.thaw()
            time.sleep(LEASE / 2)
        assert seen == {"share"}
        hole.cut()
        wait_for("a takes b's share", lambda: a.limit() == CAPACITY, timeout=LEASE * 6)
        assert (b.limit(), b.source()) == (0, "share")
        check = b.check()
        assert check.returncode != 0 and "share degraded" in check.stdout
        hole.heal()
        wait_for("b has a share again", lambda: b.limit() >= 1, timeout=LEASE * 6)
        held_capacity(farm, a, b)
    finally:
        hole.close()


def test_share_a_second_instance_under_one_gateway_name_is_refused_loudly(
    make: Make, farm: Farm
) -> None:
    a = make("gw-a")
    a.start_sidecar()
    wait_for("a's share", lambda: a.source() == "share" and a.limit() >= 1)
    a.start_worker(6)
    twin = make("gw-twin", gateway="gw-a")  # the same config on another host
    twin.start_sidecar()
    assert twin.sidecar is not None
    assert twin.sidecar.wait(30) == 2  # exit 2: a configuration to fix, not restarted
    assert "held in Redis by another instance" in twin.log_text()
    twin.start_worker(6)
    assert twin.limit() == 0
    check = twin.check()
    assert check.returncode != 0 and "held in Redis by another instance" in check.stdout
    assert a.limit() == CAPACITY
    held_capacity(farm, a, twin)


@pytest.mark.skipif(not os.path.exists(FAKETIME_LIB), reason="libfaketime not installed")
def test_share_a_gateway_with_its_wall_clock_an_hour_behind_holds_the_floor(
    make: Make, farm: Farm
) -> None:
    a, b = make("gw-a"), make("gw-b")
    a.start_sidecar()
    # an hour behind: the farm's snapshots look an hour in the future to it (R-K4)
    b.start_sidecar(
        env={"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": "-1h", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    )
    wait_for("two shares", lambda: a.source() == "share" and b.source() == "share")
    a.start_worker(6)
    b.start_worker(6)
    wait_for("b holds its floor, a the rest", lambda: (a.limit(), b.limit()) == (3, 1))
    provider = b.provider()
    assert provider is not None and "off Redis's" in provider["reason"], provider
    check = b.check()
    assert check.returncode != 0 and "capacity unknown here" in check.stdout
    time.sleep(LEASE)
    held_capacity(farm, a, b)
    assert b.sidecar is not None
    pid = b.sidecar.pid
    b.kill_sidecar()  # SIGKILL: libfaketime's state of it is the rig's to remove
    left = (f"faketime_shm_{pid}", f"faketime_sem_{pid}")
    assert not [n for n in os.listdir("/dev/shm") if n.endswith(left)]
