from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # helpers, under --import-mode=importlib

from farm import Farm
from redis_rig import RedisServer
from share_rig import REFRESH


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def farm_capacity() -> int:
    """The slots of the ``farm`` fixture's one provider; a module overrides it."""
    return 4


@pytest.fixture
def farm(key: str, farm_capacity: int) -> Iterator[Farm]:
    """A fake farm whose answers outlast three of the sidecars' refreshes."""
    farm = Farm(key, farm_capacity, grace=REFRESH * 3 + 0.5)
    yield farm
    farm.stop()
