"""Sidecar robustness: a drain between refreshes, a touched config, a segment removed
under the sidecar, refresh values the expiry cannot follow, a full provider table.

Each test names the failure it guards against.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from sidecar_e2e import EXE, Rig, clean_env, discovered, provider_now, run_sidecar

from shm_layout.segment import unlink_segment


def test_r_g3_a_drain_never_lapses_between_refreshes(
    rig: Rig, legacy: subprocess.Popen[bytes]
) -> None:
    """The router's snapshots are 27 s old, so what they discover expires 3 s after each
    probe; with a 20 s refresh the drain must outlast them, not expire with them and let
    new work in."""
    rig.capacity.set(observed_offset=-27.0)
    rig.start(rig.config(), "--await-legacy", str(legacy.pid), refresh=20.0)
    rig.wait("p1", lambda p: p["source"] == "legacy_drain")
    deadline = time.monotonic() + 7.0
    while time.monotonic() < deadline:
        p = provider_now(rig.segment, "p1")
        assert p is not None and (p["effective_limit"], p["source"]) == (0, "legacy_drain"), p
        time.sleep(0.2)


def test_r_p9_touching_the_config_neither_discards_probes_nor_floods_the_log(rig: Rig) -> None:
    rig.capacity.set(delay=1.0)  # every answer takes 1 s
    config = rig.config()
    sidecar = rig.start(config, refresh=0.3)
    touched_until = time.monotonic() + 4.0
    while time.monotonic() < touched_until:  # same content, new mtime, every 0.3 s
        os.utime(config)
        time.sleep(0.3)
    rig.wait("p1", discovered(20), timeout=5)
    assert sidecar.log_text().count("change picked up") == 0


def test_r_g4_a_sidecar_whose_segment_was_removed_exits_1_instead_of_running_dark(
    rig: Rig,
) -> None:
    from handler_shim import Admission

    config = rig.config()
    sidecar = rig.start_discovered(config)
    unlink_segment(rig.segment)  # what inspect --unlink --force does
    adm = Admission.attach(config=config, segment=rig.segment)  # a handler makes a new one
    try:
        assert sidecar.wait(10) == 1  # Restart=on-failure brings it back onto the new one
        assert "was removed or replaced" in sidecar.log_text()
    finally:
        adm.close()


@pytest.mark.parametrize("refresh", ["0", "30", "inf", "nan", "-1"])
def test_r_p9_a_refresh_the_expiry_cannot_follow_is_refused(refresh: str, rig: Rig) -> None:
    config = rig.write_config({"providers": [{"id": "p"}]})
    out = run_sidecar(config, rig.segment, "--refresh", refresh)
    assert out.returncode == 2
    assert "--refresh must be" in out.stderr


def test_a_full_provider_table_is_reported_and_the_sidecar_keeps_working(rig: Rig) -> None:
    """Rows are never freed (handlers cache them), so renaming a provider in a config of
    64 needs a 65th row: the full table is reported and the sidecar's tasks go on."""
    providers = [{"id": f"p{i}", "maxConcurrent": 2} for i in range(64)]
    config = rig.write_config({"providers": providers})
    sidecar = rig.start(config)
    rig.wait("p63", lambda p: p["effective_limit"] == 2)
    providers[0] = {"id": "renamed", "maxConcurrent": 2}
    providers[1] = {"id": "p1", "maxConcurrent": 5}  # a change that must still apply
    config.write_text(json.dumps({"providers": providers}))
    rig.wait("p1", lambda p: p["effective_limit"] == 5, timeout=10)
    beat = json.loads(
        subprocess.run(
            [EXE, "availability", "--segment", rig.segment, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
            env=clean_env(),
        ).stdout
    )["sidecar"]
    assert beat["alive"] and beat["heartbeat_age_s"] < 3
    assert sidecar.log_text().count("provider renamed: not published") == 1
