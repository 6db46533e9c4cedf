"""Fixtures for the sidecar end-to-end tests: a key, contract servers, sidecar processes."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # helpers, under --import-mode=importlib

from capacity_server import CapacityServer
from sidecar_e2e import SidecarProc


@pytest.fixture
def servers(key: str) -> Iterator[Callable[..., CapacityServer]]:
    """Start contract servers on 127.0.0.1:0 (stopped afterwards); keyword args go to ``set``."""
    started: list[CapacityServer] = []

    def start(server_key: str | None = None, **settings: Any) -> CapacityServer:
        server = CapacityServer(server_key or key).start()
        server.set(**settings)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def capacity(servers: Callable[..., CapacityServer]) -> CapacityServer:
    """One router answering ``workhorse: 20`` (complete, fresh)."""
    return servers()


@pytest.fixture
def entry(key_file: Path) -> Callable[..., dict[str, Any]]:
    """A provider entry opted in to discovery against ``server`` (models: workhorse)."""

    def make(
        server: CapacityServer | str, provider_id: str = "p1", **fields: Any
    ) -> dict[str, Any]:
        base_url = server if isinstance(server, str) else server.base_url
        doc: dict[str, Any] = {
            "id": provider_id,
            "type": "chat-completions-api",
            "baseUrl": base_url,
            "credentialFile": str(key_file),
            "capacityDiscovery": True,
            "models": {"local-workhorse": "workhorse"},
        }
        doc.update(fields)
        return doc

    return make


@pytest.fixture
def start_sidecar(tmp_path: Path) -> Iterator[Callable[..., SidecarProc]]:
    """Start ``gateway-capacity sidecar`` processes; every one is killed afterwards."""
    started: list[SidecarProc] = []

    def start(config: Path, segment: str, *extra: str, **kwargs: Any) -> SidecarProc:
        log_path = tmp_path / f"sidecar-{len(started)}.log"
        proc = SidecarProc(config, segment, log_path, *extra, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
