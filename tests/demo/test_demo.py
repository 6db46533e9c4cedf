"""The demo runs from the package alone and cleans up after itself (REQUIREMENTS.md section 11)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil


def _run_demo() -> dict[str, object]:
    exe = Path(sys.executable).with_name("gateway-capacity")
    out = subprocess.run(
        [str(exe), "demo", "--fast", "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    assert "advertised 20  limit 20 (discovered)" in out.stderr  # shown live
    return summary


def test_demo_shows_20_then_10_then_20_and_leaves_nothing_behind_twice_in_a_row() -> None:
    for _ in range(2):  # works when run twice in a row
        summary = _run_demo()
        assert summary["ok"] is True, summary["problems"]
        phases = summary["phases"]
        assert isinstance(phases, list)
        assert [p["expected_limit"] for p in phases] == [20, 10, 20]
        assert [p["advertised_seen"] for p in phases] == [[20], [10], [20]]
        assert all(p["reached_after_s"] is not None for p in phases)
        assert phases[1]["limits_seen"][0] == 10  # drained to 10
        assert summary["peak_running"] == 20  # reached, never above
        assert 0 < int(summary["peak_waiting"]) <= 32  # type: ignore[call-overload]
        assert (summary["final_running"], summary["final_waiting"]) == (0, 0)
        assert summary["holder_records_left"] == 0
        assert summary["cleaned_up"] is True
        load = summary["load"]
        assert isinstance(load, list) and {g["generation"] for g in load} == {
            "handler-1.0",
            "handler-2.0",
        }
        assert all(g["admitted"] > 0 for g in load)  # both generations drew on one budget
        segment = str(summary["segment"]).lstrip("/")
        assert segment.startswith("gwcap1-")
        if Path("/dev/shm").is_dir():  # the segment and every semaphore of it are gone
            assert not [p for p in Path("/dev/shm").iterdir() if segment in p.name]
    assert not [
        p
        for p in psutil.Process().children(recursive=True)
        if "gateway_capacity" in " ".join(p.cmdline())
    ]
