"""The sidecar follows the gateway's config file live, and never writes it (R-C1, R-C3, R-C4)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from sidecar_e2e import EXE, Rig, cli_json, discovered, run_sidecar


def _fingerprint(path: Path) -> tuple[bytes, int, int, int]:
    st = os.stat(path)
    return path.read_bytes(), st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def _rewrite(path: Path, doc: dict[str, Any]) -> None:
    """Change the file in place, as an editor that does not rename would."""
    before = os.stat(path).st_mtime_ns
    path.write_text(json.dumps(doc))
    if os.stat(path).st_mtime_ns == before:  # coarse file system clock: make the change visible
        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


def test_r_c4_toggling_capacity_discovery_is_followed_live_and_r_c1_file_is_never_written(
    rig: Rig,
) -> None:
    capacity = rig.capacity
    on = {"maxConcurrent": 8, "providers": [rig.entry(capacity)]}
    off = {"maxConcurrent": 8, "providers": [rig.entry(capacity, capacityDiscovery=False)]}
    config = rig.write_config(on)
    sidecar = rig.start_discovered(config)

    _rewrite(config, off)
    written = _fingerprint(config)
    # "at once": the file is polled every second; 5 s is room for a loaded machine
    p = rig.wait("p1", lambda p: p["source"] == "gateway", timeout=5, what="static")
    assert p["effective_limit"] == 8 and p["capacity_discovery"] is False
    assert p["expires_at"] is None and p["discovered"] is None
    assert "capacityDiscovery off" in p["reason"]
    asked = capacity.requests
    time.sleep(1.0)  # three refreshes: no probe (and no key) goes out while discovery is off
    assert capacity.requests <= asked + 1  # at most the one in flight at the switch

    resumed_from = capacity.requests
    _rewrite(config, on)
    written = _fingerprint(config)
    rig.wait("p1", discovered(20), timeout=5, what="discovered again")
    assert rig.provider()["capacity_discovery"] is True
    assert capacity.requests > resumed_from

    time.sleep(1.1)  # another config poll and more publications
    sidecar.signal(15)
    assert sidecar.wait(10) == 0
    assert _fingerprint(config) == written  # R-C1: not written, renamed or touched


def test_r_c3_broken_edit_keeps_the_last_good_config_and_availability_says_so(
    rig: Rig,
) -> None:
    config = rig.config()
    sidecar = rig.start_discovered(config)
    assert cli_json("availability", "--segment", rig.segment)["config_status"] == "ok"

    before = os.stat(config).st_mtime_ns
    config.write_text('{"maxConcurrent": 8, "providers": [')  # an editor saved half a file
    if os.stat(config).st_mtime_ns == before:
        os.utime(config, ns=(before + 1_000_000, before + 1_000_000))

    def status() -> str:
        return str(cli_json("availability", "--segment", rig.segment)["config_status"])

    deadline = time.monotonic() + 5
    while status() == "ok" and time.monotonic() < deadline:
        time.sleep(0.1)
    text = status()
    assert "last good config" in text, text
    assert "not valid JSON" in text, text

    # still running on the last good config: still probing, still following the router
    rig.capacity.set(models={"workhorse": 10})
    rig.wait("p1", discovered(10), what="still discovering")
    time.sleep(1.2)
    broken = [line for line in sidecar.log_lines() if "last good config" in line]
    assert len(broken) == 1, broken  # logged once, not at every poll

    # a good edit is adopted, and the status clears
    _rewrite(config, {"maxConcurrent": 8, "providers": [rig.entry(rig.capacity, maxConcurrent=6)]})
    p = rig.wait("p1", discovered(6), timeout=5, what="good edit adopted")
    assert "provider maxConcurrent 6" in p["reason"]
    assert status() == "ok"


def test_r_p9_a_config_edit_probes_at_once_and_providers_come_and_go(rig: Rig) -> None:
    capacity = rig.capacity
    config = rig.config()
    rig.start(config, refresh=24.0)  # no timed refresh during the test
    rig.wait("p1", discovered(20), what="the probe at start")
    asked = capacity.requests
    capacity.set(models={"workhorse": 10})

    _rewrite(
        config,
        {
            "maxConcurrent": 8,
            "providers": [rig.entry(capacity), {"id": "added", "maxConcurrent": 2}],
        },
    )
    # the edit triggers a probe now, not in 24 s (R-P9), and the new provider is admitted for
    rig.wait("p1", discovered(10), timeout=5, what="probe on config change")
    assert capacity.requests == asked + 1
    added = rig.wait("added", lambda p: p["configured"], timeout=5)
    assert (added["effective_limit"], added["source"]) == (2, "provider")

    _rewrite(config, {"maxConcurrent": 8, "providers": [{"id": "added", "maxConcurrent": 2}]})
    gone = rig.wait("p1", lambda p: not p["configured"], timeout=5)
    # a provider dropped from the config keeps only its stored fallback
    assert (gone["effective_limit"], gone["source"]) == (8, "gateway"), gone
    assert rig.provider("added")["configured"] is True


@pytest.mark.parametrize(
    "problem", ["missing", "unreadable", "a-directory", "not-json", "providers-not-a-list"]
)
def test_r_c3_config_unusable_at_start_exits_2_with_one_clear_line(
    problem: str, segment_name: str, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.json"
    if problem == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads a mode-000 file anyway")
        config.write_text("{}")
        config.chmod(0)
    elif problem == "a-directory":
        config.mkdir()
    elif problem == "not-json":
        config.write_text("{ this is not json")
    elif problem == "providers-not-a-list":
        config.write_text('{"providers": {"id": "p1"}}')
    done = run_sidecar(config, segment_name, "--refresh", "0.3")
    assert done.returncode == 2, done
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert str(config) in lines[0], lines[0]
    assert done.stdout == ""
    # nothing was created: the operator's view says there is no segment
    view = subprocess.run(
        [EXE, "availability", "--segment", segment_name, "--json"], capture_output=True, timeout=30
    )
    assert view.returncode == 3
