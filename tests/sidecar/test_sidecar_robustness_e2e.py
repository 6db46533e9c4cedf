"""Sidecar robustness: what a review found and these tests keep fixed.

Each test names the failure it guards against; each ran red before its fix (the
refresh values 0 and -1 were refused already and are kept for completeness).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from capacity_server import CapacityServer
from sidecar_e2e import (
    EXE,
    Entry,
    StartSidecar,
    clean_env,
    discovered,
    provider_now,
    wait_provider,
)

from shm_layout.segment import unlink_segment


@pytest.fixture
def legacy() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_r_g3_a_drain_never_lapses_between_refreshes(
    segment_name: str,
    write_config: Callable[..., Path],
    servers: Callable[..., CapacityServer],
    entry: Entry,
    start_sidecar: StartSidecar,
    legacy: subprocess.Popen[bytes],
) -> None:
    """The router's snapshots are 27 s old, so what they discover expires 3 s after each
    probe; with a 20 s refresh the drain used to expire with them and let new work in."""
    router = servers(observed_offset=-27.0)
    config = write_config({"maxConcurrent": 8, "providers": [entry(router)]})
    start_sidecar(config, segment_name, "--await-legacy", str(legacy.pid), refresh=20.0)
    wait_provider(segment_name, "p1", lambda p: p["source"] == "legacy_drain")
    deadline = time.monotonic() + 7.0
    while time.monotonic() < deadline:
        p = provider_now(segment_name, "p1")
        assert p is not None and (p["effective_limit"], p["source"]) == (0, "legacy_drain"), p
        time.sleep(0.2)


def test_r_p9_touching_the_config_neither_discards_probes_nor_floods_the_log(
    segment_name: str,
    write_config: Callable[..., Path],
    servers: Callable[..., CapacityServer],
    entry: Entry,
    start_sidecar: StartSidecar,
) -> None:
    router = servers(delay=1.0)  # every answer takes 1 s
    config = write_config({"maxConcurrent": 8, "providers": [entry(router)]})
    sidecar = start_sidecar(config, segment_name, refresh=0.3)
    touched_until = time.monotonic() + 4.0
    while time.monotonic() < touched_until:  # same content, new mtime, every 0.3 s
        os.utime(config)
        time.sleep(0.3)
    wait_provider(segment_name, "p1", discovered(20), timeout=5)
    assert sidecar.log_text().count("change picked up") == 0


def test_r_g4_a_sidecar_whose_segment_was_removed_exits_1_instead_of_running_dark(
    segment_name: str,
    write_config: Callable[..., Path],
    capacity: CapacityServer,
    entry: Entry,
    start_sidecar: StartSidecar,
) -> None:
    from handler_shim import Admission

    config = write_config({"maxConcurrent": 8, "providers": [entry(capacity)]})
    sidecar = start_sidecar(config, segment_name)
    wait_provider(segment_name, "p1", discovered(20))
    unlink_segment(segment_name)  # what inspect --unlink --force does
    adm = Admission.attach(config=config, segment=segment_name)  # a handler makes a new one
    try:
        assert sidecar.wait(10) == 1  # Restart=on-failure brings it back onto the new one
        assert "was removed or replaced" in sidecar.log_text()
    finally:
        adm.close()


@pytest.mark.parametrize("refresh", ["0", "30", "inf", "nan", "-1"])
def test_r_p9_a_refresh_the_expiry_cannot_follow_is_refused(
    refresh: str, segment_name: str, write_config: Callable[..., Path]
) -> None:
    config = write_config({"providers": [{"id": "p"}]})
    out = subprocess.run(
        [EXE, "sidecar", "--config", str(config), "--segment", segment_name, "--refresh", refresh],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert out.returncode == 2
    assert "--refresh must be" in out.stderr


def test_a_full_provider_table_is_reported_and_the_sidecar_keeps_working(
    segment_name: str,
    write_config: Callable[..., Path],
    start_sidecar: StartSidecar,
) -> None:
    """Rows are never freed (handlers cache them), so renaming a provider in a config of
    64 needs a 65th row. That once killed every task of the sidecar silently."""
    providers = [{"id": f"p{i}", "maxConcurrent": 2} for i in range(64)]
    config = write_config({"providers": providers})
    sidecar = start_sidecar(config, segment_name)
    wait_provider(segment_name, "p63", lambda p: p["effective_limit"] == 2)
    providers[0] = {"id": "renamed", "maxConcurrent": 2}
    providers[1] = {"id": "p1", "maxConcurrent": 5}  # a change that must still apply
    config.write_text(json.dumps({"providers": providers}))
    wait_provider(segment_name, "p1", lambda p: p["effective_limit"] == 5, timeout=10)
    beat = json.loads(
        subprocess.run(
            [EXE, "availability", "--segment", segment_name, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
            env=clean_env(),
        ).stdout
    )["sidecar"]
    assert beat["alive"] and beat["heartbeat_age_s"] < 3
    assert sidecar.log_text().count("provider renamed: not published") == 1
