"""Fixtures for the capacity router tests: real servers on loopback, port 0."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # router_support, under --import-mode=importlib

from gwtest import stopped_at_exit
from router_support import KEY, ScriptedServer, write_registry

from capacity_router import RouterServer, SimWorker


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "router.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, KEY.encode() + b"\r\n")
    os.close(fd)
    return path


@pytest.fixture
def registry_path(tmp_path: Path) -> Path:
    return tmp_path / "workers.json"


@pytest.fixture
def sim() -> Iterator[Callable[..., SimWorker]]:
    with stopped_at_exit(SimWorker.stop) as keep:

        def make(slots: int = 10, host: str = "127.0.0.1") -> SimWorker:
            w = SimWorker(slots=slots, host=host)
            w.start()
            return keep(w)

        yield make


@pytest.fixture
def router(registry_path: Path, key_file: Path) -> Iterator[Callable[..., RouterServer]]:
    with stopped_at_exit(RouterServer.stop) as keep:

        def make(
            workers: list[dict[str, Any]] | None = None,
            poll_interval: float = 0.2,
            poll_timeout: float = 1.0,
        ) -> RouterServer:
            if workers is not None:
                write_registry(registry_path, workers)
            r = RouterServer(
                registry_path, key_file, poll_interval=poll_interval, poll_timeout=poll_timeout
            )
            r.start()
            return keep(r)

        yield make


@pytest.fixture
def scripted() -> Iterator[Callable[[], ScriptedServer]]:
    with stopped_at_exit(ScriptedServer.stop) as keep:
        yield lambda: keep(ScriptedServer())
