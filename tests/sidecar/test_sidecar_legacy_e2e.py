"""Upgrade from a handler generation that cannot share counters (R-G3)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from capacity_server import CapacityServer
from sidecar_e2e import (
    Entry,
    StartSidecar,
    cli_json,
    cli_providers,
    discovered,
    wait_provider,
)


@pytest.fixture
def legacy() -> Iterator[subprocess.Popen[bytes]]:
    """The old handler generation: a real process that runs until the test ends it."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("how", ["pid", "pidfile"])
def test_r_g3_legacy_drain_holds_new_work_until_the_legacy_process_exits(
    how: str,
    legacy: subprocess.Popen[bytes],
    segment_name: str,
    write_config: Callable[..., Path],
    capacity: CapacityServer,
    entry: Entry,
    tmp_path: Path,
    start_sidecar: StartSidecar,
    agents: Callable[..., Any],
) -> None:
    config = write_config(
        {"maxConcurrent": 8, "providers": [entry(capacity), {"id": "static", "maxConcurrent": 3}]}
    )
    target = str(legacy.pid)
    if how == "pidfile":
        pidfile = tmp_path / "legacy-handler.pid"
        pidfile.write_text(f"{legacy.pid}\n")
        target = str(pidfile)
    start_sidecar(config, segment_name, "--await-legacy", target)

    p = wait_provider(
        segment_name, "p1", lambda p: p["source"] == "legacy_drain", what="legacy_drain"
    )
    assert p["effective_limit"] == 0 and "legacy" in p["reason"]
    doc = cli_json("availability", "--segment", segment_name)
    assert doc["sidecar"]["legacy_alive"] == 1
    shown = {p["id"]: p for p in doc["providers"]}
    assert (shown["static"]["effective_limit"], shown["static"]["source"]) == (3, "provider")

    # a new handler on the opted-in provider queues; the static provider is unaffected
    waiter = agents("--segment", segment_name, "--provider", "p1", "hold")
    waiter.expect("started")
    other = agents("--segment", segment_name, "--provider", "static", "hold")
    other.expect("admitted")
    wait_provider(segment_name, "p1", lambda p: (p["running"], p["waiting"]) == (0, 1))
    p = wait_provider(segment_name, "p1", lambda p: p["discovered"] == 20, what="discovered")
    assert p["source"] == "legacy_drain" and p["effective_limit"] == 0  # still draining

    legacy.kill()
    legacy.wait()
    # the discovered budget applies at once: the housekeeping tick notices within 0.5 s
    wait_provider(segment_name, "p1", discovered(20), timeout=5, what="drain over")
    waiter.expect("admitted", timeout=5)
    shown = cli_providers(segment_name)
    assert (shown["p1"]["running"], shown["p1"]["waiting"]) == (1, 0)
    assert shown["static"]["effective_limit"] == 3
    assert cli_json("availability", "--segment", segment_name)["sidecar"]["legacy_alive"] == 0
