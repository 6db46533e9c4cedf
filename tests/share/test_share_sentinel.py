"""Share mode through a Sentinel set, with real processes: one master, one replica and
three sentinels (``redis-server --sentinel``) on loopback, two gateways (a sidecar, a
segment and a handler process each) under a steady load above a fake farm's capacity.
The master is SIGKILLed, or SIGSTOPped past the sentinels' failover; every Redis
process is stopped for three leases and restarted empty. In each the farm's own count
of what runs at once is the judge (every gateway's static fallback is the whole
capacity, so a handler that ran on it beside another's share would show), and the
longest time the farm started nothing is printed (docs/share.md quotes it)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from farm import Farm
from redis_rig import RedisServer
from sentinel_rig import DOWN_AFTER_MS, MASTER_NAME, SentinelSet
from share_rig import Gateway, wait_for

CAPACITY = 4
LEASE = 2.0


@pytest.fixture
def farm_capacity() -> int:
    return CAPACITY


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    found = SentinelSet(tmp_path / "redis")
    found.start()
    yield found
    found.stop()


@pytest.fixture
def outage() -> str | None:
    """The gateways' ``outage`` rule (with ``gateways`` 2); None: no rule declared."""
    return None


@pytest.fixture
def gateways(
    tmp_path: Path, farm: Farm, sentinels: SentinelSet, key_file: Path, outage: str | None
) -> Iterator[list[Gateway]]:
    made = []
    rule = {} if outage is None else {"gateways": 2, "outage": outage}
    for name in ("gw-a", "gw-b"):
        gw = Gateway(name, tmp_path, farm, sentinels.master, key_file, lease=LEASE, **rule)
        doc = json.loads(gw.config.read_text())
        del doc["capacityShare"]["redis"]
        doc["capacityShare"]["sentinel"] = {"master": MASTER_NAME, "addresses": sentinels.addresses}
        gw.config.write_text(json.dumps(doc))
        made.append(gw)
    try:
        for gw in made:
            gw.start_sidecar()
        # set-up, not a behaviour: a generous wait for a machine loaded by other jobs
        wait_for("two shares", lambda: all(gw.source() == "share" for gw in made), timeout=60)
        for gw in made:
            gw.start_worker(6)  # 12 threads on a capacity of 4
        wait_for("a and b split", lambda: [gw.limit() for gw in made] == [2, 2], timeout=60)
        yield made
    finally:
        for gw in made:
            if gw.sidecar is not None and gw.sidecar.poll() is None:
                os.kill(gw.sidecar.pid, signal.SIGCONT)
            gw.cleanup()


def _served_again(farm: Farm, gws: list[Gateway], timeout: float) -> None:
    wait_for("both gateways granted again", lambda: [g.limit() for g in gws] == [2, 2], timeout)
    served = farm.served
    wait_for("the farm serving", lambda: farm.served > served + 20, timeout)


def _judge(farm: Farm, gws: list[Gateway], since: float, what: str) -> None:
    gap = farm.longest_gap(since)
    print(f"\n{what}: farm peak {farm.peak} of {CAPACITY}, admitted nothing for {gap:.2f} s")
    for gw in gws:
        gw.stop_workers()
    assert farm.violations == [], farm.violations
    assert farm.peak <= CAPACITY


def test_share_a_sigkilled_sentinel_master_fails_over_without_going_over(
    farm: Farm, sentinels: SentinelSet, gateways: list[Gateway]
) -> None:
    assert sentinels.master.proc is not None
    since = time.monotonic()
    sentinels.master.proc.kill()
    sentinels.wait(lambda: sentinels.master_port() == sentinels.replica.port, "the failover")
    _served_again(farm, gateways, timeout=LEASE * 10)
    logs = "".join(gw.log_text() for gw in gateways)
    assert "capacityShare" in logs
    _judge(farm, gateways, since, "master SIGKILLed")


def test_share_a_sentinel_master_sigstopped_past_the_failover_never_goes_over(
    farm: Farm, sentinels: SentinelSet, gateways: list[Gateway]
) -> None:
    """The old master, stopped with calls in its socket buffers, runs them when it
    continues: answers nobody waits for any more, on a table the sentinels then
    replace by the new master's."""
    old = sentinels.master.proc
    assert old is not None
    since = time.monotonic()
    os.kill(old.pid, signal.SIGSTOP)
    try:
        sentinels.wait(lambda: sentinels.master_port() == sentinels.replica.port, "the failover")
        time.sleep(DOWN_AFTER_MS / 1000)
    finally:
        os.kill(old.pid, signal.SIGCONT)
    _served_again(farm, gateways, timeout=LEASE * 10)
    _judge(farm, gateways, since, "master SIGSTOPped past the failover")


@pytest.mark.parametrize("outage", ["keep", "hold"])
def test_share_every_redis_process_stopped_for_three_leases_then_restarted_empty(
    farm: Farm, sentinels: SentinelSet, gateways: list[Gateway], outage: str
) -> None:
    """With the outage rule kept (``gateways`` 2 on a capacity of 4) each gateway keeps
    its part, 1, through the outage and the farm serves 2 of 4; held, every gateway holds
    0 and the farm serves nothing until Redis answers and the table is rebuilt."""
    kept = 1 if outage == "keep" else 0
    since = time.monotonic()
    sentinels.stop()
    time.sleep(LEASE * 3)
    wait_for(f"every gateway at {kept}", lambda: all(g.limit() == kept for g in gateways))
    check = gateways[0].check()
    assert check.returncode != 0 and "share degraded" in check.stdout
    before = farm.served
    time.sleep(0.5)
    assert (farm.served > before) == bool(kept)
    sentinels.start()
    _served_again(farm, gateways, timeout=LEASE * 10)
    _judge(
        farm,
        gateways,
        since,
        f"every Redis process stopped for 3 leases, restarted empty, outage {outage}",
    )


def test_the_lua_script_on_a_promoted_replica_drops_the_copy_it_was_sent(
    sentinels: SentinelSet,
) -> None:
    """The table a replica holds was written by the master (``~server`` is the master's
    run_id): once the replica is promoted, the first call rebuilds it."""
    from sidecar.share import STEP_LUA, table_key
    from sidecar.shares import table_ttl_ms

    lease = 10_000
    master = sentinels.master.client()
    key = table_key("failover")
    args = ["a", 10, 0, 8, 1, lease, table_ttl_ms(lease), "t", 1]
    master.register_script(STEP_LUA)(keys=[key], args=args)
    replica: RedisServer = sentinels.replica
    sentinels.wait(lambda: replica.client().exists(key) == 1, "the table replicated")
    assert sentinels.sentinel_client().sentinel_failover(MASTER_NAME)
    sentinels.wait(lambda: sentinels.master_port() == replica.port, "the failover")
    sentinels.wait(
        lambda: replica.client().info("replication")["role"] == "master", "the promotion"
    )
    script = replica.client().register_script(STEP_LUA)
    out = script(keys=[key], args=["a", 10, 0, 8, 1, lease, table_ttl_ms(lease), "t", 2])
    assert int(out[3]) == 1  # rebuilding: the copy is not trusted
    assert int(out[0]) == 0  # a holds nothing it reported, so nothing is granted yet
