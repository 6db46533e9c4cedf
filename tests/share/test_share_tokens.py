"""Share mode shares the farm's token pool as it shares its slots (R-T7): real sidecars, real
segments and handler processes, one real redis-server, a fake farm whose capacity rows
state a token pool (R-K7)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from farm import Farm
from redis_rig import RedisServer
from share_rig import LEASE, Gateway, wait_for

POOL = 1536
PER_REQUEST = 512


@pytest.fixture
def farm_capacity() -> int:
    return 9


@pytest.fixture
def gateways(
    tmp_path: Path, farm: Farm, redis_server: RedisServer, key_file: Path
) -> Iterator[list[Gateway]]:
    farm.tokens = (PER_REQUEST, POOL)
    redis_server.fresh()
    gws = [Gateway(f"gw-{n}", tmp_path, farm, redis_server, key_file) for n in "ab"]
    for gw in gws:
        gw.start_sidecar()
    try:
        yield gws
    finally:
        for gw in gws:
            gw.cleanup()


def tokens(gw: Gateway) -> int:
    p: Any = gw.provider()
    return 0 if p is None or p.get("token_limit") is None else int(p["token_limit"])


def test_share_each_gateway_holds_a_token_share_and_their_sum_stays_within_the_pool(
    gateways: list[Gateway], farm: Farm
) -> None:
    a, b = gateways
    wait_for(
        "both hold a token share of at least one request",
        lambda: all(gw.source() == "share" and tokens(gw) >= PER_REQUEST for gw in gateways),
        timeout=LEASE * 15,
    )
    a.start_worker(6)
    end = time.monotonic() + LEASE * 2
    while time.monotonic() < end:  # while a's demand moves, never more than the pool
        assert tokens(a) + tokens(b) <= POOL, (tokens(a), tokens(b))
        time.sleep(0.05)
    a.stop_workers()
    p: Any = a.provider()
    assert f"of {POOL}" in p["reason"], p["reason"]
    assert farm.violations == []
